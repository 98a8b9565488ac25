// A job id used again after its run finished: agents
// started in the same instant on the id of a finished run start a new run,
// whatever the order they register in, 50 times over. A real etcd.
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <fcntl.h>

#include "agent_job.hpp"

using namespace ductile::test;

TEST_CASE("agent: agents started together on a finished run's id start a new run - 50 times") {
  Job job;
  constexpr int kAgents = 3, kRuns = 50;
  const std::string gate = (job.dir / "gate").string();
  REQUIRE(mkfifo(gate.c_str(), 0600) == 0);
  // Every node must be in the round (nnodes 3:3): an agent that ran no
  // worker took a previous run's end for its own.
  const std::vector<std::string> options = {"--nproc-per-node", "1",    "--min-nodes", "3",
                                            "--max-nodes",      "3",    "--settle",    "0",
                                            "--poll-interval",  "0.05", "--lease-ttl", "2"};
  auto worker = sh("echo \"ran in round $DUCTILE_ROUND\"");
  for (int run = 0; run <= kRuns; ++run) {
    INFO("run " << run);
    // The gate: the test holds the FIFO open (reading and writing, so that
    // the shells' opens return at once); once every shell has it open, the
    // test closes it and every `read` ends in the same instant.
    int held = open(gate.c_str(), O_RDWR | O_CLOEXEC);
    REQUIRE(held >= 0);
    std::vector<std::unique_ptr<Child>> agents;
    for (int i = 0; i < kAgents; ++i) {
      // Held at the gate.
      std::vector<std::string> argv = {"/bin/sh",
                                       "-c",
                                       "read x < \"$0\"; exec \"$@\"",
                                       gate,
                                       DUCTILE_CLI,
                                       "agent",
                                       "--config",
                                       job.config.string(),
                                       "--rdzv",
                                       job.etcd.url(),
                                       "--job-id",
                                       "again",
                                       "--node-addr",
                                       "127.0.0.1",
                                       "--node-id",
                                       "n" + std::to_string(i)};
      argv.insert(argv.end(), options.begin(), options.end());
      argv.push_back("--");
      argv.insert(argv.end(), worker.begin(), worker.end());
      agents.push_back(std::make_unique<Child>(
          argv, std::vector<std::string>{job.marker, "TMPDIR=" + job.tmp.string()},
          job.dir / ("run" + std::to_string(run) + "-n" + std::to_string(i) + ".log")));
    }
    bool at_gate = wait_until(
        [&] {
          return std::all_of(agents.begin(), agents.end(), [&](auto& agent) {
            std::error_code ec;
            auto in = std::filesystem::read_symlink(
                "/proc/" + std::to_string(agent->pid()) + "/fd/0", ec);
            return !ec && in == gate;
          });
        },
        30s);
    REQUIRE(at_gate);
    close(held);
    for (auto& agent : agents) {
      auto status = agent->wait(60s);
      const std::string out = agent->output();
      if (status != std::optional<int>(0) || count_of(out, "\nran in round ") != 1)
        std::cout << out;
      CHECK(status == std::optional<int>(0));
      CHECK(count_of(out, "\nran in round ") == 1);  // it ran its worker, once
      if (run > 0) {
        // Each saw the previous run's end, and none took it for its own.
        CHECK(count_of(out, "job finished") == 1);
      }
    }
    // A new run, not the old round again: the rounds are new.
    std::string all;
    for (auto& agent : agents) all += agent->output();
    CHECK(count_of(all, "leader: job succeeded") == 1);
  }
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
