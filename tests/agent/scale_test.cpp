// `ductile agent` against one etcd with many agents, and with an etcd that
// stalls: 64 agents (trivial workers) form one round with watch messages and
// requests in proportion to their count (only the oldest agents follow every
// node's records), and at rest etcd serves their leases' keep-alives and nothing
// else (the agents follow the job's keys with a watch); an etcd stopped for 2 s (SIGSTOP) under a
// running job ends no agent, and the job goes on to its end; 20 agents link
// to a leader the age index lacks, and the 3 youngest left form a round when the
// 16 oldest are killed at once. Its own test program, given both of
// ctest's slots: 64 agents at once are the machine's whole load.
#include <doctest/doctest.h>

#include <signal.h>

#include <chrono>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agent_job.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "process.hpp"

using namespace ductile::test;
using namespace std::chrono_literals;

namespace {

// etcd's count of the calls of `type` ("unary", "bidi_stream") it
// started, by method (from its /metrics).
std::map<std::string, double> started_calls(const EtcdServer& etcd,
                                            const std::string& type = "unary") {
  auto r = run_process({"curl", "-s", "--max-time", "10", etcd.endpoint() + "/metrics"});
  REQUIRE(r.exit_code == 0);
  std::map<std::string, double> out;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("grpc_server_started_total{") ||
        line.find("grpc_type=\"" + type + "\"") == std::string::npos)
      continue;
    const auto method = line.find("grpc_method=\"");
    const auto end = line.find('"', method + 13);
    out[line.substr(method + 13, end - method - 13)] += std::stod(line.substr(line.rfind(' ')));
  }
  return out;
}

// A counter of etcd's /metrics (its value; 0 when absent).
double metric(const EtcdServer& etcd, const std::string& name) {
  auto r = run_process({"curl", "-s", "--max-time", "10", etcd.endpoint() + "/metrics"});
  REQUIRE(r.exit_code == 0);
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);)
    if (line.starts_with(name + " ")) return std::stod(line.substr(name.size() + 1));
  return 0;
}

// `ductile agent` of job `job` on `etcd` with a worker that says its round
// and world size, then waits for `stop` to exist and exits 0.
std::vector<std::string> agent_argv(const EtcdServer& etcd, const std::string& job,
                                    const std::string& node, const std::string& nodes,
                                    const std::string& stop, const std::string& ttl) {
  return {DUCTILE_CLI,
          "agent",
          "--rdzv",
          etcd.url(),
          "--job-id",
          job,
          "--nnodes",
          nodes,
          "--nproc-per-node",
          "1",
          "--node-addr",
          "127.0.0.1",
          "--node-id",
          node,
          "--lease-ttl",
          ttl,
          "--stop-grace",
          "2",
          "--",
          "/bin/sh",
          "-c",
          "echo \"up round $DUCTILE_ROUND world $WORLD_SIZE\"; while [ ! -e " + stop +
              " ]; do sleep 0.2; done"};
}

}  // namespace

