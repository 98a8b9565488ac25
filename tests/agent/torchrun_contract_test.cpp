// torchrun's worker contract: one worker
// script under torch 2.13's torchrun and under `ductile agent`, given the
// same command line with the program name changed, for each rendezvous
// backend: c10d, static, standalone, and etcd (torchrun's etcd needs the
// python-etcd package; it is compared with torchrun's c10d). The variables
// each launcher adds are the same, except ductile's own DUCTILE_ROUND,
// DUCTILE_AGENT_NODE_ID, DUCTILE_SNAPSHOT_DIR, DUCTILE_ROUND_END(_WAIT) and DUCTILE_ROUND_NOTICE;
// so are the ranks and sizes, the interpreter, and what the workers' TCPStore answers them. A
// worker's uncaught exception, recorded by torch's @record in TORCHELASTIC_ERROR_FILE, is what the
// agent reports.
#include <doctest/doctest.h>

#include "agent_job.hpp"
#include "launchers.hpp"
#include "process.hpp"

using namespace ductile::test;

namespace {

const std::string kScript = DUCTILE_AGENT_WORKERS "/torchrun_contract.py";

// What the group and the workers' store answered each rank: the same under
// both launchers.
void check_store_answers(const SideBySide& s, int world) {
  for (int rank = 0; rank < world; ++rank) {
    INFO("rank " << rank);
    auto answers = [&](const std::filesystem::path& out) {
      return nlohmann::json::parse(read_text(out / (std::to_string(rank) + ".store.json")));
    };
    auto d = answers(s.ductile_out);
    CHECK(d == answers(s.torchrun_out));
    CHECK(d["all_reduce"] == world * (world + 1) / 2);
    CHECK(d["count"] == world);
    CHECK(d["first"] == "taken");
    CHECK(d["check"] == true);
  }
}

// A node's command line of 2 nodes x 2 workers with `rendezvous`'s options.
std::vector<std::string> two_by_two(std::vector<std::string> rendezvous, bool store) {
  std::vector<std::string> args = {"--nnodes",     "2",         "--nproc-per-node",   "2",
                                   "--local-addr", "127.0.0.1", "--monitor-interval", "0.1"};
  args.insert(args.end(), rendezvous.begin(), rendezvous.end());
  args.push_back(kScript);
  if (store) args.push_back("--store");
  return args;
}

}  // namespace

TEST_CASE("agent: torchrun's worker contract - c10d: the same variables, ranks, sizes and store") {
  TempDir dir;
  // Each launcher its own c10d endpoint: both run at once.
  const std::string endpoints[2] = {"127.0.0.1:" + std::to_string(free_tcp_port()),
                                    "127.0.0.1:" + std::to_string(free_tcp_port())};
  auto s = run_side_by_side(dir.path(), new_marker(), 2, 4, [&](int, bool ductile) {
    return two_by_two(
        {"--rdzv-backend", "c10d", "--rdzv-endpoint", endpoints[ductile], "--rdzv-id", "contract"},
        true);
  });
  check_store_answers(s, 4);
  for (std::size_t rank = 0; rank < s.ductile.size(); ++rank) {
    CHECK(s.ductile[rank]["TORCHELASTIC_USE_AGENT_STORE"] == "True");
    CHECK(s.ductile[rank]["MASTER_ADDR"] == "127.0.0.1");
    CHECK(s.torchrun[rank]["MASTER_ADDR"] == "127.0.0.1");
    CHECK(s.ductile[rank]["TORCHELASTIC_RUN_ID"] == "contract");
    CHECK(s.torchrun[rank]["TORCHELASTIC_RUN_ID"] == "contract");
  }
}

