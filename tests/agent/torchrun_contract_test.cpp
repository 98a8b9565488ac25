// torchrun's worker contract (issue 24 item 1): one worker script prints its
// environment under torch 2.13's torchrun (c10d rendezvous) and under
// `ductile agent` given the same command line with the program name
// changed (and etcd as the rendezvous). The variables each launcher adds
// are the same (ductile adds its DUCTILE_* ones), and so are the ranks and
// sizes; a worker's uncaught exception, recorded by torch's @record in
// TORCHELASTIC_ERROR_FILE, is what the agent reports.
#include <doctest/doctest.h>

#include <map>
#include <set>
#include <tuple>

#include <nlohmann/json.hpp>

#include "agent_job.hpp"
#include "process.hpp"

using namespace ductile::test;

namespace {

using Env = std::map<std::string, std::string>;

// The variables a worker got from its launcher: those not in the test's
// own environment, or with another value there.
Env added_by_launcher(const std::filesystem::path& file, const Env& parent) {
  Env added;
  auto worker = nlohmann::json::parse(read_text(file));
  for (auto it = worker.begin(); it != worker.end(); ++it) {
    auto p = parent.find(it.key());
    std::string value = it.value().get<std::string>();
    if (it.key() != "_" && (p == parent.end() || p->second != value)) added[it.key()] = value;
  }
  return added;
}

std::set<std::string> keys_of(const Env& env) {
  std::set<std::string> keys;
  for (const auto& [k, v] : env) keys.insert(k);
  return keys;
}

// The ranks and sizes of every worker, one tuple each, sorted.
using Layout = std::tuple<std::string, std::string, std::string, std::string, std::string,
                          std::string, std::string, std::string, std::string>;
Layout layout_of(const Env& e) {
  auto at = [&](const char* k) { return e.count(k) ? e.at(k) : std::string("<unset>"); };
  return {at("RANK"),       at("LOCAL_RANK"),       at("WORLD_SIZE"),
          at("GROUP_RANK"), at("GROUP_WORLD_SIZE"), at("LOCAL_WORLD_SIZE"),
          at("ROLE_RANK"),  at("ROLE_WORLD_SIZE"),  at("ROLE_NAME")};
}

}  // namespace