TEST_CASE("agent: 64 agents form one round, and at rest etcd serves their keep-alives only") {
  TempDir dir;
  const std::string marker = new_marker(), stop = (dir / "stop").string();
  EtcdServer etcd(dir.path());
  constexpr int kAgents = 64;
  std::vector<std::unique_ptr<Child>> agents;
  for (int i = 0; i < kAgents; ++i) {
    const std::string node = "n" + std::to_string(100 + i);
    agents.push_back(std::make_unique<Child>(agent_argv(etcd, "scale", node, "64:64", stop, "10"),
                                             std::vector<std::string>{marker},
                                             dir / (node + ".log")));
  }
  auto up = [&] {
    int n = 0;
    for (auto& a : agents) n += a->output().find("up round") != std::string::npos;
    return n;
  };
  const bool formed = wait_until([&] { return up() == kAgents; }, 300s);
  if (!formed)
    for (auto& a : agents) std::cout << a->output();
  REQUIRE(formed);
  // Forming cost etcd watch messages in proportion to the agents: a record
  // each agent writes (registration, snapshot record, holdings) reaches the
  // 16 oldest agents, not every agent (that would be 3 x 64 x 64 = 12,288).
  // The last round's writes settle; the last agent's keep-alive stream
  // opened (its first renewal, TTL/3 = 3.3 s after its lease's grant).
  std::this_thread::sleep_for(4s);
  const double events = metric(etcd, "etcd_debugging_mvcc_events_total");
  std::cout << kAgents << " agents formed with " << events << " watch events sent by etcd\n";
  CHECK(events > 0);
  CHECK(events <= 80.0 * kAgents);
  // One round, of all of them.
  for (auto& a : agents) {
    const std::string out = a->output();
    CHECK(out.find("up round 1 world 64") != std::string::npos);
    CHECK(out.find("up round 2") == std::string::npos);
  }

  // At rest: keep-alives (on one stream an agent, not counted here) and no
  // reads.
  const auto before = started_calls(etcd);
  const auto streams_before = started_calls(etcd, "bidi_stream");
  double formed_with = 0;
  std::string formed_by;
  for (const auto& [method, count] : before) {
    formed_with += count;
    formed_by += " " + method + "=" + std::to_string(static_cast<int>(count));
  }
  std::cout << kAgents << " agents formed with " << formed_with
            << " unary requests to etcd:" << formed_by << "\n";
  // The count is etcd's: forming the round took requests of every agent.
  CHECK(formed_with >= kAgents);
  // An agent's lease, its registration with the reads it joins by (its
  // key, the first registrations in key order, the settings, the round and
  // the first entries of the age index) and its mirror's first read in one
  // request, and its own entry in the age index; the oldest few read more
  // (about 3.7 an agent in all). The mirror's first read apart took one
  // more an agent (4.9). Registering and joining apart, with a snapshot
  // record written when nothing is held, took 2 more an agent (5.8);
  // reading its key, the oldest registrations, the settings, and the
  // leader's record apart at its join and first pass, and the oldest
  // registrations again at the round's start, 4 more again.
  CHECK(formed_with <= 4.3 * kAgents);
  const auto window = 5s;
  std::this_thread::sleep_for(window);
  const auto after = started_calls(etcd);
  double requests = 0;
  std::string by_method;
  for (const auto& [method, count] : after) {
    const double made = count - (before.count(method) ? before.at(method) : 0.0);
    if (made > 0) by_method += " " + method + "=" + std::to_string(static_cast<int>(made));
    requests += made;
  }
  std::cout << kAgents << " agents at rest for 5 s: " << requests
            << " unary requests to etcd:" << by_method << "\n";
  // At most one request per agent in the window: a pass reading the job's
  // keys from etcd would make 4 a second each (1,280 here).
  CHECK(requests <= kAgents);
  // Each agent renews its lease on the stream it opened (1 or 2 renewals an
  // agent in the window, each a stream of its own before).
  const auto streams_after = started_calls(etcd, "bidi_stream");
  const auto renewal_streams = [](const std::map<std::string, double>& calls) {
    return calls.count("LeaseKeepAlive") ? calls.at("LeaseKeepAlive") : 0.0;
  };
  std::cout << kAgents << " agents at rest for 5 s: "
            << renewal_streams(streams_after) - renewal_streams(streams_before)
            << " keep-alive streams opened\n";
  CHECK(renewal_streams(streams_before) >= kAgents);
  CHECK(renewal_streams(streams_after) == renewal_streams(streams_before));

  dir.write("stop", "stop\n");
  for (auto& a : agents) {
    auto status = a->wait(120s);
    if (status != std::optional<int>(0)) std::cout << a->output();
    CHECK(status == std::optional<int>(0));
  }
  CHECK(no_marked_processes(marker));
}

TEST_CASE("agent: etcd stopped for 2 s under a running job ends no agent - the job goes on") {
  TempDir dir;
  const std::string marker = new_marker(), stop = (dir / "stop").string();
  EtcdServer etcd(dir.path());
  std::vector<std::unique_ptr<Child>> agents;
  for (const char* node : {"a", "b", "c"})
    agents.push_back(std::make_unique<Child>(agent_argv(etcd, "stall", node, "3:3", stop, "5"),
                                             std::vector<std::string>{marker},
                                             dir / (std::string(node) + ".log")));
  auto all_up = [&] {
    for (auto& a : agents)
      if (a->output().find("up round 1 world 3") == std::string::npos) return false;
    return true;
  };
  const bool formed = wait_until(all_up, 120s);
  if (!formed)
    for (auto& a : agents) std::cout << a->output();
  REQUIRE(formed);
  REQUIRE(::kill(etcd.pid(), SIGSTOP) == 0);
  std::this_thread::sleep_for(2s);  // the stall under test
  REQUIRE(::kill(etcd.pid(), SIGCONT) == 0);
  // No agent ended during or after it, nor re-formed: the round runs on.
  std::this_thread::sleep_for(3s);
  for (auto& a : agents) {
    const std::string out = a->output();
    INFO(out);
    CHECK_FALSE(a->poll().has_value());
    CHECK(out.find("round 2") == std::string::npos);
    CHECK(out.find("internal error") == std::string::npos);
  }
  dir.write("stop", "stop\n");
  for (auto& a : agents) {
    auto status = a->wait(120s);
    if (status != std::optional<int>(0)) std::cout << a->output();
    CHECK(status == std::optional<int>(0));
  }
  CHECK(no_marked_processes(marker));
}

