// In-memory snapshots, the agents' shared view: a holdings record reads
// back as written, a record no agent could have written is refused naming
// the field, and every member computes the same restore plan from the same
// records.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "../../agent/src/snapshot_plan.hpp"

using namespace ductile::agent;

// Named, and holding the test cases too: unity builds put several test
// files into one translation unit, where helpers' names would clash.
namespace snapshot_plan_test {

using json = nlohmann::json;

// A snapshot's identity (its manifest's SHA-256), one per letter.
std::string sha(char letter) {
  return std::string(64, letter);
}

std::string rank_file(int rank, int world) {
  return "rank" + std::to_string(rank) + "-of-" + std::to_string(world) + ".bin";
}

// A committed copy of the snapshot of `step` (world `world`) holding the
// manifest, its checksum and the shards of `ranks`.
SnapshotCopy copy_of(std::int64_t step, char identity, int world, std::vector<int> ranks,
                     bool hmac = false) {
  SnapshotCopy c;
  c.tag = "step" + std::to_string(step);
  c.step = step;
  c.world = world;
  c.sha256 = sha(identity);
  c.files = {"manifest.json", "manifest.json.sha256"};
  if (hmac) c.files.push_back("manifest.json.hmac");
  for (int r : ranks) c.files.push_back(rank_file(r, world));
  std::sort(c.files.begin(), c.files.end());
  return c;
}

Holdings node(const std::string& id, std::vector<SnapshotCopy> own = {},
              std::map<std::string, std::vector<SnapshotCopy>> replicas = {}) {
  return Holdings{id, "10.0.0." + std::to_string(id.size()), 7000, std::move(own),
                  std::move(replicas)};
}

// Three nodes a, b, c, one worker each (rank i on the i-th), snapshot of
// step 41 (identity 'e'), each holding a replica of the node before it
// (snapshot_replicas 1: a holds c's, b holds a's, c holds b's).
std::vector<Holdings> ring_of_three() {
  auto own = [](int rank) { return copy_of(41, 'e', 3, {rank}); };
  return {node("a", {own(0)}, {{"c", {own(2)}}}), node("b", {own(1)}, {{"a", {own(0)}}}),
          node("c", {own(2)}, {{"b", {own(1)}}})};
}

Holdings sample() {
  Holdings h = node("n-1", {copy_of(41, 'e', 2, {0, 1}, true), copy_of(40, 'd', 2, {0})},
                    {{"n-2", {copy_of(41, 'e', 2, {1})}}, {"n-3", {}}});
  h.addr = "host.example";
  h.port = 41234;
  return h;
}

// holdings_from_json on `record` read from the key of node "n-1": the
// MalformedRecord's message, or "" when it is valid.
std::string problem(const json& record, const std::string& key = "n-1") {
  try {
    holdings_from_json(record.dump(), key);
    return "";
  } catch (const MalformedRecord& e) {
    return e.what();
  }
}

std::string problem_text(const std::string& text) {
  try {
    holdings_from_json(text, "n-1");
    return "";
  } catch (const MalformedRecord& e) {
    return e.what();
  }
}

RestorePlan plan_of(const std::variant<RestorePlan, std::string>& outcome) {
  if (const auto* why = std::get_if<std::string>(&outcome)) FAIL("no plan: " << *why);
  return std::get<RestorePlan>(outcome);
}

std::string why_of(const std::variant<RestorePlan, std::string>& outcome) {
  if (const auto* plan = std::get_if<RestorePlan>(&outcome))
    FAIL("a plan of step " << plan->step << " where none was expected");
  return std::get<std::string>(outcome);
}

const FileSource& source_of(const RestorePlan& plan, const std::string& file) {
  for (const auto& s : plan.sources)
    if (s.file == file) return s;
  FAIL("no source for " << file);
  return plan.sources.front();
}

TEST_CASE("snapshot holdings: a record reads back as written") {
  Holdings h = sample();
  std::string text = to_json(h);
  Holdings back = holdings_from_json(text, "n-1");
  CHECK(back.node == "n-1");
  CHECK(back.addr == "host.example");
  CHECK(back.port == 41234);
  REQUIRE(back.own.size() == 2);
  CHECK(back.own[0].tag == "step41");
  CHECK(back.own[0].step == 41);
  CHECK(back.own[0].world == 2);
  CHECK(back.own[0].sha256 == sha('e'));
  CHECK(back.own[0].files == std::vector<std::string>{"manifest.json", "manifest.json.hmac",
                                                      "manifest.json.sha256", "rank0-of-2.bin",
                                                      "rank1-of-2.bin"});
  REQUIRE(back.replicas.size() == 2);
  CHECK(back.replicas.at("n-2").size() == 1);
  CHECK(back.replicas.at("n-2")[0].files.back() == "rank1-of-2.bin");
  CHECK(back.replicas.at("n-3").empty());
  CHECK(to_json(back) == text);

  // A save's second folder of one step ("step41.1") and a node holding
  // nothing are records an agent writes.
  json j = json::parse(text);
  j["own"][0]["tag"] = "step41.1";
  CHECK(problem(j) == "");
  CHECK(holdings_from_json(to_json(node("n-1")), "n-1").own.empty());
}

TEST_CASE("round holdings: the gathered record reads back, and the plan from it is the same") {
  RoundHoldings gathered{7, ring_of_three(), {}};
  gathered.lost.push_back(gathered.members.back());
  gathered.members.pop_back();
  const std::string text = to_json(gathered);
  const RoundHoldings back = round_holdings_from_json(text, 7, {"a", "b"});
  CHECK(back.round == 7);
  REQUIRE(back.members.size() == 2);
  REQUIRE(back.lost.size() == 1);
  CHECK(to_json(back) == text);
  // Every member computes the plan of the one who gathered the records.
  for (const char* self : {"a", "b"}) {
    const auto mine = plan_of(plan_restore(back.members, back.lost, self));
    const auto theirs = plan_of(plan_restore(gathered.members, gathered.lost, self));
    CHECK(mine.step == theirs.step);
    CHECK(mine.sha256 == theirs.sha256);
    CHECK(mine.sources.size() == theirs.sources.size());
  }
  // No members' holdings: the round starts without a restore.
  CHECK(round_holdings_from_json(to_json(RoundHoldings{7, {}, {}}), 7, {"a", "b"}).members.empty());

  auto refused = [](const std::string& record, std::int64_t round,
                    const std::vector<std::string>& members) {
    try {
      round_holdings_from_json(record, round, members);
      return std::string();
    } catch (const MalformedRecord& e) {
      return std::string(e.what());
    }
  };
  CHECK(refused(text, 8, {"a", "b"}) == "restore record: \"round\" is 7, not 8");
  CHECK(refused(text, 7, {"b", "a"}) == "restore record: member 0 is a, not b");
  CHECK(refused(text, 7, {"a", "b", "c"}) ==
        "restore record: \"members\" is not a list of the round's 3 members' holdings");
  CHECK(refused("[]", 7, {"a"}) ==
        "restore record: not a JSON object of \"round\", \"members\" and \"lost\"");
  CHECK(refused(std::string(kMaxRoundHoldingsBytes + 1, ' '), 7, {"a"}).find("over the") !=
        std::string::npos);
  json bad = json::parse(text);
  bad["members"][1]["port"] = 0;
  CHECK(refused(bad.dump(), 7, {"a", "b"}).find("port") != std::string::npos);
}

TEST_CASE("snapshot holdings: a malformed record is refused, naming the field") {
  const json valid = json::parse(to_json(sample()));
  REQUIRE(problem(valid) == "");
  // `edit` applied to a copy of the valid record: the message names
  // `field` (and is a snapshots record's).
  auto refused = [&](const std::string& field, auto edit) {
    json j = valid;
    edit(j);
    std::string message = problem(j);
    INFO(field << ": " << message);
    CHECK(message.rfind("snapshots record: ", 0) == 0);
    CHECK(message.find("\"" + field + "\"") != std::string::npos);
  };

  SUBCASE("the text") {
    CHECK(problem_text("not json").find("snapshots record: not JSON") == 0);
    CHECK(problem_text("[1]").find("not a JSON object") != std::string::npos);
    CHECK(problem_text(R"({"node": "n-1", "node": "n-1"})").find("\"node\" appears twice") !=
          std::string::npos);
    CHECK(problem_text(std::string(20, '[') + std::string(20, ']')).find("nested deeper") !=
          std::string::npos);
    std::string huge = R"({"node": ")" + std::string(kMaxRecordBytes, 'a') + "\"}";
    CHECK(problem_text(huge).find("more than the 262144 an agent writes") != std::string::npos);
  }
  SUBCASE("the record's own fields") {
    refused("node", [](json& j) { j.erase("node"); });
    refused("node", [](json& j) { j["node"] = "bad/id"; });
    refused("node", [](json& j) { j["node"] = 7; });
    CHECK(problem(valid, "n-2").find("\"n-2\", the node of its key") != std::string::npos);
    refused("addr", [](json& j) { j.erase("addr"); });
    refused("addr", [](json& j) { j["addr"] = ""; });
    refused("addr", [](json& j) { j["addr"] = "a host"; });
    refused("addr", [](json& j) { j["addr"] = std::string(kMaxAddrChars + 1, 'h'); });
    refused("port", [](json& j) { j["port"] = 0; });
    refused("port", [](json& j) { j["port"] = 65536; });
    refused("port", [](json& j) { j["port"] = "7000"; });
    refused("extra", [](json& j) { j["extra"] = 1; });
    refused("own", [](json& j) { j["own"] = json::object(); });
    refused("own", [](json& j) {
      for (int i = 0; i < 3; ++i) j["own"].push_back(j["own"][1]);
    });
    refused("replicas", [](json& j) { j["replicas"] = json::array(); });
    refused("replicas", [](json& j) {
      j["replicas"] = json::object();
      for (std::size_t i = 0; i <= kMaxReplicatedNodes; ++i)
        j["replicas"]["m" + std::to_string(i)] = json::array();
    });
    refused("replicas.bad id", [](json& j) { j["replicas"]["bad id"] = json::array(); });
    refused("replicas.n-1", [](json& j) { j["replicas"]["n-1"] = json::array(); });
    refused("replicas.n-2", [](json& j) {
      for (int i = 0; i < 4; ++i) j["replicas"]["n-2"].push_back(j["replicas"]["n-2"][0]);
    });
  }
  SUBCASE("a snapshot's fields") {
    refused("own[0]", [](json& j) { j["own"][0] = "step41"; });
    refused("own[0].size", [](json& j) { j["own"][0]["size"] = 1; });
    refused("own[0].tag", [](json& j) { j["own"][0].erase("tag"); });
    refused("own[0].tag", [](json& j) { j["own"][0]["tag"] = "step7"; });
    refused("own[0].tag", [](json& j) { j["own"][0]["tag"] = "step041"; });
    refused("own[0].tag", [](json& j) { j["own"][0]["tag"] = "step41.tmp"; });
    refused("own[0].tag", [](json& j) { j["own"][0]["tag"] = "../step41"; });
    refused("own[0].step", [](json& j) { j["own"][0]["step"] = -1; });
    refused("own[0].step", [](json& j) { j["own"][0]["step"] = kMaxRound + 1; });
    refused("own[0].step", [](json& j) { j["own"][0]["step"] = 41.5; });
    refused("own[0].world", [](json& j) { j["own"][0]["world"] = 0; });
    refused("own[0].world", [](json& j) { j["own"][0]["world"] = kMaxCount + 1; });
    refused("own[0].sha256", [](json& j) { j["own"][0]["sha256"] = sha('E'); });
    refused("own[0].sha256", [](json& j) { j["own"][0]["sha256"] = sha('e').substr(1); });
    refused("own[0].sha256", [](json& j) { j["own"][0]["sha256"] = sha('g'); });
    refused("own[0].files", [](json& j) { j["own"][0]["files"] = "manifest.json"; });
    refused("own[0].files", [](json& j) { j["own"][0]["files"].push_back("rank2-of-2.bin"); });
    refused("own[0].files", [](json& j) { j["own"][0]["files"].push_back("rank5-of-9.bin"); });
    refused("own[0].files", [](json& j) { j["own"][0]["files"].push_back("rank01-of-2.bin"); });
    refused("own[0].files", [](json& j) { j["own"][0]["files"].push_back("zz.txt"); });
    refused("own[0].files", [](json& j) { j["own"][0]["files"].push_back("../rank1-of-2.bin"); });
    refused("own[0].files", [](json& j) { j["own"][0]["files"].push_back(7); });
    // Sorted, each once.
    refused("own[0].files", [](json& j) { j["own"][0]["files"].push_back("rank0-of-2.bin"); });
    refused("own[0].files",
            [](json& j) { std::swap(j["own"][0]["files"][0], j["own"][0]["files"][1]); });
    refused("own[0].files", [](json& j) {
      j["own"][0]["world"] = 5000;
      json files = json::array();
      for (int r = 0; r < static_cast<int>(kMaxSnapshotFiles) + 1; ++r)
        files.push_back(rank_file(r, 5000));
      std::sort(files.begin(), files.end());
      j["own"][0]["files"] = files;
    });
    // Newest first; a folder once.
    refused("own[1].step", [](json& j) { std::swap(j["own"][0], j["own"][1]); });
    refused("own[1].tag", [](json& j) { j["own"][1] = j["own"][0]; });
    refused("replicas.n-2[0].sha256", [](json& j) { j["replicas"]["n-2"][0]["sha256"] = "x"; });
  }
}