TEST_CASE("agent: torchrun's worker contract - the same variables, ranks and sizes as torchrun") {
  Job job;
  const std::string script = DUCTILE_AGENT_WORKERS "/torchrun_contract.py";
  const std::vector<std::string> extra_env = {job.marker,
                                              std::string("PYTHON_EXEC=") + DUCTILE_PYTHON};
  Env parent;
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    parent[entry.substr(0, entry.find('='))] = entry.substr(entry.find('=') + 1);
  }
  for (const auto& entry : extra_env)
    parent[entry.substr(0, entry.find('='))] = entry.substr(entry.find('=') + 1);

  // The same command line for both, 2 nodes x 2 workers: only the program
  // and the rendezvous (torchrun's c10d store, ductile's etcd) differ.
  auto command_line = [&](const std::string& backend, const std::string& endpoint,
                          const std::string& out) {
    return std::vector<std::string>{"--nnodes",
                                    "2",
                                    "--nproc-per-node",
                                    "2",
                                    "--rdzv-backend",
                                    backend,
                                    "--rdzv-endpoint",
                                    endpoint,
                                    "--rdzv-id",
                                    "contract",
                                    "--max-restarts",
                                    "0",
                                    "--monitor-interval",
                                    "0.1",
                                    script,
                                    out};
  };
  const std::string torchrun_out = (job.dir / "torchrun").string();
  const std::string ductile_out = (job.dir / "ductile").string();
  const std::string c10d = "127.0.0.1:" + std::to_string(free_tcp_port());
  std::vector<std::unique_ptr<Child>> launchers;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> torchrun = {DUCTILE_PYTHON, "-m", "torch.distributed.run"};
    for (auto& a : command_line("c10d", c10d, torchrun_out)) torchrun.push_back(a);
    launchers.push_back(std::make_unique<Child>(
        torchrun, extra_env, job.dir / ("torchrun-" + std::to_string(node) + ".log")));
    std::vector<std::string> ductile = {DUCTILE_CLI, "agent", "--local-addr", "127.0.0.1"};
    for (auto& a : command_line("etcd", job.etcd.host_port(), ductile_out)) ductile.push_back(a);
    launchers.push_back(std::make_unique<Child>(
        ductile, extra_env, job.dir / ("ductile-" + std::to_string(node) + ".log")));
  }
  for (auto& launcher : launchers) {
    auto status = launcher->wait(180s);
    if (status != std::optional<int>(0)) std::cout << launcher->output();
    CHECK(status == std::optional<int>(0));
  }

  std::vector<Layout> torchrun_layout, ductile_layout;
  std::set<std::string> torchrun_keys, ductile_keys;
  for (int rank = 0; rank < 4; ++rank) {
    const std::string suffix = "." + std::to_string(rank) + ".json";
    REQUIRE(std::filesystem::exists(torchrun_out + suffix));
    REQUIRE(std::filesystem::exists(ductile_out + suffix));
    Env t = added_by_launcher(torchrun_out + suffix, parent);
    Env d = added_by_launcher(ductile_out + suffix, parent);
    torchrun_layout.push_back(layout_of(t));
    ductile_layout.push_back(layout_of(d));
    torchrun_keys = keys_of(t);
    std::set<std::string> ours;
    for (const auto& key : keys_of(d))
      if (!key.starts_with("DUCTILE_")) ours.insert(key);
    ductile_keys = ours;
    INFO("rank " << rank);
    CHECK(ductile_keys == torchrun_keys);
    CHECK(d.count("DUCTILE_ROUND") == 1);
    CHECK(d.count("DUCTILE_AGENT_NODE_ID") == 1);
    // The same meaning, the same value.
    for (const char* k : {"TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                          "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                          "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "ROLE_NAME"}) {
      INFO(k);
      CHECK(d[k] == t[k]);
    }
    // Per worker: its own error file, the same master for all.
    CHECK(d["TORCHELASTIC_ERROR_FILE"].ends_with("/" + d["LOCAL_RANK"] + "/error.json"));
    CHECK(d["MASTER_ADDR"] == "127.0.0.1");
    // No ductile agent hosts the workers' store (torchrun's c10d agent does).
    CHECK(t["TORCHELASTIC_USE_AGENT_STORE"] == "True");
    CHECK(d["TORCHELASTIC_USE_AGENT_STORE"] == "False");
  }
  std::sort(torchrun_layout.begin(), torchrun_layout.end());
  std::sort(ductile_layout.begin(), ductile_layout.end());
  CHECK(ductile_layout == torchrun_layout);
  CHECK(torchrun_keys.count("TORCHELASTIC_ERROR_FILE") == 1);
  CHECK(torchrun_keys.count("ROLE_NAME") == 1);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

TEST_CASE("agent: a worker's exception from TORCHELASTIC_ERROR_FILE is what the agent reports") {
  Job job;
  const std::string out = (job.dir / "env").string();
  std::vector<std::string> argv = {DUCTILE_CLI,
                                   "agent",
                                   "--nproc-per-node",
                                   "2",
                                   "--rdzv-endpoint",
                                   job.etcd.host_port(),
                                   "--rdzv-id",
                                   "failing",
                                   "--max-restarts",
                                   "0",
                                   "--local-addr",
                                   "127.0.0.1",
                                   DUCTILE_AGENT_WORKERS "/torchrun_contract.py",
                                   out,
                                   "--fail-rank",
                                   "1"};
  Child agent(argv, {job.marker, std::string("PYTHON_EXEC=") + DUCTILE_PYTHON},
              job.dir / "agent.log");
  auto status = agent.wait(120s);
  std::string log = agent.output();
  if (status != std::optional<int>(1)) std::cout << log;
  CHECK(status == std::optional<int>(1));
  CHECK(log.find("worker rank 1 exited with status 1: ValueError: boom from rank 1; stopping") !=
        std::string::npos);
  CHECK(log.find("job failed: worker rank 1 (local rank 1) exited with status 1 after 0 "
                 "restart(s) (max-restarts 0); its last lines:") != std::string::npos);
  CHECK(log.find("\n  its error (TORCHELASTIC_ERROR_FILE): ValueError: boom from rank 1\n  ! "
                 "Traceback (most recent call last):") != std::string::npos);
  CHECK(log.find("  !     raise ValueError(f\"boom from rank {rank}\")") != std::string::npos);
  if (!no_marked_processes(job.marker)) std::cout << log;
  CHECK(marked_processes(job.marker).empty());
}

TEST_CASE("agent: torchrun's options that cannot apply are refused by name") {
  TempDir dir;
  auto agent = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {DUCTILE_CLI, "agent"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_process(argv);
  };
  const std::vector<std::string> base = {"--nproc-per-node", "1",          "--rdzv-id", "j",
                                         "--rdzv-endpoint",  "127.0.0.1:1"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return agent(args);
  };
  auto r = with({"--rdzv-backend", "c10d", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-backend 'c10d' is not available: ductile agent's rendezvous runs on "
                   "etcd") != std::string::npos);
  r = with({"--rdzv-conf", "join_timeout=10,is_host=1", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-conf key 'is_host' is not one ductile agent takes") !=
        std::string::npos);
  r = with({"--rdzv-conf", "join_timeout=soon", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-conf join_timeout 'soon' is invalid") != std::string::npos);
  r = with({"--nnodes", "3:2", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--nnodes '3:2' is invalid: give N or MIN:MAX") != std::string::npos);
  r = with({"--log-dir", "/tmp/x", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("'--log-dir' is not an option of ductile agent") != std::string::npos);
  r = with({"--no-python", "-m", "train"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--no-python and --module cannot be given together") != std::string::npos);
  r = with({"--standalone", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--standalone is not available") != std::string::npos);
  r = agent({"--nproc-per-node", "none", "--rdzv", "etcd://127.0.0.1:1", "--job-id", "j", "x"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--nproc-per-node 'none' is invalid") != std::string::npos);
  r = agent({"--nproc-per-node", "1", "--rdzv-endpoint", "127.0.0.1:1", "x.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("no job id: give --job-id ID (or torchrun's --rdzv-id ID)") !=
        std::string::npos);
}
