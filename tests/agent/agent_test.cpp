// `ductile agent` processes on one machine with a real etcd: forming a job,
// losing and gaining nodes, worker failures, etcd restarts, bad input and
// signals. Every test ends by checking that no process of its job is left.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <random>
#include <set>
#include <sstream>

#include <sys/stat.h>

#include "agent_job.hpp"
#include "process.hpp"
#include "zero3_job.hpp"

using namespace ductile::test;

// 3 agents x 2 workers run a gloo all-reduce, a SIGKILLed agent is replaced, a
// new one waits for min_time and a valid size.
TEST_CASE("agent: 3 x 2 workers all-reduce - SIGKILL re-form - min_time admission") {
  Job job;
  std::string stop = (job.dir / "stop").string();
  std::vector<std::string> worker = {DUCTILE_PYTHON, DUCTILE_AGENT_WORKERS "/collective.py",
                                     DUCTILE_CLI, job.config.string(), stop};
  // Default lease TTL, poll interval and stop grace; the scale-up delay is
  // shortened from the configuration's minutes to 20 s.
  std::vector<std::string> options = {"--nproc-per-node", "2", "--min-time", "20"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  bool formed =
      wait_until([&] { return count_of(job.all_output(), "collective ok round=1 ") == 6; }, 180s);
  if (!formed) job.dump();
  REQUIRE(formed);
  std::string out = job.all_output();
  CHECK(count_of(out, "world=6 sum=21 expected=21") == 6);
  CHECK(count_of(out, "batch=24=") == 6);
  const std::string master = field_after(out, "collective ok round=1 ", "master=");
  REQUIRE_FALSE(master.empty());
  CHECK(count_of(out, "master=" + master) == 6);  // one master for all
  // Each worker's lines, unprefixed (the workers write the agent's streams).
  for (int rank = 0; rank < 6; ++rank)
    CHECK(count_of(out, "collective ok round=1 rank=" + std::to_string(rank) + " ") == 1);

  // SIGKILL the leader (the agent that formed round 1): the next oldest agent
  // must notice the lease expire and lead round 2.
  std::vector<Child*> survivors;
  Child* leader = nullptr;
  for (Child* agent : {&a, &b, &c}) {
    if (!leader && agent->output().find("leader: round 1 formed") != std::string::npos)
      leader = agent;
    else
      survivors.push_back(agent);
  }
  REQUIRE(leader);
  REQUIRE(survivors.size() == 2);
  Clock::time_point killed = Clock::now();
  leader->signal(SIGKILL);
  leader->wait(10s);
  bool reformed = wait_until(
      [&] {
        return survivors[0]->output().find("round 2 started: world size 4") != std::string::npos &&
               survivors[1]->output().find("round 2 started: world size 4") != std::string::npos;
      },
      60s);
  double reform_s = seconds_since(killed);
  if (!reformed) job.dump();
  REQUIRE(reformed);
  bool second =
      wait_until([&] { return count_of(job.all_output(), "collective ok round=2 ") == 4; }, 180s);
  double collective_s = seconds_since(killed);
  if (!second) job.dump();
  REQUIRE(second);
  std::printf(
      "agent re-form after SIGKILL of one of 3 agents (lease TTL 5 s, defaults): "
      "%.2f s to the new round's workers starting, %.2f s to their all-reduce done\n",
      reform_s, collective_s);
  CHECK(count_of(job.all_output(), "world=4 sum=10 expected=10") == 4);
  CHECK(count_of(job.all_output(), "batch=24=3x2x4") == 4);  // the plan of 4 GPUs
  // A new agent: it stays standby until min_time has passed since round 2.
  // That is seen only while min_time (20 s) runs: on a loaded machine round
  // 2's all-reduce can take longer, and d is then admitted at once (the
  // admission time is checked below either way).
  const auto round2_ms = started_ms(survivors[0]->output(), 2);
  const auto wall_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::system_clock::now().time_since_epoch())
                           .count();
  Child& d = job.start("d", options, worker);
  if (wall_ms + 5000 < round2_ms + 20000) CHECK(d.wait_for_output("round 2: standby", 30s));
  // A fifth node would make 8 GPUs: not valid, it stays standby.
  Child& e = job.start("e", options, worker);
  bool third =
      wait_until([&] { return count_of(job.all_output(), "collective ok round=3 ") == 6; }, 180s);
  if (!third) job.dump();
  REQUIRE(third);
  CHECK(count_of(job.all_output(), "world=6 sum=21 expected=21") == 12);
  Child& survivor = *survivors[0];
  auto t2 = started_ms(survivor.output(), 2), t3 = started_ms(survivor.output(), 3);
  std::printf("scale-up admitted %.2f s after the previous round started (min_time 20 s)\n",
              (t3 - t2) / 1000.0);
  CHECK(t3 - t2 >= 20000);
  CHECK(d.output().find("round 3 started: world size 6") != std::string::npos);
  // Rounds 2 and 3 have the same leader: it publishes a new MASTER_PORT
  // each round (a worker of the old round may still hold the old one).
  auto master_of = [&](int round) {
    return field_after(job.all_output(), "collective ok round=" + std::to_string(round) + " ",
                       "master=");
  };
  CHECK_FALSE(master_of(2).empty());
  CHECK(master_of(2) != master_of(3));
  CHECK(e.wait_for_output("round 3: standby", 30s));
  CHECK(e.output().find("started: world size 8") == std::string::npos);

  std::ofstream(stop) << "stop";
  for (Child* agent : {survivors[0], survivors[1], &d, &e}) {
    auto status = agent->wait(60s);
    CHECK(status == std::optional<int>(0));
  }
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

TEST_CASE("agent: a failing worker restarts the group - the second failure ends the job") {
  Job job;
  // Rank 1 fails only once rank 0 has printed its line of the round (else a
  // loaded machine may stop rank 0 before its shell got to the echo).
  const std::string printed = (job.dir / "rank0-printed-round").string();
  auto worker =
      sh("echo \"rank $RANK round $DUCTILE_ROUND restarts $TORCHELASTIC_RESTART_COUNT\"; "
         "if [ \"$RANK\" = 0 ]; then touch " +
         printed +
         "$DUCTILE_ROUND; fi; "
         "if [ \"$RANK\" = 1 ]; then while [ ! -e " +
         printed +
         "$DUCTILE_ROUND ]; do sleep 0.05; done; "
         "echo \"rank 1 gives up in round $DUCTILE_ROUND\"; exit 3; fi; sleep 60");
  std::vector<std::string> options = {"--nproc-per-node", "2", "--lease-ttl", "2",
                                      "--max-restarts",   "1", "--settle",    "1",
                                      "--stop-grace",     "1", "--min-nodes", "2"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  auto sa = a.wait(90s), sb = b.wait(90s);
  std::string out = job.all_output();
  // The agents exit with the worker's own status (3: not the agent's status 1
  // for a lost etcd).
  if (!sa || !sb || *sa != 3 || *sb != 3) job.dump();
  CHECK(sa == std::optional<int>(3));
  CHECK(sb == std::optional<int>(3));
  CHECK(out.find("rank 0 round 1 restarts 0") != std::string::npos);
  CHECK(out.find("rank 0 round 2 restarts 1") != std::string::npos);
  CHECK(out.find("round 3 started") == std::string::npos);
  CHECK(out.find("job failed: worker rank 1 (local rank 1) exited with status 3 after 1 "
                 "restart(s) (max-restarts 1); its last lines: <N/A> (its output went to the "
                 "console") != std::string::npos);
  // The worker wrote the console itself: nothing the agent read to quote.
  CHECK(out.find("\nrank 1 gives up in round 2\n") != std::string::npos);
  CHECK(out.find("its error (TORCHELASTIC_ERROR_FILE): <N/A> (it wrote none") != std::string::npos);
  CHECK(no_marked_processes(job.marker));
}

TEST_CASE("agent: a worker that fails once is restarted and the job then succeeds") {
  Job job;
  auto worker =
      sh("if [ \"$RANK\" = 2 ] && [ \"$DUCTILE_ROUND\" = 1 ]; then exit 1; fi; "
         "echo \"rank $RANK done in round $DUCTILE_ROUND\"");
  std::vector<std::string> options = {"--nproc-per-node", "2", "--lease-ttl",    "2",
                                      "--settle",         "1", "--stop-grace",   "1",
                                      "--min-nodes",      "2", "--max-restarts", "1"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  auto sa = a.wait(90s), sb = b.wait(90s);
  if (!sa || !sb || *sa != 0 || *sb != 0) job.dump();
  CHECK(sa == std::optional<int>(0));
  CHECK(sb == std::optional<int>(0));
  CHECK(count_of(job.all_output(), "done in round 2") == 4);
  CHECK(no_marked_processes(job.marker));
}

// etcd killed and restarted mid-job is ridden out while the agents' leases
// cannot have expired (a lease TTL of 20 s: the fence is 15 s away); etcd
// gone for good stops the job within --store-timeout.
TEST_CASE("agent: etcd restarted mid-job is ridden out - etcd gone stops the job") {
  Job job;
  std::string stop = (job.dir / "stop").string();
  auto worker = sh("while [ ! -e " + stop +
                   " ]; do sleep 0.1; done; "
                   "echo \"finished round $DUCTILE_ROUND\"");
  std::vector<std::string> options = {"--nproc-per-node", "1", "--lease-ttl",     "20",
                                      "--settle",         "1", "--stop-grace",    "1",
                                      "--min-nodes",      "2", "--store-timeout", "20"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  REQUIRE(a.wait_for_output("round 1 started", 60s));
  REQUIRE(b.wait_for_output("round 1 started", 60s));
  job.etcd.kill_hard();
  // Both must have met the outage before etcd is back: an agent that made
  // no request while it was down has nothing to ride out.
  CHECK(a.wait_for_output("giving up after 20000 ms", 30s));
  CHECK(b.wait_for_output("giving up after 20000 ms", 30s));
  job.etcd.start();
  const bool a_back = a.wait_for_output("reachable again", 30s);
  const bool b_back = b.wait_for_output("reachable again", 30s);
  CHECK(a_back);
  CHECK(b_back);
  std::ofstream(stop) << "stop";
  auto sa = a.wait(60s), sb = b.wait(60s);
  if (!a_back || !b_back || sa != std::optional<int>(0) || sb != std::optional<int>(0)) job.dump();
  CHECK(sa == std::optional<int>(0));
  CHECK(sb == std::optional<int>(0));
  CHECK(count_of(job.all_output(), "finished round 1") == 2);
  CHECK(job.all_output().find("fenced") == std::string::npos);
  CHECK(no_marked_processes(job.marker));

  // Now etcd goes away for good: the agents stop their workers and fail.
  std::filesystem::remove(stop);
  options[3] = "2";      // --lease-ttl 2: the fence stops the workers
  options.back() = "3";  // --store-timeout 3
  Child& c = job.start("c", options, worker, "job2");
  Child& d = job.start("d", options, worker, "job2");
  REQUIRE(c.wait_for_output("round 1 started", 60s));
  REQUIRE(d.wait_for_output("round 1 started", 60s));
  Clock::time_point killed = Clock::now();
  job.etcd.kill_hard();
  auto sc = c.wait(60s), sd = d.wait(60s);
  std::printf("agents gave up %.2f s after etcd was killed (--store-timeout 3)\n",
              seconds_since(killed));
  CHECK(sc == std::optional<int>(1));
  CHECK(sd == std::optional<int>(1));
  CHECK(c.output().find("unreachable for") != std::string::npos);
  // The fence stopped the workers first, 3/4 of the TTL after the last
  // renewal (the store timeout came later).
  CHECK(c.output().find("fenced: no lease renewal for") != std::string::npos);
  CHECK(c.output().find("fenced") < c.output().find("unreachable for"));
  CHECK(no_marked_processes(job.marker));
}

TEST_CASE("agent: bad input exits 2 with a message naming it") {
  Job job;
  auto worker = sh("sleep 60");
  std::vector<std::string> options = {"--nproc-per-node", "2", "--lease-ttl",  "2",
                                      "--settle",         "0", "--stop-grace", "1"};
  // No etcd at that address.
  auto nowhere = "etcd://127.0.0.1:" + std::to_string(free_tcp_port());
  auto r = run_process({DUCTILE_CLI, "agent", "--config", job.config.string(), "--rdzv", nowhere,
                        "--job-id", "j", "--nproc-per-node", "2", "--", "true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("cannot reach etcd for --rdzv " + nowhere) != std::string::npos);
  // No world size of 5 workers per node is valid.
  r = run_process({DUCTILE_CLI, "agent", "--config", job.config.string(), "--rdzv", job.etcd.url(),
                   "--job-id", "j", "--nproc-per-node", "5", "--", "true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--nproc-per-node 5: no world size") != std::string::npos);
  CHECK(r.err.find("valid GPU counts [1, 2, 3, 4, 6]") != std::string::npos);
  r = run_process({DUCTILE_CLI, "agent", "--config", job.config.string(), "--rdzv", "tcp://x",
                   "--job-id", "j", "--nproc-per-node", "2", "--", "true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--rdzv 'tcp://x' is not an etcd address") != std::string::npos);
  r = run_process({DUCTILE_CLI, "agent", "--config", job.config.string(), "--rdzv", job.etcd.url(),
                   "--job-id", "j", "--nproc-per-node", "2"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("no worker command") != std::string::npos);

  r = run_process({DUCTILE_CLI, "agent", "--config", job.config.string(), "--rdzv", job.etcd.url(),
                   "--job-id", "j", "--nproc-per-node", "2", "--node-id", "a/b", "--", "true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--node-id 'a/b' is invalid") != std::string::npos);
  r = run_process({DUCTILE_CLI, "agent", "--config", (job.dir / "missing.toml").string(), "--rdzv",
                   job.etcd.url(), "--job-id", "j", "--nproc-per-node", "2", "--", "true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("missing.toml") != std::string::npos);
  // --mpi-world without Open MPI's ompi-server to run.
  r = run_process({DUCTILE_CLI, "agent", "--config", job.config.string(), "--rdzv", job.etcd.url(),
                   "--job-id", "j", "--nproc-per-node", "2", "--mpi-world", "--", "/bin/true"},
                  {"PATH=/nonexistent"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--mpi-world: 'ompi-server' was not found on PATH") != std::string::npos);

  // The job id is in use with another configuration.
  Child& a = job.start("a", options, worker);
  REQUIRE(a.wait_for_output("round 1 started", 60s));
  auto other = job.dir.write("other.toml", std::string(kJobToml) + "prefer_larger_batch = false\n");
  r = run_process({DUCTILE_CLI, "agent", "--config", other.string(), "--rdzv", job.etcd.url(),
                   "--job-id", "job", "--nproc-per-node", "2", "--", "true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("job id 'job' is in use on etcd at " + job.etcd.endpoint() +
                   " with another configuration: prefer_larger_batch is true there, false "
                   "here") != std::string::npos);
  r = run_process({DUCTILE_CLI, "agent", "--config", job.config.string(), "--rdzv", job.etcd.url(),
                   "--job-id", "job", "--nproc-per-node", "2", "--mpi-world", "--", "true"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("with another configuration: --mpi-world is false there, true here") !=
        std::string::npos);
  a.signal(SIGTERM);
  CHECK(a.wait(30s) == std::optional<int>(128 + SIGTERM));
  CHECK(no_marked_processes(job.marker));
}

TEST_CASE("agent: SIGTERM and SIGINT stop an agent's workers and the others re-form") {
  Job job;
  // A DeepSpeed JSON config this time; workers check the scheduler's copy.
  job.config = job.dir.write("ds_config.json", R"({"elasticity": {
      "enabled": true, "version": 0.1, "max_train_batch_size": 24,
      "micro_batch_sizes": [1, 2, 3], "min_gpus": 1, "max_gpus": 6}})");
  std::string stop = (job.dir / "stop").string();
  auto worker = sh(std::string(DUCTILE_CLI) + " elastic --config " + job.config.string() +
                   " --world-size $WORLD_SIZE --json > /dev/null 2> /dev/null && "
                   "echo \"up: rank $RANK of $WORLD_SIZE\"; "
                   "while [ ! -e " +
                   stop + " ]; do sleep 0.1; done");
  std::vector<std::string> options = {"--nproc-per-node", "1", "--lease-ttl", "2", "--settle", "1",
                                      "--stop-grace",     "1", "--min-nodes", "1"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  REQUIRE(wait_until([&] { return count_of(job.all_output(), "of 3") == 3; }, 60s));
  c.signal(SIGTERM);
  CHECK(c.wait(30s) == std::optional<int>(128 + SIGTERM));
  CHECK(c.output().find("signal 15: stopping the workers") != std::string::npos);
  CHECK(wait_until([&] { return count_of(job.all_output(), "of 2") == 2; }, 60s));
  b.signal(SIGINT);
  CHECK(b.wait(30s) == std::optional<int>(128 + SIGINT));
  CHECK(a.wait_for_output("started: world size 1", 60s));
  std::ofstream(stop) << "stop";
  CHECK(a.wait(60s) == std::optional<int>(0));
  CHECK(no_marked_processes(job.marker));
}

// A restarted agent waits for its killed run's registration to expire (its
// lease's TTL, here 120 s); a stop signal meanwhile ends it at once, with
// its run directory.
TEST_CASE("agent: SIGTERM ends an agent that waits for its previous run's registration") {
  Job job;
  const std::vector<std::string> options = {"--nproc-per-node", "1",  "--lease-ttl", "120",
                                            "--poll-interval",  "0.1"};
  const auto worker = sh("sleep 300");
  Child& first = job.start("a", options, worker);
  REQUIRE(first.wait_for_output("round 1 started", 60s));
  first.signal(SIGKILL);
  first.wait(10s);
  // Its workers went with it; its run directory stays (no one removed it).
  REQUIRE(no_marked_processes(job.marker));
  const auto left_before = std::distance(std::filesystem::directory_iterator(job.tmp),
                                         std::filesystem::directory_iterator());
  Child& restarted = job.start("a", options, worker);
  REQUIRE(restarted.wait_for_output("is registered by another lease", 60s));
  restarted.signal(SIGTERM);
  // Far less than the lease's time left: the wait was not sat out.
  CHECK(restarted.wait(30s) == std::optional<int>(128 + SIGTERM));
  CHECK(restarted.output().find("signal 15: no worker runs yet") != std::string::npos);
  CHECK(std::distance(std::filesystem::directory_iterator(job.tmp),
                      std::filesystem::directory_iterator()) == left_before);
  CHECK(no_marked_processes(job.marker));
}

// A node drained with SIGTERM (--checkpoint-timeout): the round's workers
// save first, the drained agent leaves once the others re-formed without
// it, and round 2 goes on from the checkpoint: every step once.
TEST_CASE("agent: a drained node's round checkpoints before it leaves") {
  Job job;
  const std::string stop = (job.dir / "stop").string();
  auto worker = std::vector<std::string>{DUCTILE_PYTHON, DUCTILE_AGENT_WORKERS "/steps.py",
                                         job.dir.path().string(), stop, "--on-request"};
  std::vector<std::string> options = {
      "--nproc-per-node", "1", "--lease-ttl",          "2", "--settle", "1",
      "--stop-grace",     "1", "--checkpoint-timeout", "60"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  auto steps = [&] { return count_of(read_text(job.dir / "steps.log"), "\n"); };
  bool running = wait_until(
      [&] {
        return job.all_output().find("start round=1 world=3 at step 0") != std::string::npos &&
               steps() >= 5;
      },
      120s);
  if (!running) job.dump();
  REQUIRE(running);
  Child* drained = nullptr;
  for (Child* agent : {&a, &b, &c})
    if (agent->output().find("leader: round 1 formed") == std::string::npos &&
        agent->output().find("group rank 0,") == std::string::npos)
      drained = agent;
  REQUIRE(drained);
  drained->signal(SIGTERM);
  auto status = drained->wait(120s);
  if (status != std::optional<int>(128 + SIGTERM)) job.dump();
  CHECK(status == std::optional<int>(128 + SIGTERM));
  std::string out = drained->output();
  CHECK(
      out.find("signal 15: asking the workers of round 1 to checkpoint before this node leaves") !=
      std::string::npos);
  CHECK(out.find("round 1: this node's workers saved their checkpoint") != std::string::npos);
  CHECK(out.find("signal 15: the round re-formed without this node; leaving the job") !=
        std::string::npos);
  bool resumed = wait_until(
      [&] { return job.all_output().find("start round=2 world=2 at step ") != std::string::npos; },
      120s);
  if (!resumed) job.dump();
  REQUIRE(resumed);
  CHECK(count_of(job.all_output(), "saved round=1 rank=") == 3);
  CHECK(job.all_output().find("every member's workers saved") != std::string::npos);
  const std::string resumed_at = field_after(job.all_output(), "start round=2 world=2", "at step ");
  if (resumed_at != read_text(job.dir / "checkpoint")) job.dump();
  CHECK(resumed_at == read_text(job.dir / "checkpoint"));
  CHECK(wait_until([&] { return steps() >= std::stoul(resumed_at) + 5; }, 60s));
  std::ofstream(stop) << "stop";
  for (Child* agent : {&a, &b, &c})
    if (agent != drained) CHECK(agent->wait(60s) == std::optional<int>(0));
  // Every step once, in order, across the two rounds.
  std::istringstream log(read_text(job.dir / "steps.log"));
  std::size_t expected = 0;
  for (std::size_t step; log >> step;) {
    std::string round;
    log >> round;
    CHECK(step == expected);
    ++expected;
  }
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

#ifdef DUCTILE_ZERO3_WORKER_ENV
// ZeRO-3 workers (ductile.torch.zero3 on the cpu backend) whose MPI world the
// agents form without mpirun (--mpi-world). The leader is killed in the
// middle of training at world size 2; the other agent re-forms at world size
// 1 and its worker resumes from the checkpoint the 2-rank round saved, with
// the losses of an uninterrupted run of plain torch.
TEST_CASE("agent: zero3 workers resume from their checkpoint at the new world size") {
  Job job;
  constexpr int kSteps = 12;
  // The reference: one process, torch alone, the same global batch.
  const Zero3Run run(job, kSteps);
  const auto& train = run.train;
  auto worker = run.worker("0.4");
  std::vector<std::string> options = {
      "--nproc-per-node", "1", "--mpi-world", "--min-nodes", "1", "--settle", "1",
      "--stop-grace",     "2"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  auto lines = [&] { return count_of(read_text(train / "losses.jsonl"), "\n"); };
  // Step 3's line comes after the checkpoint at step 3 is committed (step
  // 2's line comes before it: a kill then resumes at 2).
  bool trained = wait_until(
      [&] { return count_of(job.all_output(), "zero3 round=1 world=2 step=3 ") == 1; }, 240s);
  if (!trained) job.dump();
  REQUIRE(trained);
  Child& leader = a.output().find("leader: round 1 formed") != std::string::npos ? a : b;
  Child& survivor = &leader == &a ? b : a;
  leader.signal(SIGKILL);
  leader.wait(10s);
  auto status = survivor.wait(240s);
  if (status != std::optional<int>(0)) job.dump();
  REQUIRE(status == std::optional<int>(0));
  CHECK(survivor.output().find("started: world size 1") != std::string::npos);

  // Every step trained, in either round, lost what plain torch lost; the
  // 1-rank round went on from the step the 2-rank round last saved.
  int last_step = -1, resumed_at = -1, resumed_from_world = 0, rounds_seen = 0, previous = -1;
  run.each_line([&](const nlohmann::json& entry, int step, int world) {
    if (world == 1 && resumed_at < 0 && !entry["resumed"].is_null()) {
      resumed_at = entry["resumed"]["step"].get<int>();
      resumed_from_world = entry["resumed"]["world"].get<int>();
      CHECK(step == resumed_at);
      CHECK(previous >= resumed_at - 1);  // nothing skipped
    }
    if (step == 0) ++rounds_seen;
    previous = step;
    last_step = step;
  });
  CHECK(lines() >= kSteps);
  CHECK(rounds_seen == 1);  // round 1 started from scratch, round 2 did not
  CHECK(resumed_at >= 3);
  CHECK(resumed_from_world == 2);
  CHECK(last_step == kSteps - 1);
  CHECK(survivor.output().find("zero3 done round=2 rank=0 world=1") != std::string::npos);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

// A planned re-form loses no step: two agents train zero3
// workers at world size 2 and save nothing until asked; a third agent
// arrives, the leader asks the round to checkpoint (--checkpoint-timeout),
// the workers agree on a step (ductile.torch.elastic.should_checkpoint
// through the engine), save and exit, and round 2 at world size 3 goes on
// from exactly that step. Every step is trained once, with plain torch's
// losses.
TEST_CASE("agent: a scale-up from 2 to 3 zero3 nodes checkpoints first and loses no step") {
  Job job;
  constexpr int kSteps = 14;
  const Zero3Run run(job, kSteps);
  auto worker = run.worker("0.4", {"--on-request"});
  std::vector<std::string> options = {"--nproc-per-node",
                                      "1",
                                      "--mpi-world",
                                      "--min-nodes",
                                      "2",
                                      "--settle",
                                      "1",
                                      "--stop-grace",
                                      "2",
                                      "--min-time",
                                      "0",
                                      "--checkpoint-timeout",
                                      "120"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  bool trained = wait_until(
      [&] { return count_of(job.all_output(), "zero3 round=1 world=2 step=2 ") == 1; }, 240s);
  if (!trained) job.dump();
  REQUIRE(trained);
  Child& c = job.start("c", options, worker);
  for (Child* agent : {&a, &b, &c}) {
    auto status = agent->wait(300s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  std::string out = job.all_output();
  CHECK(out.find("leader: asked the workers of round 1 to checkpoint before re-forming (scale-up: "
                 "3 node(s) admitted of 3 present)") != std::string::npos);
  CHECK(count_of(out, "round 1: this node's workers saved their checkpoint") == 2);
  CHECK(out.find("leader: round 2 formed: scale-up: 3 node(s) admitted of 3 present; every "
                 "member's workers saved") != std::string::npos);
  CHECK(count_of(out, "round 2 started: world size 3") == 3);

  // Each step once, with plain torch's loss; round 2 starts where round 1
  // saved.
  std::vector<int> trained_at(kSteps, 0);
  int last_of_round1 = -1, first_of_round2 = -1;
  run.each_line([&](const nlohmann::json& entry, int step, int world) {
    ++trained_at[step];
    if (world == 2) last_of_round1 = std::max(last_of_round1, step);
    if (world == 3 && first_of_round2 < 0) {
      first_of_round2 = step;
      CHECK(entry["resumed"]["step"].get<int>() == step);
      CHECK(entry["resumed"]["world"].get<int>() == 2);
    }
  });
  for (int step = 0; step < kSteps; ++step) {
    INFO("step " << step);
    CHECK(trained_at[step] == 1);  // none lost, none repeated
  }
  CHECK(last_of_round1 >= 2);
  CHECK(first_of_round2 == last_of_round1 + 1);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

// The snapshot folders the agents' areas in `shm` hold that a restore of
// `step` made useless: in own/ and replicas/<node>/, those of an older
// step; in own/, those of a newer step with the last round's rank files
// (of `last_world` ranks; the new round's workers write other names). The
// area whose name contains `skip` (a killed agent's, left behind) is not
// looked at.
static std::vector<std::string> useless_snapshots(const std::string& shm, const std::string& skip,
                                                  int step, int last_world) {
  namespace fs = std::filesystem;
  std::vector<std::string> found;
  std::error_code ec;
  const std::string last_round_file = "-of-" + std::to_string(last_world) + ".bin";
  auto look_in = [&](const fs::path& folder, bool own) {
    for (fs::directory_iterator it(folder, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const std::size_t digits = name.find_first_not_of("0123456789", 4);
      // A replica's staging folder is the replication's, removed when its
      // copy ends or is abandoned.
      if (name.rfind("step", 0) != 0 || digits == 4 || (!own && name.ends_with(".tmp"))) continue;
      const int tag_step = std::stoi(name.substr(4, digits - 4));
      bool useless = tag_step < step;
      std::error_code listing;
      for (fs::directory_iterator file(it->path(), listing), none;
           own && tag_step > step && !listing && file != none; file.increment(listing))
        useless = useless || file->path().filename().string().ends_with(last_round_file);
      if (useless) found.push_back(it->path().string());
    }
    ec.clear();  // a folder removed meanwhile
  };
  for (fs::directory_iterator area(shm, ec), end; !ec && area != end; area.increment(ec)) {
    if (area->path().filename().string().find(skip) != std::string::npos) continue;
    look_in(area->path() / "own", true);
    std::vector<fs::path> nodes;
    for (fs::directory_iterator node(area->path() / "replicas", ec), none; !ec && node != none;
         node.increment(ec))
      nodes.push_back(node->path());
    ec.clear();
    for (const auto& node : nodes) look_in(node, false);
  }
  return found;
}

// The bytes the rank files of an agent's area take (st_blocks, each file
// once however many names it has: a restored copy links the files its node
// held), and the size of the largest committed own rank file of `world`
// ranks (a node's state in a round of that world size, one rank a node).
struct AreaBytes {
  std::uintmax_t held = 0;
  std::uintmax_t state = 0;
};

static AreaBytes area_bytes(const std::filesystem::path& area, int world) {
  namespace fs = std::filesystem;
  AreaBytes out;
  std::set<std::pair<dev_t, ino_t>> seen;
  const std::string of_world = "-of-" + std::to_string(world) + ".bin";
  std::error_code ec;
  // A folder removed meanwhile ends the walk early: fewer bytes, never more.
  for (fs::recursive_directory_iterator it(area, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    struct stat st{};
    if (!name.starts_with("rank") || ::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      continue;
    if (seen.insert({st.st_dev, st.st_ino}).second)
      out.held += static_cast<std::uintmax_t>(st.st_blocks) * 512;
    const fs::path folder = it->path().parent_path();
    if (name.ends_with(of_world) && folder.parent_path().filename() == "own" &&
        !folder.filename().string().ends_with(".tmp"))
      out.state = std::max(out.state, static_cast<std::uintmax_t>(st.st_size));
  }
  return out;
}

// An unplanned loss restores from memory: three agents train zero3 workers
// that save nothing to disk; each step's state is snapshotted into the
// agents' shared memory and copied to one other node. A node (agent and
// worker) is SIGKILLed at a random step; the two survivors re-form at world
// size 2 and their workers restore the newest snapshot complete in their
// memory (their own copies and the lost node's replica), re-sharded from 3
// ranks to 2. At most one step (snapshot_interval) is trained again, none is
// skipped, and every loss equals plain torch's.
TEST_CASE("agent: a lost node's zero3 state is restored from the survivors' memory") {
  Job job;
  constexpr int kSteps = 14;
  const Zero3Run run(job, kSteps);
  std::random_device random;
  const int kill_after = 2 + static_cast<int>(random() % 5);  // a step of 2..6
  const int victim = static_cast<int>(random() % 3);
  INFO("node " << victim << " killed after step " << kill_after);

  auto worker = run.worker("0.3", {"--memory"});
  const std::string shm = (job.dir / "shm").string();
  std::filesystem::create_directories(shm);
  std::vector<std::string> options = {"--nproc-per-node",
                                      "1",
                                      "--mpi-world",
                                      "--min-nodes",
                                      "2",
                                      "--settle",
                                      "1",
                                      "--stop-grace",
                                      "2",
                                      "--lease-ttl",
                                      "2",
                                      "--snapshot-dir",
                                      shm};
  std::vector<Child*> agents = {&job.start("a", options, worker), &job.start("b", options, worker),
                                &job.start("c", options, worker)};
  bool trained = wait_until(
      [&] {
        return count_of(job.all_output(),
                        "zero3 round=1 world=3 step=" + std::to_string(kill_after) + " ") == 1;
      },
      240s);
  if (!trained) job.dump();
  REQUIRE(trained);
  agents[static_cast<std::size_t>(victim)]->signal(SIGKILL);
  agents[static_cast<std::size_t>(victim)]->wait(10s);
  // From the moment both survivors' workers load the restore (they
  // started ahead of it) until the agents exit, no area holds a snapshot
  // older than the one restored, nor a
  // newer one of the last round: that memory goes at the restore, before
  // the new round writes its own. And no area holds more than (1 + 1
  // replica) x 2 x a node's new state: the restored copy is freed before
  // the new round's second snapshot is written.
  const std::string killed_area =
      "-" + std::to_string(agents[static_cast<std::size_t>(victim)]->pid()) + "-";
  int restored_step = -1;
  std::set<std::string> useless;
  std::uintmax_t most_held = 0, state = 0;
  wait_until(
      [&] {
        if (restored_step < 0) {
          const std::string now = job.all_output();
          const std::size_t said = now.find("round 2: restored step ");
          if (said != std::string::npos &&
              count_of(now, "round 2: the workers started ahead of the restore load it") == 2)
            restored_step = std::stoi(now.substr(said + 23));
        }
        if (restored_step >= 0) {
          for (const auto& path : useless_snapshots(shm, killed_area, restored_step, 3))
            useless.insert(path);
          std::error_code ec;
          for (std::filesystem::directory_iterator area(shm, ec), end; !ec && area != end;
               area.increment(ec))
            if (area->path().filename().string().find(killed_area) == std::string::npos) {
              const AreaBytes bytes = area_bytes(area->path(), 2);
              most_held = std::max(most_held, bytes.held);
              state = std::max(state, bytes.state);
            }
        }
        for (int i = 0; i < 3; ++i)
          if (i != victim && !agents[static_cast<std::size_t>(i)]->poll()) return false;
        return true;
      },
      240s);
  CHECK(restored_step >= 0);
  std::string held;
  for (const auto& path : useless) held += "\n  " + path;
  INFO("held after the restore:" << held);
  CHECK(useless.empty());
  // The files' headers and their last pages: a few KiB over the bound.
  INFO("at most " << most_held << " bytes of rank files held, a node's state " << state);
  REQUIRE(state > 0);
  CHECK(most_held <= 4 * state + (64u << 10));
  for (int i = 0; i < 3; ++i) {
    if (i == victim) continue;
    auto status = agents[static_cast<std::size_t>(i)]->wait(240s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  std::string out = job.all_output();
  CHECK(count_of(out, "round 2 started: world size 2") == 2);
  // Both survivors name the same restore: the lost node's ranks from its
  // replica, the others' from their own copies.
  CHECK(count_of(out, "round 2: restored step ") == 2);
  CHECK(count_of(out, "from memory: 2 of 3 nodes' own copies, 1 replica; ") == 2);

  std::vector<int> trained_at(kSteps, 0);
  int restored = -1;
  run.each_line([&](const nlohmann::json& entry, int step, int world) {
    ++trained_at[step];
    if (world == 2 && restored < 0) {
      REQUIRE(entry["resumed"].is_object());
      CHECK(entry["resumed"]["from"] == "memory");
      restored = entry["resumed"]["step"].get<int>();
      CHECK(step == restored);
    }
  });
  CHECK(restored >= kill_after);
  int again = 0;
  for (int step = 0; step < kSteps; ++step) {
    INFO("step " << step);
    CHECK(trained_at[step] >= 1);  // none skipped
    again += trained_at[step] - 1;
  }
  CHECK(again <= 1);  // snapshot_interval
  // The agent counts the steps completed after the restored one (a step
  // killed before its snapshot committed is trained again but was never
  // completed).
  const std::size_t said = out.find("1 replica; ");
  REQUIRE(said != std::string::npos);
  const std::string reported = out.substr(said + 11, out.find('\n', said) - said - 11);
  INFO("the agent's line: ... 1 replica; " << reported);
  CHECK((reported.rfind("0 steps lost", 0) == 0 || reported.rfind("1 step lost", 0) == 0));
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

// More nodes lost than the snapshots have replicas: two of three nodes
// SIGKILLed at once, each snapshot copied to one other node. No snapshot
// is complete in the survivor's memory; it says why, and its worker goes
// on from the disk checkpoint the job also saves, at world size 1, with
// plain torch's losses.
TEST_CASE("agent: two nodes lost with one replica fall back to the disk checkpoint") {
  Job job;
  constexpr int kSteps = 8;
  const Zero3Run run(job, kSteps);
  auto worker = run.worker("0.3");
  const std::string shm = (job.dir / "shm").string();
  std::filesystem::create_directories(shm);
  std::vector<std::string> options = {
      "--nproc-per-node", "1", "--mpi-world",    "--settle", "1", "--stop-grace", "2",
      "--lease-ttl",      "2", "--snapshot-dir", shm};
  std::vector<Child*> agents = {&job.start("a", options, worker), &job.start("b", options, worker),
                                &job.start("c", options, worker)};
  bool trained = wait_until(
      [&] { return count_of(job.all_output(), "zero3 round=1 world=3 step=3 ") == 1; }, 240s);
  if (!trained) job.dump();
  REQUIRE(trained);
  // The survivor: not the leader (the lease of a lost leader takes as long).
  Child* survivor = agents[1];
  for (Child* agent : agents)
    if (agent != survivor) agent->signal(SIGKILL);
  for (Child* agent : agents)
    if (agent != survivor) agent->wait(10s);
  auto status = survivor->wait(240s);
  if (status != std::optional<int>(0)) job.dump();
  REQUIRE(status == std::optional<int>(0));
  const std::string out = survivor->output();
  // Round 2, or 3 when the two leases did not lapse in the same pass.
  const std::size_t said = out.find(": no complete snapshot in memory (");
  if (said == std::string::npos) job.dump();
  INFO("the survivor's line: " << (said == std::string::npos
                                       ? "none"
                                       : out.substr(said, out.find('\n', said) - said)));
  CHECK(out.find(": no complete snapshot in memory (rank ") != std::string::npos);
  // Which rank's shards it names depends on the step the kill interrupted
  // (held only by a lost node, or by no member when the survivor's own
  // worker never committed that step).
  CHECK(out.find("'s shards of step ") != std::string::npos);
  CHECK(out.find("); the workers resume from their disk checkpoint") != std::string::npos);
  CHECK(out.find("from memory:") == std::string::npos);
  CHECK(out.find("started: world size 1") != std::string::npos);

  // Round 2 went on from the disk checkpoint: every loss plain torch's,
  // the last step trained.
  int last = -1, resumed_at = -1;
  run.each_line([&](const nlohmann::json& entry, int step, int world) {
    if (world == 1 && resumed_at < 0 && !entry["resumed"].is_null())
      resumed_at = entry["resumed"]["step"].get<int>();
    last = step;
  });
  CHECK(resumed_at >= 3);
  CHECK(last == kSteps - 1);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
#endif