TEST_CASE("snapshot plan: every node survived, own copies only") {
  auto members = ring_of_three();
  auto outcome = plan_restore(members, {}, "b");
  const RestorePlan& plan = plan_of(outcome);
  CHECK(plan.tag == "step41");
  CHECK(plan.step == 41);
  CHECK(plan.sha256 == sha('e'));
  CHECK(plan.world == 3);
  CHECK(plan.own_nodes == 3);
  CHECK(plan.replica_nodes == 0);
  CHECK(plan.newest_step_seen == 41);
  REQUIRE(plan.sources.size() == 5);
  std::vector<std::string> files;
  for (const auto& s : plan.sources) files.push_back(s.file);
  CHECK(files == std::vector<std::string>{"manifest.json", "manifest.json.sha256", "rank0-of-3.bin",
                                          "rank1-of-3.bin", "rank2-of-3.bin"});
  // This node's own copy for what it holds, the owner's for the rest.
  CHECK(source_of(plan, "manifest.json").holder == "b");
  CHECK(source_of(plan, "manifest.json").path == "own/step41/manifest.json");
  CHECK(source_of(plan, "rank0-of-3.bin").holder == "b");
  CHECK(source_of(plan, "rank0-of-3.bin").path == "replicas/a/step41/rank0-of-3.bin");
  CHECK(source_of(plan, "rank1-of-3.bin").path == "own/step41/rank1-of-3.bin");
  CHECK(source_of(plan, "rank2-of-3.bin").holder == "c");
  CHECK(source_of(plan, "rank2-of-3.bin").path == "own/step41/rank2-of-3.bin");
  CHECK(restore_message(3, outcome) ==
        "round 3: restored step 41 from memory: 3 of 3 nodes' own copies; 0 steps lost");
}

