// How agents recover from lost nodes, as the survivors see it: a round
// formed with a member that died before it published its snapshot holdings
// is given up for the next one at once; a survivor left with too few nodes
// says what it waits for and gives up at --rdzv-conf join_timeout; the
// survivors' workers, whose collectives fail as a peer dies, end with one
// line saying why the round ended. Real agents on a real etcd (started
// by the test).
#include <doctest/doctest.h>

#include <algorithm>
#include <csignal>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "agent_job.hpp"
#include "process.hpp"
#include "zero3_job.hpp"

using namespace ductile::test;

// Not an anonymous namespace: a unity build puts this file beside other
// tests, whose helpers' names would clash.
namespace recovery_test {

// Nodes a (the leader: it joins first), b and c, once all three run round 1.
std::tuple<Child&, Child&, Child&> start_three(Job& job, const std::vector<std::string>& options,
                                               const std::vector<std::string>& worker) {
  Child& a = job.start("a", options, worker);
  REQUIRE(a.wait_for_output("joined job", 60s));
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  const bool formed = wait_until(
      [&] { return count_of(job.all_output(), "round 1 started: world size 3") == 3; }, 120s);
  if (!formed) job.dump();
  REQUIRE(formed);
  return {a, b, c};
}

}  // namespace recovery_test

using namespace recovery_test;

// Two nodes of three lost at once: b SIGKILLed, c's agent stopped
// (SIGSTOP). The leader knows b from its closed link and forms round 2
// with itself and c, which never publishes its snapshot holdings; c's
// silent link has its lease revoked after --heartbeat (1 s), before the
// holdings' patience (max(10 s, 4 x --lease-ttl) = 16 s) would end: the
// survivor gives round 2 up at once and the leader forms round 3 without
// it. No worker starts in a round with a dead member.
TEST_CASE("agent: a member that died before the round's holdings ends the wait for them") {
  Job job;
  const std::vector<std::string> worker = sh("sleep 600");
  const std::vector<std::string> options = {"--nproc-per-node", "1", "--min-nodes",  "1",
                                            "--settle",         "1", "--stop-grace", "2",
                                            "--lease-ttl",      "4"};
  auto [a, b, c] = start_three(job, options, worker);
  REQUIRE(a.output().find("leader: round 1 formed") != std::string::npos);

  b.signal(SIGKILL);
  c.signal(SIGSTOP);
  const auto killed = Clock::now();
  const bool recovered = a.wait_for_output("started: world size 1 (1 nodes x 1)", 60s);
  const double seconds = seconds_since(killed);
  if (!recovered) job.dump();
  REQUIRE(recovered);
  MESSAGE("the survivor's workers started " << seconds << " s after the nodes were lost");
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
  c.signal(SIGKILL);
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
  auto [a, b, c] = start_three(job, options, worker);
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

#ifdef DUCTILE_ZERO3_WORKER_ENV
namespace recovery_test {

// `root` and every process below it (by /proc's parent links) of those
// that carry `marker`.
std::vector<int> process_tree(int root, const std::string& marker) {
  std::vector<int> tree = {root};
  for (std::size_t i = 0; i < tree.size(); ++i)
    for (const int pid : marked_processes(marker)) {
      const std::string stat = read_text("/proc/" + std::to_string(pid) + "/stat");
      const std::size_t paren = stat.rfind(')');
      if (paren == std::string::npos) continue;
      std::istringstream fields(stat.substr(paren + 2));
      std::string state;
      int parent = 0;
      fields >> state >> parent;
      if (parent == tree[i] && std::find(tree.begin(), tree.end(), pid) == tree.end())
        tree.push_back(pid);
    }
  return tree;
}

}  // namespace recovery_test

// Three nodes' workers all-reduce (gloo) and raise ductile.CommunicationError
// when a peer is gone, as ductile's collectives do; one node's process tree
// is lost: its agent stopped (SIGSTOP), the rest SIGKILLed. The survivors'
// workers see their peer die before the agents know (the stopped agent's
// link is revoked after --heartbeat): each ends with one line saying which
// round ended and why (the agent's reason: the node that left), not a
// traceback; the job then finishes at world size 2.
TEST_CASE("agent: a lost peer ends the survivors' workers with one line, not a traceback") {
  Job job;
  const auto worker = package_python("peer_lost.py");
  const std::vector<std::string> options = {"--nproc-per-node", "1", "--min-nodes",  "2",
                                            "--settle",         "1", "--stop-grace", "2",
                                            "--lease-ttl",      "2"};
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  Child& c = job.start("c", options, worker);
  const bool started =
      wait_until([&] { return count_of(job.all_output(), "peer_lost round=1 rank=") == 3; }, 240s);
  if (!started) job.dump();
  REQUIRE(started);
  // The node's whole process tree at once, as a machine is lost.
  c.signal(SIGSTOP);
  for (const int pid : recovery_test::process_tree(c.pid(), job.marker))
    if (pid != c.pid()) kill(pid, SIGKILL);
  for (Child* survivor : {&a, &b}) {
    const auto status = survivor->wait(120s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  c.signal(SIGKILL);
  c.wait(10s);
  const std::string out = a.output() + b.output();
  INFO(out);
  CHECK(count_of(out, "peer_lost round=2 rank=") == 2);
  CHECK(out.find("Traceback") == std::string::npos);
  CHECK(out.find("CommunicationError") == std::string::npos);
  // A worker still inside a collective when the agent stops it says
  // nothing; one whose collective failed says this.
  const std::size_t said = count_of(out, "ductile: rank ");
  CHECK(said >= 1);
  CHECK(count_of(out, ": round 1 ended: round 2 formed: node(s) c left; this worker stops") ==
        said);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
#endif
