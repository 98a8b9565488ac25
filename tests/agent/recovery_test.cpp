// How agents recover from lost nodes, as the survivors see it: a round
// formed with a member that died before it published its snapshot holdings
// is given up for the next one at once, and a survivor left with too few
// nodes says what it waits for and gives up at --rdzv-conf join_timeout.
// Real agents on a real etcd (started by the test); the workers sleep.
#include <doctest/doctest.h>

#include <csignal>
#include <string>
#include <thread>
#include <vector>

#include "agent_job.hpp"
#include "process.hpp"

using namespace ductile::test;

// Two nodes of three SIGKILLed 2.5 s apart (lease TTL 4 s, renewed every
// second): the leader sees the first one's lease lapse and forms round 2
// with itself and the second, which is dead and never publishes its
// snapshot holdings. Its lease lapses before the holdings' patience
// (max(10 s, 4 x --lease-ttl) = 16 s) would: the survivor gives round 2 up
// at once and the leader forms round 3 without it. No worker starts in a
// round with a dead member.
TEST_CASE("agent: a member that died before the round's holdings ends the wait for them") {
  Job job;
  const std::vector<std::string> worker = sh("sleep 600");
  const std::vector<std::string> options = {"--nproc-per-node", "1", "--min-nodes",  "1",
                                            "--settle",         "1", "--stop-grace", "2",
                                            "--lease-ttl",      "4"};
  Child& a = job.start("a", options, worker);
  REQUIRE(a.wait_for_output("joined job", 60s));
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  const bool formed = wait_until(
      [&] { return count_of(job.all_output(), "round 1 started: world size 3") == 3; }, 120s);
  if (!formed) job.dump();
  REQUIRE(formed);
  REQUIRE(a.output().find("leader: round 1 formed") != std::string::npos);

  b.signal(SIGKILL);
  std::this_thread::sleep_for(2500ms);
  c.signal(SIGKILL);
  const auto killed = Clock::now();
  const bool recovered = a.wait_for_output("started: world size 1 (1 nodes x 1)", 60s);
  const double seconds = seconds_since(killed);
  if (!recovered) job.dump();
  REQUIRE(recovered);
  MESSAGE("the survivor's workers started " << seconds << " s after the second kill");
  const std::string out = a.output();
  INFO(out);
  // Round 2 was formed with c (else this test tests nothing).
  REQUIRE(out.find("leader: round 2 formed: node(s) b left") != std::string::npos);
  CHECK(out.find("round 2: member(s) c left before they published their snapshot holdings") !=
        std::string::npos);
  CHECK(out.find("no snapshot holdings from member(s)") == std::string::npos);
  CHECK(out.find("round 2 started") == std::string::npos);
  CHECK(out.find("leader: round 3 formed: node(s) c left") != std::string::npos);
  CHECK(out.find("round 3 started: world size 1") != std::string::npos);

  a.signal(SIGTERM);
  CHECK(a.wait(30s).has_value());
  b.wait(10s);
  c.wait(10s);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

// --nnodes 2:3 and two of three nodes SIGKILLed: the survivor says what it
// waits for (how many nodes it has and needs) and until when, repeats it
// every 15 s, and gives up at --rdzv-conf join_timeout with exit status 1.
TEST_CASE("agent: a survivor short of nodes says what it waits for and ends at join_timeout") {
  Job job;
  const std::vector<std::string> worker = sh("sleep 600");
  const std::vector<std::string> options = {
      "--nproc-per-node", "1", "--nnodes",    "2:3", "--settle",    "1",
      "--stop-grace",     "2", "--lease-ttl", "2",   "--rdzv-conf", "join_timeout=17"};
  Child& a = job.start("a", options, worker);
  REQUIRE(a.wait_for_output("joined job", 60s));
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  const bool formed = wait_until(
      [&] { return count_of(job.all_output(), "round 1 started: world size 3") == 3; }, 120s);
  if (!formed) job.dump();
  REQUIRE(formed);
  b.signal(SIGKILL);
  c.signal(SIGKILL);
  const auto status = a.wait(90s);
  const std::string out = a.output();
  INFO(out);
  CHECK(status == std::optional<int>(1));
  CHECK(out.find("too few nodes, waiting); 1 node(s) present of the 2 needed (--nnodes 2:3") !=
        std::string::npos);
  CHECK(out.find("--rdzv-conf join_timeout=17) with exit status 1") != std::string::npos);
  CHECK(count_of(out, "still waiting: 1 node(s) present of the 2 needed") == 1);
  CHECK(out.find("error: too few nodes for ") != std::string::npos);
  CHECK(out.find("(--rdzv-conf join_timeout): 1 node(s) present; giving up with exit status 1") !=
        std::string::npos);
  b.wait(10s);
  c.wait(10s);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
