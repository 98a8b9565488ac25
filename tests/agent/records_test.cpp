// The rendezvous records: what an agent writes reads back the same, and a
// record no agent could have written is refused with MalformedRecord
// naming the field (never another exception).
#include <doctest/doctest.h>

#include "ductile/agent/records.hpp"

using namespace ductile::agent;

namespace {

RoundRecord two_nodes() {
  RoundRecord r;
  r.round = 4;
  r.members = {"a", "b"};
  r.member_revisions = {17, 23};
  r.world_size = 4;
  r.master_addr = "10.0.0.1";
  r.master_port = 29500;
  r.started_ms = 42;
  return r;
}

// round_from_json on `text`; the MalformedRecord's message, or "" when valid.
std::string round_problem(const std::string& text) {
  try {
    round_from_json(text);
    return "";
  } catch (const MalformedRecord& e) {
    return e.what();
  }
}

std::string failure_problem(const std::string& text) {
  try {
    failure_from_json(text);
    return "";
  } catch (const MalformedRecord& e) {
    return e.what();
  }
}

}  // namespace

TEST_CASE("records: a round, a failure and a node survive JSON") {
  RoundRecord r = two_nodes();
  r.state = RoundState::failed;
  r.failure = FailureReport{"b", 3, 1, 7, {"x", "y"}, "ValueError: no", "Traceback ..."};
  auto back = round_from_json(to_json(r));
  CHECK(back.members == r.members);
  CHECK(back.master_port == 29500);
  CHECK(back.state == RoundState::failed);
  REQUIRE(back.failure);
  CHECK(back.failure->last_lines == std::vector<std::string>{"x", "y"});
  CHECK(back.failure->error_message == "ValueError: no");
  CHECK(back.failure->error_traceback == "Traceback ...");
  CHECK(to_json(back) == to_json(r));

  auto node = node_from_json(to_json(NodeInfo{"n-1", "host.example", 0}), "n-1", 9);
  CHECK(node.addr == "host.example");
  CHECK(node.create_revision == 9);

  // A waiting round: no members, no master, world size 0.
  RoundRecord waiting;
  waiting.round = 2;
  CHECK(round_from_json(to_json(waiting)).members.empty());
}

TEST_CASE("records: malformed rounds name the field and the value") {
  CHECK(round_problem("not json").find("round record: not JSON: not json") == 0);
  CHECK(round_problem("[1]").find("not a JSON object") != std::string::npos);
  CHECK(round_problem("{\"round\": 1}").find("\"members\" is missing") != std::string::npos);
  auto with = [](const std::string& field, const std::string& value) {
    std::string text = to_json(two_nodes());
    auto at = text.find("\"" + field + "\":");
    REQUIRE(at != std::string::npos);
    auto from = at + field.size() + 3;
    auto end = from;
    int depth = 0;
    bool in_string = false;
    for (; end < text.size(); ++end) {
      char c = text[end];
      if (in_string) {
        if (c == '"') in_string = false;
        continue;
      }
      if (c == '"') in_string = true;
      if (c == '[' || c == '{') ++depth;
      if (c == ']' || c == '}') {
        if (depth == 0) break;
        --depth;
      }
      if (c == ',' && depth == 0) break;
    }
    return round_problem(text.substr(0, from) + value + text.substr(end));
  };
  CHECK(with("round", "\"x\"") ==
        "round record: \"round\" is \"x\"; expected an integer from 1 to "
        "9007199254740992");
  CHECK(with("round", "0").find("\"round\" is 0; expected an integer from 1") != std::string::npos);
  CHECK(with("round", "1.5").find("\"round\" is 1.5") != std::string::npos);
  CHECK(with("round", "9223372036854775807").find("\"round\" is") != std::string::npos);
  CHECK(with("round", "18446744073709551615").find("\"round\" is") != std::string::npos);
  CHECK(with("members", "[\"a\", \"a\"]").find("a is listed twice") != std::string::npos);
  CHECK(with("members", "[\"a/b\", \"c\"]").find("expected a node id") != std::string::npos);
  CHECK(with("members", "{}").find("\"members\" is {}") != std::string::npos);
  CHECK(with("member_revisions", "[1]").find("a list of 2 revisions, one per member") !=
        std::string::npos);
  CHECK(with("member_revisions", "[1, 0]").find("revisions from 1 to") != std::string::npos);
  CHECK(with("member_revisions", "[1, -4]").find("revisions from 1 to") != std::string::npos);
  CHECK(with("master_port", "0").find("expected an integer from 1 to 65535") != std::string::npos);
  CHECK(with("master_port", "70000").find("\"master_port\" is 70000") != std::string::npos);
  CHECK(with("master_addr", "\"\"").find("host name or address") != std::string::npos);
  CHECK(with("master_addr", "\"a b\"").find("host name or address") != std::string::npos);
  CHECK(with("world_size", "-2").find("\"world_size\" is -2") != std::string::npos);
  CHECK(with("world_size", "3").find("a multiple of the 2 member(s)") != std::string::npos);
  CHECK(with("started_ms", "-1").find("\"started_ms\" is -1") != std::string::npos);
  CHECK(with("restarts", "true").find("\"restarts\" is true") != std::string::npos);
  CHECK(with("state", "\"paused\"").find("\"running\", \"succeeded\" or \"failed\"") !=
        std::string::npos);
  CHECK(with("reason", "null").find("\"reason\" is null") != std::string::npos);
  // Too deep for the parser's recursion to be safe; too large for etcd.
  CHECK(round_problem(std::string(100000, '[')).find("nested deeper than") != std::string::npos);
  CHECK(round_problem("\"" + std::string(300000, 'x') + "\"").find("bytes, more than") !=
        std::string::npos);
  // Messages quote excerpts, never whole values.
  CHECK(with("reason", "[\"" + std::string(10000, 'r') + "\"]").size() < 300);
}

