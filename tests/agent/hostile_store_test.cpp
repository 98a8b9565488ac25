// `ductile agent` against a hostile or stale store: records no
// agent wrote, keys without a lease, and two agents with one node id. Every
// bad record is logged with its key and ignored; the job goes on in its
// round. A real etcd started by each test.
#include <doctest/doctest.h>

#include <tuple>

#include "agent_job.hpp"

using namespace ductile::test;
using ductile::agent::EtcdStore;

namespace {

const std::string kPrefix = "/ductile/agent/job/";

// Which of two agents formed round 1 (the leader), and the other.
std::pair<Child*, Child*> leader_and_other(Child& a, Child& b) {
  bool a_leads = a.output().find("leader: round 1 formed") != std::string::npos;
  return a_leads ? std::pair{&a, &b} : std::pair{&b, &a};
}

// A worker that says where it runs, fails (exit 3) when it is rank 1 of
// round 1 and `fail` exists, and finishes once `stop` exists.
std::vector<std::string> two_node_worker(const std::string& stop, const std::string& fail) {
  return sh(
      "echo \"up rank $RANK round $DUCTILE_ROUND restarts "
      "$TORCHELASTIC_RESTART_COUNT\"; while [ ! -e " +
      stop + " ]; do if [ \"$DUCTILE_ROUND\" = 1 ] && [ \"$RANK\" = 1 ] && [ -e " + fail +
      " ]; then echo failing; exit 3; fi; sleep 0.1; done; "
      "echo \"finished round $DUCTILE_ROUND\"");
}

// The options of a job of exactly 2 nodes.
std::vector<std::string> two_node_options(const std::string& max_restarts) {
  return {"--nproc-per-node", "1",         "--lease-ttl", "2", "--settle",    "1",
          "--stop-grace",     "1",         "--min-nodes", "2", "--max-nodes", "2",
          "--max-restarts",   max_restarts};
}

// Agents a and b of a job of exactly 2 nodes, started and in round 1.
std::pair<Child*, Child*> two_nodes_in_round_1(Job& job, const std::vector<std::string>& worker,
                                               const std::string& max_restarts) {
  const auto options = two_node_options(max_restarts);
  Child& a = job.start("a", options, worker);
  Child& b = job.start("b", options, worker);
  bool formed =
      wait_until([&] { return count_of(job.all_output(), " round 1 restarts 0") == 2; }, 120s);
  if (!formed) job.dump();
  REQUIRE(formed);
  return leader_and_other(a, b);
}

}  // namespace