TEST_CASE("agent: torchrun's worker contract - static: node ranks and the master's store") {
  TempDir dir;
  const std::string ports[2] = {std::to_string(free_tcp_port()), std::to_string(free_tcp_port())};
  auto s = run_side_by_side(dir.path(), new_marker(), 2, 4, [&](int node, bool ductile) {
    return two_by_two({"--node-rank", std::to_string(node), "--master-addr", "127.0.0.1",
                       "--master-port", ports[ductile]},
                      true);
  });
  check_store_answers(s, 4);
  for (std::size_t rank = 0; rank < s.ductile.size(); ++rank) {
    INFO("rank " << rank);
    // The group rank is the node rank: rank R is on node R / 2 for both.
    CHECK(s.ductile[rank]["GROUP_RANK"] == std::to_string(rank / 2));
    CHECK(s.torchrun[rank]["GROUP_RANK"] == std::to_string(rank / 2));
    CHECK(s.ductile[rank]["MASTER_ADDR"] == "127.0.0.1");
    CHECK(s.torchrun[rank]["MASTER_ADDR"] == "127.0.0.1");
    CHECK(s.ductile[rank]["MASTER_PORT"] == ports[1]);
    CHECK(s.torchrun[rank]["MASTER_PORT"] == ports[0]);
    CHECK(s.ductile[rank]["TORCHELASTIC_RUN_ID"] == s.torchrun[rank]["TORCHELASTIC_RUN_ID"]);
  }
}

TEST_CASE("agent: torchrun's worker contract - standalone: one node, the agent's store") {
  TempDir dir;
  auto s = run_side_by_side(dir.path(), new_marker(), 1, 2, [&](int, bool) {
    return std::vector<std::string>{
        "--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", kScript, "--store"};
  });
  check_store_answers(s, 2);
  for (std::size_t rank = 0; rank < s.ductile.size(); ++rank) {
    // torchrun's defaults: this host's name (no --local-addr), 0 restarts,
    // a new uuid as the run id.
    CHECK(s.ductile[rank]["MASTER_ADDR"] == s.torchrun[rank]["MASTER_ADDR"]);
    CHECK(s.ductile[rank]["TORCHELASTIC_MAX_RESTARTS"] == "0");
    CHECK(is_uuid4(s.ductile[rank]["TORCHELASTIC_RUN_ID"]));
    CHECK(is_uuid4(s.torchrun[rank]["TORCHELASTIC_RUN_ID"]));
  }
}

TEST_CASE("agent: torchrun's worker contract - etcd: the same variables, the store rank 0's") {
  Job job;
  const std::string c10d = "127.0.0.1:" + std::to_string(free_tcp_port());
  // torchrun's etcd backend needs the python-etcd package: its c10d runs
  // beside ductile's etcd.
  auto s = run_side_by_side(job.dir.path(), job.marker, 2, 4,
                            [&](int, bool ductile) {
                              return two_by_two(
                                  {"--rdzv-backend", ductile ? "etcd" : "c10d", "--rdzv-endpoint",
                                   ductile ? job.etcd.host_port() : c10d, "--rdzv-id", "contract"},
                                  false);
                            },
                            {}, {"TORCHELASTIC_USE_AGENT_STORE"});
  for (std::size_t rank = 0; rank < s.ductile.size(); ++rank) {
    CHECK(s.ductile[rank]["MASTER_ADDR"] == "127.0.0.1");
    CHECK(s.ductile[rank]["TORCHELASTIC_RUN_ID"] == "contract");
    // torchrun's etcd rendezvous leaves the store to rank 0's worker (its
    // c10d, run here, shares its agent's).
    CHECK(s.ductile[rank]["TORCHELASTIC_USE_AGENT_STORE"] == "False");
    CHECK(s.torchrun[rank]["TORCHELASTIC_USE_AGENT_STORE"] == "True");
  }
}