TEST_CASE("records: malformed failures and nodes, and a round that does not fit the job") {
  std::string good = to_json(FailureReport{"b", 3, 1, 7, {"x"}, "", ""});
  CHECK(failure_problem(good).empty());
  CHECK(failure_problem("{}").find("failure record: \"node\" is missing") == 0);
  CHECK(failure_problem(R"({"node":"b","rank":3,"local_rank":1,"exit_status":0,"last_lines":[]})")
            .find("\"exit_status\" is 0; expected an integer from 1 to 255") != std::string::npos);
  CHECK(failure_problem(R"({"node":"b","rank":3,"local_rank":1,"exit_status":256,"last_lines":[]})")
            .find("\"exit_status\" is 256") != std::string::npos);
  CHECK(failure_problem(R"({"node":"b","rank":3,"local_rank":1,"exit_status":1,"last_lines":[1]})")
            .find("\"last_lines\" is 1") != std::string::npos);
  std::string many = "[";
  for (int i = 0; i < 30; ++i) many += std::string(i ? "," : "") + "\"l\"";
  many += "]";
  CHECK(failure_problem(R"({"node":"b","rank":3,"local_rank":1,"exit_status":1,"last_lines":)" +
                        many + "}")
            .find("at most 20 strings") != std::string::npos);

  CHECK_THROWS_WITH_AS(node_from_json("{\"id\": 7, \"addr\": \"h\"}", "x", 1),
                       doctest::Contains("node record: \"id\" is 7"), MalformedRecord);
  CHECK_THROWS_WITH_AS(node_from_json("{\"id\": \"y\", \"addr\": \"h\"}", "x", 1),
                       doctest::Contains("expected the id of its key, \"x\""), MalformedRecord);
  CHECK_THROWS_AS(node_from_json("{\"id\": \"x\"}", "x", 1), MalformedRecord);
  CHECK_THROWS_AS(node_from_json("garbage", "x", 1), MalformedRecord);

  const std::vector<std::int64_t> valid = {1, 2, 3, 4, 6};
  RoundRecord r = two_nodes();
  CHECK_NOTHROW(check_round_fits(r, 2, valid));
  CHECK_THROWS_WITH_AS(check_round_fits(r, 1, valid),
                       doctest::Contains("world size 4 is not its 2 member(s) x this job's 1"),
                       MalformedRecord);
  r.members = {"a", "b", "c", "d"};
  r.world_size = 8;
  CHECK_THROWS_WITH_AS(check_round_fits(r, 2, valid),
                       doctest::Contains("world size 8 is not one of this job's valid GPU counts "
                                         "[1, 2, 3, 4, 6]"),
                       MalformedRecord);
}

