// `ductile agent` to an etcd that speaks only TLS and authenticates its
// clients by certificate (--client-cert-auth), with certificates the test
// makes with openssl; and the agents' snapshot copies over TLS with the
// same certificates.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include <nlohmann/json.hpp>

#include "../../agent/src/snapshot_server.hpp"
#include "agent_job.hpp"
#include "ductile/error.hpp"
#include "process.hpp"
#include "snapshot_worker.hpp"

using namespace ductile::test;

TEST_CASE("agent: TLS to etcd with client certificates - plaintext and wrong CAs refused") {
  TempDir dir;
  const std::string marker = new_marker();
  TlsFiles tls = make_certificates(dir.path(), "job");
  TlsFiles other = make_certificates(dir.path(), "other");  // a CA etcd does not trust
  EtcdServer etcd(dir.path(), tls);
  auto config = dir.write("job.toml", kJobToml);
  const std::vector<std::string> tls_options = {"--rdzv-cacert", tls.ca.string(),
                                                "--rdzv-cert",   tls.client_cert.string(),
                                                "--rdzv-key",    tls.client_key.string()};
  auto agent_argv = [&](const std::string& name, const std::string& rdzv,
                        const std::vector<std::string>& options) {
    std::vector<std::string> argv = {DUCTILE_CLI,        "agent", "--config",    config.string(),
                                     "--rdzv",           rdzv,    "--job-id",    "tls",
                                     "--node-id",        name,    "--node-addr", "127.0.0.1",
                                     "--nproc-per-node", "1",     "--min-nodes", "2",
                                     "--settle",         "0",     "--lease-ttl", "2"};
    argv.insert(argv.end(), options.begin(), options.end());
    for (const char* a : {"--", "/bin/sh", "-c", "echo \"rank $RANK of $WORLD_SIZE over TLS\""})
      argv.push_back(a);
    return argv;
  };

  // A job over TLS: two agents form a round and their workers finish.
  Child a(agent_argv("a", etcd.url(), tls_options), {marker}, dir / "a.log");
  Child b(agent_argv("b", etcd.url(), tls_options), {marker}, dir / "b.log");
  auto sa = a.wait(120s), sb = b.wait(120s);
  if (sa != std::optional<int>(0) || sb != std::optional<int>(0))
    std::cout << a.output() << b.output();
  CHECK(sa == std::optional<int>(0));
  CHECK(sb == std::optional<int>(0));
  CHECK(count_of(a.output() + b.output(), " of 2 over TLS") == 2);
  CHECK(a.output().find("joined job 'tls' on etcd at " + etcd.endpoint()) != std::string::npos);

  // torchrun's spelling: --rdzv-conf protocol=https,cacert=...,cert=...,key=...
  auto r = run_process({DUCTILE_CLI,
                        "agent",
                        "--nnodes",
                        "1",
                        "--nproc-per-node",
                        "1",
                        "--rdzv-backend",
                        "etcd",
                        "--rdzv-endpoint",
                        etcd.host_port(),
                        "--rdzv-id",
                        "tls-torchrun",
                        "--local-addr",
                        "127.0.0.1",
                        "--rdzv-conf",
                        "protocol=https,cacert=" + tls.ca.string() +
                            ",cert=" + tls.client_cert.string() + ",key=" + tls.client_key.string(),
                        "--no-python",
                        "/bin/sh",
                        "-c",
                        "echo torchrun spelling over TLS"},
                       {marker});
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("torchrun spelling over TLS") != std::string::npos);

  // TLS options with a plaintext endpoint: refused before anything is sent.
  const std::string plain = "etcd://" + etcd.host_port();
  r = run_process(agent_argv("c", plain, tls_options), {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv '" + plain +
                   "' is plaintext HTTP but TLS is configured (--rdzv-cacert, --rdzv-cert, "
                   "--rdzv-key): give the etcd's TLS endpoint as https://" +
                   etcd.host_port()) != std::string::npos);
  // No client certificate: etcd refuses the connection.
  r = run_process(agent_argv("c", etcd.url(), {"--rdzv-cacert", tls.ca.string()}), {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("cannot reach etcd for --rdzv " + etcd.url()) != std::string::npos);
  // Nor could its snapshots be copied over TLS: it says so at its start.
  CHECK((r.out + r.err)
            .find("warning: the etcd is reached over TLS, but the snapshot copies between agents "
                  "run over plain TCP (readable by anyone who can reach the agents' snapshot "
                  "ports: no DUCTILE_RDZV_SECRET either): give --rdzv-cert and --rdzv-key") !=
        std::string::npos);
  // A certificate of a CA etcd does not trust, and a CA that did not sign
  // etcd's certificate: refused both ways.
  r = run_process(agent_argv("c", etcd.url(),
                             {"--rdzv-cacert", tls.ca.string(), "--rdzv-cert",
                              other.client_cert.string(), "--rdzv-key", other.client_key.string()}),
                  {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("cannot reach etcd for --rdzv " + etcd.url()) != std::string::npos);
  r = run_process(agent_argv("c", etcd.url(),
                             {"--rdzv-cacert", other.ca.string(), "--rdzv-cert",
                              tls.client_cert.string(), "--rdzv-key", tls.client_key.string()}),
                  {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("cannot reach etcd for --rdzv " + etcd.url()) != std::string::npos);
  CHECK(r.err.find("SSL") != std::string::npos);
  // A forged record needs etcd's trust: a client with a certificate of
  // another CA cannot write under the job's prefix (nor read), so the
  // node keys, rounds and done records a TLS job reads are its agents'.
  const std::string forged = "/ductile/agent/tls/done/1/a";
  ductile::agent::EtcdTls foreign{tls.ca.string(), other.client_cert.string(),
                                  other.client_key.string()};
  ductile::agent::EtcdStore intruder(etcd.endpoint(), 2000ms, foreign);
  CHECK_THROWS_AS(intruder.put(forged, R"({"node":"a","round":1})"), ductile::agent::StoreError);
  CHECK_THROWS_AS(intruder.get("/ductile/agent/tls/round"), ductile::agent::StoreError);
  ductile::agent::EtcdStore trusted(etcd.endpoint(), 2000ms, tls.client());
  CHECK_FALSE(trusted.get(forged));
  CHECK(trusted.get("/ductile/agent/tls/settings"));  // the job's own records are there

  // Files that cannot be read, a certificate without its key.
  r = run_process(agent_argv("c", etcd.url(), {"--rdzv-cacert", (dir / "missing.pem").string()}),
                  {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-cacert '" + (dir / "missing.pem").string() + "' cannot be read") !=
        std::string::npos);
  r = run_process(agent_argv("c", etcd.url(), {"--rdzv-cert", tls.client_cert.string()}), {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-cert and --rdzv-key go together") != std::string::npos);
  CHECK(no_marked_processes(marker));
}

// Each worker commits a snapshot into its agent's area as a zero3 save
// does (rank file, manifest, its SHA-256 sidecar, then `latest`, renamed
// into place) with replicas = 1, waits until it holds the other node's
// replica and the other node holds its own (own/replicated says step 1),
// and copies both out for the test; then waits for the test to let it
// end. The agents copy over TLS: the shards copied equal the originals.
// A snapshot server refuses a client whose certificate is of another CA,
// and a client without TLS, at once; a client that trusts another CA
// refuses the server.
TEST_CASE("agent: snapshots copied between agents over TLS, other certificates refused") {
  TempDir dir;
  const std::string marker = new_marker();
  TlsFiles tls = make_certificates(dir.path(), "job");
  TlsFiles other = make_certificates(dir.path(), "other");
  EtcdServer etcd(dir.path(), tls);
  auto config = dir.write("job.toml", kJobToml);
  const auto shm = dir / "shm";
  const auto out = dir / "out";
  std::filesystem::create_directories(shm);
  std::filesystem::create_directories(out);
  const std::string worker = replicating_worker("", 120);
  // An agent of the job `job` with `key` as its --rdzv-key, running `command`.
  auto agent_argv = [&](const std::string& name, const std::filesystem::path& key,
                        const std::string& job, std::vector<std::string> command) {
    std::vector<std::string> argv{DUCTILE_CLI,
                                  "agent",
                                  "--config",
                                  config.string(),
                                  "--rdzv",
                                  etcd.url(),
                                  "--rdzv-cacert",
                                  tls.ca.string(),
                                  "--rdzv-cert",
                                  tls.client_cert.string(),
                                  "--rdzv-key",
                                  key.string(),
                                  "--job-id",
                                  job,
                                  "--node-id",
                                  name,
                                  "--node-addr",
                                  "127.0.0.1",
                                  "--nproc-per-node",
                                  "1",
                                  "--min-nodes",
                                  "2",
                                  "--settle",
                                  "0",
                                  "--lease-ttl",
                                  "2",
                                  "--snapshot-dir",
                                  shm.string(),
                                  "--"};
    argv.insert(argv.end(), command.begin(), command.end());
    return argv;
  };
  const std::vector<std::string> sh_worker = {"/bin/sh", "-c", worker};
  const std::vector<std::string> env = {marker, "OUT=" + out.string()};
  Child a(agent_argv("a", tls.client_key, "tls-snapshots", sh_worker), env, dir / "a.log");
  Child b(agent_argv("b", tls.client_key, "tls-snapshots", sh_worker), env, dir / "b.log");
  const bool replicated = wait_until(
      [&] {
        return std::filesystem::exists(out / "a" / "replica") &&
               std::filesystem::exists(out / "b" / "replica");
      },
      180s);
  if (!replicated) std::cout << a.output() << b.output();
  REQUIRE(replicated);
  // Each holds the other's shard, byte for byte, and its manifest.
  for (const auto& [holder, origin] : {std::pair{"a", "b"}, std::pair{"b", "a"}}) {
    INFO("node " << holder << " holds node " << origin << "'s snapshot");
    const auto original = read_text(out / origin / "own.bin");
    CHECK(original.size() == 300000);
    std::string copied;
    for (const auto& entry : std::filesystem::directory_iterator(out / holder / "replica"))
      if (entry.path().filename().string().starts_with("rank")) copied = read_text(entry.path());
    CHECK(copied == original);
    CHECK(read_text(out / holder / "replica" / "manifest.json")
              .find(std::string("\"node\":\"") + origin + "\"") != std::string::npos);
  }

  // Node a's snapshot server, from its record in etcd.
  ductile::agent::EtcdStore store(etcd.endpoint(), 2000ms, tls.client());
  const auto record = store.get("/ductile/agent/tls-snapshots/snapshots/a");
  REQUIRE(record);
  const int port = nlohmann::json::parse(record->value).at("port").get<int>();
  REQUIRE(port > 0);
  auto copy_error = [&](const ductile::agent::SnapshotAuth& auth, const std::string& name) {
    const auto started = std::chrono::steady_clock::now();
    std::string error;
    try {
      ductile::agent::fetch_file("127.0.0.1", port, "own/step1/manifest.json", dir / name, auth,
                                 120s);
    } catch (const ductile::Error& e) {
      error = e.what();
    }
    // Refused, not timed out: far below the copy's 120 s.
    CHECK(std::chrono::steady_clock::now() - started < 60s);
    CHECK_FALSE(std::filesystem::exists(dir / name));
    return error;
  };
  // The job's CA trusted, a certificate of another CA shown: the server
  // refuses it.
  const std::vector<std::string> options = {"--rdzv-cacert", "--rdzv-cert", "--rdzv-key"};
  auto foreign = std::make_shared<const ductile::agent::SnapshotTls>(
      ductile::agent::EtcdTls{tls.ca.string(), other.client_cert.string(),
                              other.client_key.string()},
      options);
  std::string error = copy_error({"", foreign}, "foreign.bin");
  INFO(error);
  CHECK(error.find("cannot copy 'own/step1/manifest.json' from the snapshot server at "
                   "127.0.0.1:" +
                   std::to_string(port)) != std::string::npos);
  CHECK(error.find("unknown ca") != std::string::npos);
  CHECK(error.find("presents --rdzv-cert '" + other.client_cert.string() + "'") !=
        std::string::npos);
  // The other way: a client that trusts another CA refuses the server.
  auto distrustful = std::make_shared<const ductile::agent::SnapshotTls>(
      ductile::agent::EtcdTls{other.ca.string(), tls.client_cert.string(), tls.client_key.string()},
      options);
  error = copy_error({"", distrustful}, "distrustful.bin");
  CHECK(error.find("the TLS handshake failed: certificate verify failed") != std::string::npos);
  CHECK(error.find("against --rdzv-cacert '" + other.ca.string() + "'") != std::string::npos);
  // No TLS at all: the server ends the connection at its first bytes.
  error = copy_error({}, "plain.bin");
  CHECK(error.find("from the snapshot server at 127.0.0.1:" + std::to_string(port)) !=
        std::string::npos);
  CHECK(error.find("the connection was closed") != std::string::npos);
  // The job's own certificate: served.
  auto own = std::make_shared<const ductile::agent::SnapshotTls>(tls.client(), options);
  CHECK(ductile::agent::fetch_file("127.0.0.1", port, "own/step1/manifest.json",
                                   dir / "manifest.json", {"", own}, 120s) > 0);
  CHECK(read_text(dir / "manifest.json").find("\"node\":\"a\"") != std::string::npos);

  // No --rdzv-cacert: the system's CAs verify the peers (OpenSSL's
  // SSL_CERT_FILE names them here). With the job's CA among them: served;
  // with another CA only: refused, the message saying which CAs.
  ::setenv("SSL_CERT_FILE", tls.ca.c_str(), 1);
  auto system_cas = std::make_shared<const ductile::agent::SnapshotTls>(
      ductile::agent::EtcdTls{"", tls.client_cert.string(), tls.client_key.string()}, options);
  CHECK(ductile::agent::fetch_file("127.0.0.1", port, "own/step1/manifest.json",
                                   dir / "manifest-system-cas.json", {"", system_cas}, 120s) > 0);
  ::setenv("SSL_CERT_FILE", other.ca.c_str(), 1);
  auto other_system_cas = std::make_shared<const ductile::agent::SnapshotTls>(
      ductile::agent::EtcdTls{"", tls.client_cert.string(), tls.client_key.string()}, options);
  ::unsetenv("SSL_CERT_FILE");
  error = copy_error({"", other_system_cas}, "other-system-cas.bin");
  CHECK(error.find("certificate verify failed") != std::string::npos);
  CHECK(error.find("against the system's CAs (no --rdzv-cacert)") != std::string::npos);

  // A key that is not the certificate's: the agent stops at its start.
  auto r = run_process(agent_argv("bad", other.client_key, "tls-snapshots-bad", {"/bin/true"}),
                       {marker});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-key '" + other.client_key.string() +
                   "' cannot be loaded as the key of --rdzv-cert '" + tls.client_cert.string() +
                   "': key values mismatch") != std::string::npos);

  std::ofstream(out / "release") << "1\n";
  auto sa = a.wait(120s), sb = b.wait(120s);
  if (sa != std::optional<int>(0) || sb != std::optional<int>(0))
    std::cout << a.output() << b.output();
  CHECK(sa == std::optional<int>(0));
  CHECK(sb == std::optional<int>(0));
  CHECK(no_marked_processes(marker));
}