TEST_CASE("agent: a worker's exception from TORCHELASTIC_ERROR_FILE is what the agent reports") {
  Job job;
  const std::string out = (job.dir / "env").string();
  std::filesystem::create_directories(out);
  std::vector<std::string> argv = {DUCTILE_CLI,
                                   "agent",
                                   "--nproc-per-node",
                                   "2",
                                   "--rdzv-backend",
                                   "etcd",
                                   "--rdzv-endpoint",
                                   job.etcd.host_port(),
                                   "--rdzv-id",
                                   "failing",
                                   "--max-restarts",
                                   "0",
                                   "--local-addr",
                                   "127.0.0.1",
                                   DUCTILE_AGENT_WORKERS "/torchrun_contract.py",
                                   "--fail-rank",
                                   "1"};
  Child agent(argv,
              {job.marker, std::string("PYTHON_EXEC=") + DUCTILE_PYTHON, "CONTRACT_OUT=" + out},
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

TEST_CASE("agent: torchrun's options that cannot mean the same are refused, saying what to use") {
  TempDir dir;
  auto agent = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {DUCTILE_CLI, "agent"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_process(argv);
  };
  const std::vector<std::string> base = {
      "--nproc-per-node", "1",    "--rdzv-id",       "j",
      "--rdzv-backend",   "c10d", "--rdzv-endpoint", "127.0.0.1:1"};
  auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> args = base;
    args.insert(args.end(), more.begin(), more.end());
    return agent(args);
  };
  const std::vector<std::pair<std::vector<std::string>, std::string>> refused = {
      {{"--rdzv-conf", "join_timeout=10,is_host=maybe", "train.py"},
       "--rdzv-conf is_host=maybe is invalid: give true or false"},
      {{"--rdzv-conf", "join_timeout=10,colour=red", "train.py"},
       "--rdzv-conf key 'colour' is not one ductile agent takes"},
      {{"--rdzv-conf", "join_timeout=soon", "train.py"},
       "--rdzv-conf join_timeout 'soon' is invalid"},
      {{"--nnodes", "3:2", "train.py"}, "--nnodes '3:2' is invalid: give N or MIN:MAX"},
      {{"--no-python", "-m", "train"}, "--no-python and --module cannot be given together"},
      {{"--logs-specs", "mine", "train.py"},
       "--logs-specs 'mine' names a Python class torchrun loads; ductile agent writes the "
       "workers' logs itself: use --log-dir with --redirects or --tee"},
      {{"--event-log-handler", "console", "train.py"},
       "--event-log-handler 'console' names a Python handler torchrun loads"},
      {{"--numa-binding", "node", "train.py"},
       "--numa-binding node is not available: run the workers under numactl"},
      {{"--duplicate-stdout-filters", "loss", "train.py"},
       "use --tee with --log-dir and filter the log files"},
      {{"--virtual-local-rank", "train.py"}, "--virtual-local-rank is not available"},
      {{"--unknown-option", "train.py"}, "'--unknown-option' is not an option of ductile agent"},
  };
  for (const auto& [args, message] : refused) {
    auto r = with(args);
    INFO(args.front() << ": " << r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(message) != std::string::npos);
  }
  auto r = agent(
      {"--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("port 0 (a free port) serves one node only, and --nnodes asks for up to 2") !=
        std::string::npos);
  r = agent({"--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-backend 'zookeeper' is not one ductile agent takes: give c10d") !=
        std::string::npos);
  r = agent({"--rdzv-backend", "c10d", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv-backend c10d needs the rendezvous' host: give --rdzv-endpoint") !=
        std::string::npos);
  r = agent({"--standalone", "--nnodes", "2", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--standalone runs one node, and --nnodes asks for up to 2") !=
        std::string::npos);
  r = agent({"--nnodes", "2", "--node-rank", "0", "--master-port", "0", "train.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("a static rendezvous needs the port of node rank 0's store: give "
                   "--master-port") != std::string::npos);
  r = agent({"--nproc-per-node", "none", "--rdzv", "etcd://127.0.0.1:1", "--job-id", "j", "x"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--nproc-per-node 'none' is invalid") != std::string::npos);
  r = agent({"--nproc-per-node", "1", "--rdzv", "etcd://127.0.0.1:1", "x.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("no job id: give --job-id ID (or torchrun's --rdzv-id ID)") !=
        std::string::npos);
  r = agent({"--rdzv", "etcd://127.0.0.1:1", "--standalone", "x.py"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv (an etcd) and torchrun's --rdzv-endpoint, --rdzv-backend or "
                   "--standalone say the same") != std::string::npos);
}