TEST_CASE("snapshot plan: a lost node's shards come from its replica") {
  auto ring = ring_of_three();
  std::vector<Holdings> members = {ring[0], ring[1]};  // c is lost
  auto outcome = plan_restore(members, {ring[2]}, "b");
  const RestorePlan& plan = plan_of(outcome);
  CHECK(plan.step == 41);
  CHECK(plan.own_nodes == 2);
  CHECK(plan.replica_nodes == 1);
  CHECK(source_of(plan, "rank2-of-3.bin").holder == "a");
  CHECK(source_of(plan, "rank2-of-3.bin").path == "replicas/c/step41/rank2-of-3.bin");
  CHECK(restore_message(3, outcome) ==
        "round 3: restored step 41 from memory: 2 of 3 nodes' own copies, 1 replica; 0 steps "
        "lost");
}

TEST_CASE("snapshot plan: a surviving node whose copy lacks a file counts as own") {
  // a runs ranks 0 and 1, but its own copy lacks rank 1's shards, which
  // b's replica of a holds: a still counts as a node restored from its own
  // copy, once.
  std::vector<Holdings> members = {
      node("a", {copy_of(41, 'e', 4, {0})}),
      node("b", {copy_of(41, 'e', 4, {2, 3})}, {{"a", {copy_of(41, 'e', 4, {0, 1})}}})};
  auto outcome = plan_restore(members, {}, "a");
  const RestorePlan& plan = plan_of(outcome);
  CHECK(plan.own_nodes == 2);
  CHECK(plan.replica_nodes == 0);
  CHECK(source_of(plan, "rank0-of-4.bin").path == "own/step41/rank0-of-4.bin");
  CHECK(source_of(plan, "rank1-of-4.bin").holder == "b");
  CHECK(source_of(plan, "rank1-of-4.bin").path == "replicas/a/step41/rank1-of-4.bin");
  CHECK(restore_message(2, outcome) ==
        "round 2: restored step 41 from memory: 2 of 2 nodes' own copies; 0 steps lost");
}