// Agents that do not lead link to the leader the age index names first. The
// leader's entry deleted before the others join (as when they read the
// index before the leader wrote it): they link to it all the same once the
// round names it, and a killed agent's link tells the leader at once. Then
// the 16 oldest agents (all that lead or are next in line) killed at once:
// nobody revokes their leases, and the 3 others, at rest in their round,
// hear only that their links to the leader closed. Without a link to a
// leader, each reads the oldest entries of the age index every 2 s; once
// the leases expire, the oldest of them leads and they form a round of 3.
TEST_CASE("agent: agents link to a leader missing from the age index - its 16 oldest killed") {
  TempDir dir;
  const std::string marker = new_marker(), stop = (dir / "stop").string();
  EtcdServer etcd(dir.path());
  ductile::agent::EtcdStore store(etcd.endpoint());
  const std::string prefix = "/ductile/agent/window/";
  constexpr int kAgents = 20;
  std::map<std::string, std::unique_ptr<Child>> agents;
  auto start = [&](int i) {
    const std::string node = "n" + std::to_string(100 + i);
    agents[node] = std::make_unique<Child>(agent_argv(etcd, "window", node, "3:20", stop, "3"),
                                           std::vector<std::string>{marker}, dir / (node + ".log"));
  };
  auto dump = [&] {
    for (auto& [node, a] : agents) std::cout << node << ":\n" << a->output();
  };
  auto all_say = [&](const std::vector<std::string>& nodes, const std::string& text) {
    return wait_until(
        [&] {
          for (const auto& node : nodes)
            if (agents[node]->output().find(text) == std::string::npos) return false;
          return true;
        },
        120s);
  };
  start(0);
  std::vector<ductile::agent::KeyValue> entry;
  REQUIRE(wait_until(
      [&] {
        entry = store.get_prefix(prefix + "ages/");
        return entry.size() == 1;
      },
      60s));
  REQUIRE(entry.front().key.ends_with("/n100"));
  store.erase(entry.front().key);
  for (int i = 1; i < kAgents; ++i) start(i);
  std::vector<std::string> nodes;
  for (auto& [node, a] : agents) nodes.push_back(node);
  const bool formed = all_say(nodes, " world 20");
  if (!formed) dump();
  REQUIRE(formed);
  CHECK(agents["n100"]->output().find("leader: round 1 formed") != std::string::npos);

  // The youngest, killed: its link to the leader closes. (Those that took
  // another for their leader link to it once the round names it, at the
  // round's start: a moment, given 2 s here.)
  std::this_thread::sleep_for(2s);
  const auto by_age =
      store.read({ductile::agent::RangeRead{prefix + "nodes/", true, 0, true}}).front();
  REQUIRE(by_age.size() == kAgents);
  const std::string youngest = by_age.back().key.substr(by_age.back().key.rfind('/') + 1);
  REQUIRE(youngest != "n100");
  ::kill(-agents[youngest]->pid(), SIGKILL);
  agents[youngest]->wait(10s);
  std::erase(nodes, youngest);
  const bool heard = agents["n100"]->wait_for_output(
      "node " + youngest + " lost: its link closed; its lease revoked", 10s);
  if (!heard) dump();
  CHECK(heard);
  const bool reformed = all_say(nodes, " world 19");
  if (!reformed) dump();
  REQUIRE(reformed);

  // The 16 oldest registrations (etcd's order of creation), killed.
  std::vector<std::string> survivors = nodes;
  for (std::size_t i = 0; i < 16; ++i) {
    const std::string node = by_age[i].key.substr(by_age[i].key.rfind('/') + 1);
    REQUIRE(agents.count(node) == 1);
    ::kill(-agents[node]->pid(), SIGKILL);
    std::erase(survivors, node);
  }
  REQUIRE(survivors.size() == 3);
  for (std::size_t i = 0; i < 16; ++i)
    agents[by_age[i].key.substr(by_age[i].key.rfind('/') + 1)]->wait(10s);
  // The leases expire 3 s after the kill; rechecks come every 2 s.
  const bool led = all_say(survivors, " world 3");
  if (!led) dump();
  CHECK(led);
  for (const auto& node : survivors) {
    const std::string out = agents[node]->output();
    INFO(node << ":\n" << out);
    CHECK_FALSE(agents[node]->poll().has_value());
    CHECK(out.find("internal error") == std::string::npos);
  }
  dir.write("stop", "stop\n");
  for (const auto& node : survivors) {
    auto status = agents[node]->wait(120s);
    if (status != std::optional<int>(0)) std::cout << agents[node]->output();
    CHECK(status == std::optional<int>(0));
  }
  CHECK(no_marked_processes(marker));
}