TEST_CASE("records: settings differences, and settings that are not a record") {
  std::string mine =
      R"({"policy":"v0.1","params":{"max_gpus":6,"min_gpus":1},"nproc_per_node":2,"mpi_world":false})";
  CHECK(settings_differences(mine, mine).empty());
  auto d = settings_differences(
      R"({"policy":"v0.1","params":{"max_gpus":8,"extra":1},"nproc_per_node":2,"mpi_world":true})",
      mine);
  REQUIRE(d.size() == 4);
  CHECK(d[0] == "--mpi-world is true there, false here");
  CHECK(d[1] == "max_gpus is 8 there, 6 here");
  CHECK(d[2] == "min_gpus is null there, 1 here");
  CHECK(d[3] == "extra is 1 there, null here");
  CHECK_THROWS_WITH_AS(settings_differences("[]", mine), doctest::Contains("settings record"),
                       MalformedRecord);
  CHECK_THROWS_WITH_AS(settings_differences(R"({"policy": 3, "params": {}})", mine),
                       doctest::Contains("\"policy\" is 3"), MalformedRecord);
  CHECK_THROWS_AS(settings_differences(R"({"policy": "v0.1", "params": []})", mine),
                  MalformedRecord);
}

TEST_CASE("records: excerpts cut at a character boundary") {
  CHECK(excerpt("short") == "short");
  CHECK(excerpt(std::string(200, 'x'), 10) == std::string(10, 'x') + "...");
  // "é" is two bytes: a cut inside it backs up to its start.
  CHECK(excerpt("abcdefghi\xc3\xa9xyz", 10) == "abcdefghi...");
  CHECK(valid_node_id("node-1.a_b"));
  CHECK_FALSE(valid_node_id(""));
  CHECK_FALSE(valid_node_id("a b"));
  CHECK_FALSE(valid_node_id(std::string(129, 'a')));
}

TEST_CASE("records: a worker's TORCHELASTIC_ERROR_FILE, as torch writes it") {
  auto e = worker_error_from_json(
      R"({"message": {"message": "ValueError: boom", "extraInfo": {"py_callstack": )"
      R"("Traceback (most recent call last):\nValueError: boom\n", "timestamp": "17"}}})");
  CHECK(e.message == "ValueError: boom");
  CHECK(e.traceback == "Traceback (most recent call last):\nValueError: boom\n");
  e = worker_error_from_json(R"({"message": "RuntimeError: NCCL timeout", "timestamp": 17})");
  CHECK(e.message == "RuntimeError: NCCL timeout");
  CHECK(e.traceback.empty());
  // A long call stack keeps its end, where the error is.
  std::string stack = std::string(40000, 'f') + "\\nValueError: at the end";
  e = worker_error_from_json(
      R"({"message": {"message": "ValueError: at the end", "extraInfo": {"py_callstack": ")" +
      stack + R"("}}})");
  CHECK(e.traceback.size() <= kMaxTracebackChars);
  CHECK(e.traceback.starts_with("..."));
  CHECK(e.traceback.ends_with("ValueError: at the end"));
  CHECK_THROWS_WITH_AS(worker_error_from_json("{}"),
                       doctest::Contains("error file record: \"message\" is missing"),
                       MalformedRecord);
  CHECK_THROWS_AS(worker_error_from_json(R"({"message": 3})"), MalformedRecord);
  CHECK_THROWS_AS(worker_error_from_json(R"({"message": {"extraInfo": {}}})"), MalformedRecord);
}

TEST_CASE("records: a checkpoint request") {
  CheckpointRequest c{3, "n-1", "scale-up: 3 node(s) admitted of 3 present", 1764000000000};
  auto back = checkpoint_from_json(to_json(c), 3);
  CHECK(back.round == 3);
  CHECK(back.by == c.by);
  CHECK(back.reason == c.reason);
  CHECK(back.requested_ms == c.requested_ms);
  CHECK_THROWS_WITH_AS(checkpoint_from_json(to_json(c), 4),
                       "checkpoint record: \"round\" is 3; expected 4, the round of its key",
                       MalformedRecord);
  CHECK_THROWS_WITH_AS(checkpoint_from_json(R"({"round": 1, "by": "a b", "requested_ms": 1})", 1),
                       doctest::Contains("checkpoint record: \"by\" is \"a b\""), MalformedRecord);
  CHECK_THROWS_AS(checkpoint_from_json(R"({"round": 1, "by": "a", "requested_ms": -1})", 1),
                  MalformedRecord);
  CHECK_THROWS_WITH_AS(
      checkpoint_from_json(R"({"round": 1, "by": "a", "requested_ms": 1, "extra": 0})", 1),
      "checkpoint record: \"extra\" is not a field of this record", MalformedRecord);
  CHECK_THROWS_AS(checkpoint_from_json("[]", 1), MalformedRecord);
}