TEST_CASE("snapshot plan: two lost neighbours with one replica each leave no plan") {
  // Four nodes, each holding a replica of the node before it; c and d are
  // lost: rank 2's shards were in c's own copy and d's replica only.
  auto own = [](int rank) { return copy_of(41, 'e', 4, {rank}); };
  std::vector<Holdings> members = {node("a", {own(0)}, {{"d", {own(3)}}}),
                                   node("b", {own(1)}, {{"a", {own(0)}}})};
  std::vector<Holdings> lost = {node("c", {own(2)}, {{"b", {own(1)}}}),
                                node("d", {own(3)}, {{"c", {own(2)}}})};
  auto outcome = plan_restore(members, lost, "a");
  CHECK(why_of(outcome) == "rank 2's shards of step 41 were held only by lost nodes c and d");
  CHECK(restore_message(3, outcome) ==
        "round 3: no complete snapshot in memory (rank 2's shards of step 41 were held only by "
        "lost nodes c and d); the workers resume from their disk checkpoint");

  // Without the lost nodes' records: held by no member.
  CHECK(why_of(plan_restore(members, {}, "a")) ==
        "rank 2's shards of step 41 are held by no member");
  // One lost node: named alone.
  lost[1].replicas.clear();
  CHECK(why_of(plan_restore(members, lost, "a")) ==
        "rank 2's shards of step 41 were held only by lost node c");
  // Nothing anywhere; only in lost nodes.
  CHECK(why_of(plan_restore({node("a"), node("b")}, {}, "a")) == "no snapshot in memory");
  CHECK(why_of(plan_restore({node("a"), node("b")}, lost, "a")) ==
        "step 41 was held only by lost nodes c and d; no member holds a snapshot");
}

