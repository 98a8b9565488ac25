// The leader's decisions and the rendezvous records, without a store.
#include <doctest/doctest.h>

#include <algorithm>

#include "ductile/agent/rendezvous.hpp"

using namespace ductile::agent;
using std::chrono::milliseconds;

namespace {

// Valid GPU counts of max_train_batch_size 24, micro batches {1, 2, 3},
// max_gpus 6 under DeepSpeed's v0.1 policy.
const std::vector<std::int64_t> kValid = {1, 2, 3, 4, 6};

RendezvousSettings settings() {
  RendezvousSettings s;
  s.valid_gpus = kValid;
  s.nproc_per_node = 2;
  s.min_nodes = 1;
  s.max_nodes = 3;
  s.max_restarts = 1;
  s.min_time = milliseconds(10000);
  s.settle = milliseconds(1000);
  s.failure_grace = milliseconds(2000);
  return s;
}

std::vector<NodeInfo> nodes(int n) {
  std::vector<NodeInfo> out;
  for (int i = 0; i < n; ++i) {
    std::string id = "n";
    id += std::to_string(i);
    out.push_back({id, "127.0.0.1", 10 + i});
  }
  return out;
}

RoundRecord running(std::vector<std::string> members, std::int64_t started_ms) {
  RoundRecord r;
  r.round = 4;
  r.members = std::move(members);
  r.world_size = static_cast<std::int64_t>(r.members.size()) * 2;
  r.started_ms = started_ms;
  return r;
}

}  // namespace

TEST_CASE("admitted_nodes: the largest node count whose world size the policy accepts") {
  CHECK(admitted_nodes(kValid, 2, 1, 3, 3) == 3);    // 6 GPUs
  CHECK(admitted_nodes(kValid, 2, 1, 3, 5) == 3);    // capped by max_nodes
  CHECK(admitted_nodes(kValid, 2, 1, 10, 4) == 3);   // 8 GPUs is not valid: 3 nodes
  CHECK(admitted_nodes(kValid, 5, 1, 10, 10) == 0);  // no multiple of 5 is valid
  CHECK(admitted_nodes(kValid, 1, 1, 10, 5) == 4);   // 5 GPUs invalid, 4 valid
  CHECK(admitted_nodes(kValid, 2, 2, 3, 1) == 0);    // fewer than min_nodes present
}

TEST_CASE("decide: a first round waits for quiet then takes the oldest valid count") {
  Observation seen;
  seen.alive = nodes(4);
  seen.now = milliseconds(5000);
  seen.last_membership_change = milliseconds(4500);
  auto s = settings();
  s.max_nodes = 10;
  CHECK(decide(seen, s).action == Action::keep);  // not settled
  seen.last_membership_change = milliseconds(3000);
  auto d = decide(seen, s);
  REQUIRE(d.action == Action::new_round);
  REQUIRE(d.members.size() == 3);  // 4 nodes = 8 GPUs is not valid
  CHECK(d.members.front().id == "n0");
  CHECK(d.members.back().id == "n2");
}

TEST_CASE("decide: a lost member re-forms at once without counting a restart") {
  Observation seen;
  seen.alive = nodes(3);
  seen.alive.erase(seen.alive.begin() + 1);
  seen.round = running({"n0", "n1", "n2"}, 0);
  seen.now = milliseconds(100);
  seen.last_membership_change = milliseconds(100);
  seen.failure = FailureReport{"n0", 0, 0, 1, {}, "", ""};  // a peer of the lost node failed
  seen.failure_seen = milliseconds(100);
  auto d = decide(seen, settings());
  REQUIRE(d.action == Action::new_round);
  CHECK_FALSE(d.counts_as_restart);
  REQUIRE(d.members.size() == 2);
  CHECK(d.members[1].id == "n2");
}

TEST_CASE("decide: a failure waits failure_grace then restarts or fails the job") {
  Observation seen;
  seen.alive = nodes(2);
  seen.round = running({"n0", "n1"}, 0);
  seen.failure = FailureReport{"n1", 3, 1, 1, {"boom"}, "", ""};
  seen.failure_seen = milliseconds(1000);
  seen.now = milliseconds(2500);
  CHECK(decide(seen, settings()).action == Action::keep);
  seen.now = milliseconds(3000);
  auto d = decide(seen, settings());
  CHECK(d.action == Action::new_round);
  CHECK(d.counts_as_restart);
  seen.round->restarts = 1;  // max_restarts spent
  CHECK(decide(seen, settings()).action == Action::fail);
}

TEST_CASE("decide: scale-up only after min_time and only to a valid size") {
  Observation seen;
  seen.alive = nodes(3);
  seen.round = running({"n0", "n1"}, 1000);
  seen.last_membership_change = milliseconds(0);
  seen.now = milliseconds(10999);
  CHECK(decide(seen, settings()).action == Action::keep);
  seen.now = milliseconds(11000);
  auto d = decide(seen, settings());
  CHECK(d.action == Action::new_round);
  CHECK(d.members.size() == 3);
  // Three members running: a fourth node would make 8 GPUs, not valid.
  seen.alive = nodes(4);
  seen.round = running({"n0", "n1", "n2"}, 0);
  seen.now = milliseconds(100000);
  CHECK(decide(seen, settings()).action == Action::keep);
}