TEST_CASE("records: a key twice in one object is refused - at any depth") {
  RoundRecord r = two_nodes();
  std::string text = to_json(r);
  CHECK(round_problem(text).empty());
  // The same record with "round" twice (the last would win).
  std::string twice = "{\"round\":9," + text.substr(1);
  CHECK(round_problem(twice) == "round record: the key \"round\" appears twice in one object");
  r.state = RoundState::failed;
  r.failure = FailureReport{"a", 1, 1, 3, {"x"}, "", ""};
  text = to_json(r);
  auto at = text.find("\"node\":\"a\"");
  REQUIRE(at != std::string::npos);
  text.insert(at, "\"node\":\"b\",");
  CHECK(round_problem(text) == "round record: the key \"node\" appears twice in one object");
  // The same key in two objects is no duplicate.
  CHECK(failure_problem(R"({"node":"a","rank":0,"local_rank":0,"exit_status":1,)"
                        R"("last_lines":[],"error_message":"{\"node\":1}"})")
            .empty());
  CHECK_THROWS_WITH_AS(node_from_json(R"({"id":"a","addr":"h","addr":"g"})", "a", 1),
                       "node record: the key \"addr\" appears twice in one object",
                       MalformedRecord);
  CHECK_THROWS_WITH_AS(settings_differences(R"({"policy":"v0.1","policy":"v0.2","params":{}})",
                                            R"({"policy":"v0.1","params":{}})"),
                       doctest::Contains("appears twice"), MalformedRecord);
}

TEST_CASE("records: done, saved and draining marks are checked against their key") {
  CHECK(mark_json("n-1", 4) == R"({"node":"n-1","round":4})");
  CHECK(mark_json("n-1", 0) == R"({"node":"n-1"})");
  CHECK_NOTHROW(check_mark("done", mark_json("n-1", 4), "n-1", 4));
  CHECK_NOTHROW(check_mark("draining", mark_json("n-1", 0), "n-1", 0));
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"zzz", "done record: not JSON: zzz"},
      {"{}", "done record: \"round\" is missing"},
      {R"({"node":"n-1","round":"4"})", "done record: \"round\" is \"4\"; expected an integer"},
      {R"({"node":"n-2","round":4})", "done record: \"node\" is \"n-2\"; expected \"n-1\""},
      {R"({"node":"n-1","round":5})", "done record: \"round\" is 5; expected 4"},
      {R"({"node":"n-1","round":4,"x":1})", "done record: \"x\" is not a field"},
      {R"({"node":"n-1","round":4,"round":4})", "done record: the key \"round\" appears twice"},
      {"[]", "done record: not a JSON object"}};
  for (const auto& [text, problem] : bad) {
    INFO(text);
    CHECK_THROWS_WITH_AS(check_mark("done", text, "n-1", 4), doctest::Contains(problem.c_str()),
                         MalformedRecord);
  }
  CHECK_THROWS_WITH_AS(check_mark("draining", R"({"node":"n-1","round":1})", "n-1", 0),
                       doctest::Contains("\"round\" is not a field"), MalformedRecord);
}

TEST_CASE("records: a static node's rank") {
  NodeInfo n{"n-1", "10.0.0.2", 0, 3};
  CHECK(to_json(n) == R"({"addr":"10.0.0.2","id":"n-1","rank":3})");
  CHECK(node_from_json(to_json(n), "n-1", 7).rank == 3);
  CHECK(node_from_json(R"({"id":"n-1","addr":"h"})", "n-1", 7).rank == -1);
  CHECK_THROWS_WITH_AS(node_from_json(R"({"id":"n-1","addr":"h","rank":-2})", "n-1", 7),
                       doctest::Contains("\"rank\" is -2"), MalformedRecord);
  CHECK_THROWS_WITH_AS(node_from_json(R"({"id":"n-1","addr":"h","role":"x"})", "n-1", 7),
                       "node record: \"role\" is not a field of this record", MalformedRecord);
}

TEST_CASE("records: a node's snapshot port, the only one its snapshots are copied from") {
  NodeInfo n{"n-1", "10.0.0.2", 0};
  n.snapshot_port = 41000;
  CHECK(to_json(n) == R"({"addr":"10.0.0.2","id":"n-1","snapshot_port":41000})");
  CHECK(node_from_json(to_json(n), "n-1", 7).snapshot_port == 41000);
  CHECK(node_from_json(R"({"id":"n-1","addr":"h"})", "n-1", 7).snapshot_port == 0);
  for (const std::string bad : {"0", "65536", "\"41000\""}) {
    const std::string expected =
        "\"snapshot_port\" is " + bad + "; expected an integer from 1 to 65535";
    CHECK_THROWS_WITH_AS(
        node_from_json(R"({"id":"n-1","addr":"h","snapshot_port":)" + bad + "}", "n-1", 7),
        doctest::Contains(expected.c_str()), MalformedRecord);
  }
}