TEST_CASE("snapshot plan: copies of one tag with different manifests are not mixed") {
  // Step 41 was written twice (two runs): a and c hold one, b the other.
  // Each has two of three ranks' shards: mixed, they would make a
  // complete-looking step 41. Step 40 is complete.
  auto node_copies = [](const std::string& id, int rank, char identity41) {
    return node(id, {copy_of(41, identity41, 3, {rank}), copy_of(40, 'd', 3, {rank})});
  };
  std::vector<Holdings> members = {node_copies("a", 0, 'e'), node_copies("b", 1, 'f'),
                                   node_copies("c", 2, 'e')};
  auto outcome = plan_restore(members, {}, "a");
  const RestorePlan& plan = plan_of(outcome);
  CHECK(plan.step == 40);
  CHECK(plan.sha256 == sha('d'));
  CHECK(plan.tag == "step40");
  CHECK(plan.newest_step_seen == 41);
  for (const auto& s : plan.sources) CHECK(s.path == "own/step40/" + s.file);
  CHECK(restore_message(5, outcome) ==
        "round 5: restored step 40 from memory: 3 of 3 nodes' own copies; 1 step lost");
}

TEST_CASE("snapshot plan: a newest incomplete snapshot falls back to the previous one") {
  // Step 42 reached a and b before c died; c's record (lost) shows 43.
  std::vector<Holdings> members = {node("a", {copy_of(42, 'f', 3, {0}), copy_of(41, 'e', 3, {0})},
                                        {{"c", {copy_of(41, 'e', 3, {2})}}}),
                                   node("b", {copy_of(42, 'f', 3, {1}), copy_of(41, 'e', 3, {1})})};
  std::vector<Holdings> lost = {node("c", {copy_of(43, 'a', 3, {2})})};
  auto outcome = plan_restore(members, lost, "b");
  const RestorePlan& plan = plan_of(outcome);
  CHECK(plan.step == 41);
  CHECK(plan.sha256 == sha('e'));
  CHECK(plan.newest_step_seen == 43);
  CHECK(plan.own_nodes == 2);
  CHECK(plan.replica_nodes == 1);
  CHECK(source_of(plan, "rank1-of-3.bin").path == "own/step41/rank1-of-3.bin");
  CHECK(source_of(plan, "rank0-of-3.bin").path == "own/step41/rank0-of-3.bin");
  CHECK(restore_message(7, outcome) ==
        "round 7: restored step 41 from memory: 2 of 3 nodes' own copies, 1 replica; 2 steps "
        "lost");
}

