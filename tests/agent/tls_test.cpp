// `ductile agent` to an etcd that speaks only TLS and authenticates its
// clients by certificate (--client-cert-auth), with certificates the test
// makes with openssl.
#include <doctest/doctest.h>

#include "agent_job.hpp"
#include "process.hpp"

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