TEST_CASE("decide: too few nodes wait - all members done ends the job") {
  auto s = settings();
  s.min_nodes = 2;
  Observation seen;
  seen.alive = nodes(1);
  seen.round = running({"n0", "n1"}, 0);
  auto d = decide(seen, s);
  CHECK(d.action == Action::new_round);
  CHECK(d.members.empty());
  seen.alive = nodes(2);
  seen.all_done = true;
  CHECK(decide(seen, s).action == Action::succeed);
}

TEST_CASE("decide: a member that registered again (another create revision) has left") {
  Observation seen;
  seen.alive = nodes(3);
  seen.round = running({"n0", "n1", "n2"}, 0);
  seen.round->member_revisions = {10, 11, 12};
  seen.now = milliseconds(100);
  seen.last_membership_change = milliseconds(100);
  auto s = settings();
  CHECK(decide(seen, s).action == Action::keep);
  // n1 was fenced and registered anew: its workers are gone.
  seen.alive[1].create_revision = 40;
  std::sort(seen.alive.begin(), seen.alive.end(), [](const NodeInfo& a, const NodeInfo& b) {
    return a.create_revision < b.create_revision;
  });
  auto d = decide(seen, s);
  REQUIRE(d.action == Action::new_round);
  CHECK(d.reason == "node(s) n1 left");
  CHECK_FALSE(d.counts_as_restart);
  REQUIRE(d.members.size() == 3);  // n1 is back in the new round, as a new node
  CHECK(d.members.back().id == "n1");
  // Records of older agents carry no revisions: members are matched by id.
  seen.round->member_revisions.clear();
  CHECK(decide(seen, s).action == Action::keep);
}

TEST_CASE("decide: a planned re-form asks for a checkpoint and waits for every member to save") {
  auto s = settings();
  s.min_time = milliseconds(0);
  s.checkpoint_timeout = milliseconds(30000);
  Observation seen;
  seen.alive = nodes(3);
  seen.round = running({"n0", "n1"}, 0);
  seen.now = milliseconds(50000);
  seen.last_membership_change = milliseconds(1000);
  // A scale-up: first the request.
  auto d = decide(seen, s);
  REQUIRE(d.action == Action::request_checkpoint);
  CHECK(d.reason == "scale-up: 3 node(s) admitted of 3 present");
  // Asked: nothing until every member saved...
  seen.checkpoint = CheckpointRequest{1, "n0", d.reason, 50000};
  seen.saved = {"n0"};
  CHECK(decide(seen, s).action == Action::keep);
  seen.saved = {"n1", "n0"};
  d = decide(seen, s);
  REQUIRE(d.action == Action::new_round);
  CHECK(d.members.size() == 3);
  CHECK(d.reason == "scale-up: 3 node(s) admitted of 3 present; every member's workers saved");
  CHECK_FALSE(d.counts_as_restart);
  // ... or until the timeout.
  seen.saved = {"n0"};
  seen.now = milliseconds(80000);
  d = decide(seen, s);
  REQUIRE(d.action == Action::new_round);
  CHECK(d.reason.find("checkpoint timeout (30000 ms): node(s) n1 did not save") !=
        std::string::npos);
  // A member lost meanwhile: at once, as any loss.
  seen.now = milliseconds(60000);
  seen.alive.erase(seen.alive.begin() + 1);
  d = decide(seen, s);
  REQUIRE(d.action == Action::new_round);
  CHECK(d.reason == "node(s) n1 left");
}

TEST_CASE("decide: a draining member is checkpointed, then left out") {
  auto s = settings();
  s.checkpoint_timeout = milliseconds(30000);
  Observation seen;
  seen.alive = nodes(3);
  seen.round = running({"n0", "n1", "n2"}, 0);
  seen.now = milliseconds(5000);
  seen.last_membership_change = milliseconds(1000);
  seen.draining = {"n1"};
  auto d = decide(seen, s);
  REQUIRE(d.action == Action::request_checkpoint);
  CHECK(d.reason == "node(s) n1 drain");
  seen.checkpoint = CheckpointRequest{1, "n1", "node n1 drains (signal 15)", 5000};
  seen.saved = {"n0", "n1", "n2"};
  d = decide(seen, s);
  REQUIRE(d.action == Action::new_round);
  REQUIRE(d.members.size() == 2);
  CHECK(d.members[0].id == "n0");
  CHECK(d.members[1].id == "n2");
  // Without checkpoints: the drained member is left out at once.
  s.checkpoint_timeout = milliseconds(0);
  seen.checkpoint.reset();
  d = decide(seen, s);
  REQUIRE(d.action == Action::new_round);
  CHECK(d.members.size() == 2);
}