TEST_CASE("snapshot plan: an HMAC listed by one copy is required") {
  // a's copy (signed) lists manifest.json.hmac; b's does not.
  std::vector<Holdings> members = {node("a", {copy_of(41, 'e', 2, {0}, true)}),
                                   node("b", {copy_of(41, 'e', 2, {1})})};
  auto outcome = plan_restore(members, {}, "b");
  const RestorePlan& plan = plan_of(outcome);
  CHECK(source_of(plan, "manifest.json.hmac").holder == "a");
  CHECK(source_of(plan, "manifest.json.hmac").path == "own/step41/manifest.json.hmac");
  CHECK(plan.sources.size() == 5);

  // Unsigned (no copy lists an HMAC): none is fetched.
  members[0].own[0] = copy_of(41, 'e', 2, {0});
  const RestorePlan& unsigned_plan = plan_of(plan_restore(members, {}, "b"));
  CHECK(unsigned_plan.sources.size() == 4);
  for (const auto& s : unsigned_plan.sources) CHECK(s.file != "manifest.json.hmac");
}

TEST_CASE("snapshot plan: every member computes the same step and snapshot") {
  // Four nodes, two replicas each; b is lost. Every member, as `self`,
  // gets the same step, identity and counts; its sources prefer itself.
  auto own = [](int rank) { return copy_of(41, 'e', 4, {rank}); };
  std::vector<Holdings> members = {node("a", {own(0)}, {{"d", {own(3)}}, {"c", {own(2)}}}),
                                   node("c", {own(2)}, {{"b", {own(1)}}, {"a", {own(0)}}}),
                                   node("d", {own(3)}, {{"c", {own(2)}}, {"b", {own(1)}}})};
  // An older complete snapshot everywhere must not be chosen.
  for (auto& m : members) m.own.push_back(copy_of(40, 'd', 4, {0, 1, 2, 3}));
  std::vector<Holdings> lost = {node("b", {own(1)}, {{"a", {own(0)}}, {"d", {own(3)}}})};
  for (const auto& self : {"a", "c", "d"}) {
    INFO("self " << self);
    const RestorePlan& plan = plan_of(plan_restore(members, lost, self));
    CHECK(plan.step == 41);
    CHECK(plan.sha256 == sha('e'));
    CHECK(plan.own_nodes == 3);
    CHECK(plan.replica_nodes == 1);
    REQUIRE(plan.sources.size() == 6);
    for (const auto& s : plan.sources) {
      INFO(s.file);
      bool self_holds = false;
      for (const auto& m : members) {
        if (m.node != self) continue;
        for (const auto& c : m.own)
          self_holds |= c.step == 41 && std::count(c.files.begin(), c.files.end(), s.file) > 0;
        for (const auto& [of, list] : m.replicas)
          for (const auto& c : list)
            self_holds |= c.step == 41 && std::count(c.files.begin(), c.files.end(), s.file) > 0;
      }
      CHECK((s.holder == self) == self_holds);
    }
    // Rank 1 (the lost b's) from the first member holding a replica of it,
    // unless this node holds one.
    CHECK(source_of(plan, "rank1-of-4.bin").holder == (std::string(self) == "d" ? "d" : "c"));
    CHECK(source_of(plan, "rank1-of-4.bin").path == "replicas/b/step41/rank1-of-4.bin");
  }
  // Two complete snapshots of one step (two runs wrote it): the smaller
  // identity, for every member.
  for (auto& m : members) m.own.insert(m.own.begin() + 1, copy_of(41, 'a', 4, {0, 1, 2, 3}));
  for (const auto& self : {"a", "c", "d"})
    CHECK(plan_of(plan_restore(members, lost, self)).sha256 == sha('a'));
}

TEST_CASE("snapshot plan: the messages") {
  RestorePlan plan;
  plan.step = 41;
  plan.own_nodes = 1;
  plan.replica_nodes = 2;
  plan.newest_step_seen = 40;  // never a negative loss
  CHECK(restore_message(12, plan) ==
        "round 12: restored step 41 from memory: 1 of 3 nodes' own copies, 2 replicas; 0 steps "
        "lost");
  plan.own_nodes = 1;
  plan.replica_nodes = 0;
  plan.newest_step_seen = 44;
  CHECK(restore_message(1, plan) ==
        "round 1: restored step 41 from memory: 1 of 1 nodes' own copies; 3 steps lost");
  CHECK(restore_message(2, std::string("no snapshot in memory")) ==
        "round 2: no complete snapshot in memory (no snapshot in memory); the workers resume "
        "from their disk checkpoint");
}

}  // namespace snapshot_plan_test