TEST_CASE("agent: malformed records are logged with their key and ignored - the job goes on") {
  Job job;
  EtcdStore store(job.etcd.endpoint());
  // A lease-less node key older than every agent's (it once made the agents
  // wait for it to lead, forever and without a word).
  store.put(kPrefix + "nodes/ghost", R"({"id":"ghost","addr":"127.0.0.1"})");
  // Age index entries no agent wrote: names that are not an entry's (the
  // revision past 64 bits), one without a lease, one whose record is not
  // JSON. None is counted as a node.
  const auto junk_lease = store.grant_lease(60);
  store.put(kPrefix + "ages/junk", "{}", junk_lease);
  store.put(kPrefix + "ages/99999999999999999999/x", "{}", junk_lease);
  store.put(kPrefix + "ages/00000000000000000001/ghost", R"({"id":"ghost","addr":"127.0.0.1"})");
  store.put(kPrefix + "ages/00000000000000000002/bad", "{not json", junk_lease);

  const std::string stop = (job.dir / "stop").string(), fail = (job.dir / "fail").string();
  auto [leader, other] = two_nodes_in_round_1(job, two_node_worker(stop, fail), "3");
  Child& a = *job.agents[0];
  Child& b = *job.agents[1];
  CHECK(a.output().find("ignoring " + kPrefix + "nodes/ghost (revision ") != std::string::npos);
  CHECK(a.output().find("): it has no lease, so no agent keeps it alive; not counted as a node") !=
        std::string::npos);
  for (Child* agent : {&a, &b}) {
    const std::string out = agent->output();
    for (const char* entry : {"junk", "99999999999999999999/x"})
      CHECK(out.find("ignoring " + kPrefix + "ages/" + entry + " (revision ") != std::string::npos);
    CHECK(count_of(out,
                   "): not an age index entry (ages/<create revision, 20 digits>/<node id>); "
                   "not counted as a node") == 2);
    CHECK(out.find("ignoring " + kPrefix + "ages/00000000000000000001/ghost (revision ") !=
          std::string::npos);
    CHECK(out.find("ignoring " + kPrefix + "ages/00000000000000000002/bad (revision ") !=
          std::string::npos);
  }
  store.revoke_lease(junk_lease);

  // The round record: not JSON, JSON of the wrong types, a world size this
  // job cannot have. Each is logged and replaced by the last valid round;
  // the workers go on.
  int restored = 0;
  for (const std::string& bad :
       {std::string("garbage"),
        std::string(R"({"round":"1","members":["a"],"master_addr":"h","master_port":1,)"
                    R"("world_size":1,"restarts":0,"started_ms":0,"state":"running"})"),
        std::string(R"({"round":1,"members":["a","b"],"master_addr":"h","master_port":1,)"
                    R"("world_size":4,"restarts":0,"started_ms":0,"state":"running"})")}) {
    store.put(kPrefix + "round", bad);
    ++restored;
    bool back =
        leader->wait_for_output("leader: restored round 1 in " + kPrefix + "round", 60s, restored);
    if (!back) job.dump();
    REQUIRE(back);
  }
  std::string out = leader->output();
  CHECK(out.find("ignoring " + kPrefix + "round (revision") != std::string::npos);
  CHECK(out.find("round record: not JSON: garbage") != std::string::npos);
  CHECK(out.find("round record: \"round\" is \"1\"; expected an integer") != std::string::npos);
  CHECK(out.find("round record: world size 4 is not its 2 member(s) x this job's 1 worker(s) "
                 "per node") != std::string::npos);

  // Node keys: garbage on a lease and a record whose id is not its key's
  // are not nodes; a node's own key overwritten keeps the node's last valid
  // record, and the node writes its record again. Nobody left.
  auto lease = store.grant_lease(60);
  store.put(kPrefix + "nodes/x", "{not json", lease);
  store.put(kPrefix + "nodes/y", R"({"id":"z","addr":"127.0.0.1"})", lease);
  for (Child* agent : {&a, &b}) {
    CHECK(agent->wait_for_output("ignoring " + kPrefix + "nodes/x", 60s));
    CHECK(agent->wait_for_output("ignoring " + kPrefix + "nodes/y", 60s));
  }
  CHECK(a.output().find("node record: not JSON: {not json; not counted as a node") !=
        std::string::npos);
  CHECK(a.output().find("node record: \"id\" is \"z\"; expected the id of its key, \"y\"") !=
        std::string::npos);
  const std::string other_key = kPrefix + "nodes/" + std::string(other == &a ? "a" : "b");
  store.put(other_key, "[]", lease);
  CHECK(other->wait_for_output("this node's registration " + other_key +
                                   " is gone or is not this agent's; registering again",
                               60s));
  CHECK(other->output().find("ignoring " + other_key) != std::string::npos);
  CHECK(other->output().find("node record: not a JSON object: []; the node's last valid record "
                             "stands") != std::string::npos);
  CHECK(wait_until([&] { return store.get(other_key)->lease != lease; }, 60s));

  // A failure record of round 1 that no agent wrote: not a failure.
  store.put(kPrefix + "failure/1", R"({"node":"b","exit_status":"x"})");
  CHECK(leader->wait_for_output("ignoring " + kPrefix + "failure/1", 60s));
  CHECK(leader->output().find("not counted as a failure") != std::string::npos);

  // Settings that are not a record: a new agent replaces them and joins (as
  // a standby: the job runs on at most 2 nodes).
  store.put(kPrefix + "settings", "42");
  Child& c = job.start("c", two_node_options("3"), two_node_worker(stop, fail));
  bool standby = c.wait_for_output("round 1: standby", 60s);
  if (!standby) job.dump();
  CHECK(standby);
  CHECK(c.output().find("ignoring " + kPrefix + "settings (revision ") != std::string::npos);
  CHECK(c.output().find("settings record: not a JSON object: 42; replaced by this agent's "
                        "settings") != std::string::npos);

  // Still round 1, every agent running, no worker restarted.
  out = job.all_output();
  CHECK(count_of(out, "\nup rank") == 2);
  CHECK(out.find("round 2") == std::string::npos);
  CHECK(out.find("internal error") == std::string::npos);
  for (Child* agent : {&a, &b, &c}) CHECK_FALSE(agent->poll().has_value());

  // A real failure now: the failing node's report takes the place of the
  // bad record, and the leader restarts the group.
  std::ofstream(fail) << "fail";
  bool restarted =
      wait_until([&] { return count_of(job.all_output(), " round 2 restarts 1") == 2; }, 120s);
  if (!restarted) job.dump();
  CHECK(restarted);
  CHECK(job.all_output().find("ignoring " + kPrefix + "failure/1") != std::string::npos);
  CHECK(job.all_output().find("replaced by this node's failure report") != std::string::npos);

  std::ofstream(stop) << "stop";
  for (Child* agent : {&a, &b, &c}) {
    auto status = agent->wait(60s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  CHECK(count_of(job.all_output(), "finished round 2") == 2);
  store.revoke_lease(lease);
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

TEST_CASE("agent: a second agent with a node id in use is refused - a restarted one waits") {
  Job job;
  const std::string stop = (job.dir / "stop").string();
  auto worker = sh("echo \"up round $DUCTILE_ROUND node $DUCTILE_AGENT_NODE_ID\"; while [ ! -e " +
                   stop + " ]; do sleep 0.1; done");
  std::vector<std::string> options = {"--nproc-per-node", "1", "--lease-ttl",  "2",
                                      "--settle",         "0", "--stop-grace", "1"};
  Child& first = job.start("a", options, worker);
  REQUIRE(first.wait_for_output("up round 1 node a", 60s));

  // Two agents with one id once both ran rank 0 of world size 1.
  Child& second = job.start("a", options, worker);
  auto status = second.wait(60s);
  if (status != std::optional<int>(2)) job.dump();
  CHECK(status == std::optional<int>(2));
  CHECK(second.output().find("--node-id 'a' is in use: another agent of job 'job' on etcd at " +
                             job.etcd.endpoint() +
                             " is registered under it (address 127.0.0.1) and keeps its lease "
                             "alive; give every agent its own --node-id") != std::string::npos);
  CHECK(count_of(job.all_output(), "up round") == 1);
  CHECK_FALSE(first.poll().has_value());

  // The same node restarted after a SIGKILL: its old registration is still
  // there until its lease expires; the new agent waits for that and runs,
  // in a round numbered after the killed run's (whose round still stood).
  first.signal(SIGKILL);
  first.wait(10s);
  Child& restarted = job.start("a", options, worker);
  bool up = restarted.wait_for_output("up round 2 node a", 60s);
  if (!up) job.dump();
  CHECK(up);
  CHECK(restarted.output().find("node id 'a' is registered by another lease") != std::string::npos);
  std::ofstream(stop) << "stop";
  CHECK(restarted.wait(60s) == std::optional<int>(0));
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}

TEST_CASE("agent: forged done and draining records are not believed - a failure still restarts") {
  Job job;
  EtcdStore store(job.etcd.endpoint());
  const std::string stop = (job.dir / "stop").string(), fail = (job.dir / "fail").string();
  auto [leader, other] = two_nodes_in_round_1(job, two_node_worker(stop, fail), "1");
  Child& a = *job.agents[0];
  Child& b = *job.agents[1];

  // Every member "done" while the workers run: garbage, a duplicate key, a
  // record of another node or round, a valid record on a lease that is not
  // the node's registration's, and one without a lease.
  const std::int64_t lease = store.grant_lease(60);
  const std::vector<std::tuple<std::string, std::string, std::int64_t, std::string>> forged = {
      {"done/1/a", "zzz", lease, "done record: not JSON: zzz"},
      {"done/1/b", R"({"node":"b","node":"b","round":1})", lease,
       "done record: the key \"node\" appears twice in one object"},
      {"done/1/a", R"({"node":"b","round":1})", lease,
       "done record: \"node\" is \"b\"; expected \"a\", the node of its key"},
      {"done/1/b", R"({"node":"b","round":2})", lease,
       "done record: \"round\" is 2; expected 1, the round of its key"},
      {"done/1/a", R"({"node":"a","round":1,"by":"x"})", lease,
       "done record: \"by\" is not a field of this record"},
      {"done/1/a", R"({"node":"a","round":1})", lease,
       "done record: it is not on the lease of node a's registration"},
      {"done/1/b", R"({"node":"b","round":1})", 0,
       "done record: it is not on the lease of node b's registration"},
      {"draining/b", R"({"node":"b"})", lease,
       "draining record: it is not on the lease of node b's registration"}};
  for (const auto& [name, value, on, problem] : forged) {
    store.put(kPrefix + name, value, on);
    bool logged = leader->wait_for_output(problem, 60s);
    if (!logged) job.dump();
    CHECK(logged);
  }
  CHECK(leader->output().find("ignoring " + kPrefix + "done/1/a (revision ") != std::string::npos);
  // Still round 1: no job end, no drain.
  std::string out = job.all_output();
  CHECK(out.find("job succeeded") == std::string::npos);
  CHECK(out.find("round 2") == std::string::npos);
  for (Child* agent : {&a, &b}) CHECK_FALSE(agent->poll().has_value());

  // The worker fails after all: a restart, as --max-restarts allows.
  store.revoke_lease(lease);
  std::ofstream(fail) << "fail";
  bool restarted =
      wait_until([&] { return count_of(job.all_output(), " round 2 restarts 1") == 2; }, 120s);
  if (!restarted) job.dump();
  CHECK(restarted);
  std::ofstream(stop) << "stop";
  for (Child* agent : {&a, &b}) {
    auto status = agent->wait(60s);
    if (status != std::optional<int>(0)) job.dump();
    CHECK(status == std::optional<int>(0));
  }
  if (!no_marked_processes(job.marker)) job.dump();
  CHECK(marked_processes(job.marker).empty());
}
