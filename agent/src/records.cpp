// The rendezvous records as JSON, read strictly; see records.hpp.
#include "ductile/agent/records.hpp"

#include <algorithm>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "record_json.hpp"

namespace ductile::agent {
namespace {

using json = nlohmann::json;

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string quoted(const json& value) {
  return excerpt(dump(value), 80);
}

// Reads one record's fields, naming the record in every error.
class Reader {
 public:
  Reader(const char* what, const std::string& text, std::size_t limit = kMaxRecordBytes)
      : what_(what) {
    if (auto problem = parse_record_object(text, limit, root_); !problem.empty()) fail(problem);
  }
  Reader(const char* what, json root) : what_(what), root_(std::move(root)) {
    if (!root_.is_object()) fail(fmt::format("not a JSON object: {}", quoted(root_)));
  }

  [[noreturn]] void fail(const std::string& problem) const {
    throw MalformedRecord(fmt::format("{} record: {}", what_, problem));
  }
  [[noreturn]] void bad(const char* name, const json& value, const std::string& expected) const {
    fail(fmt::format("\"{}\" is {}; expected {}", name, quoted(value), expected));
  }

  const json* find(const char* name) const {
    auto it = root_.find(name);
    return it == root_.end() ? nullptr : &*it;
  }
  const json& require(const char* name) const {
    const json* v = find(name);
    if (!v) fail(fmt::format("\"{}\" is missing", name));
    return *v;
  }

  std::int64_t integer(const char* name, std::int64_t low, std::int64_t high,
                       std::optional<std::int64_t> fallback = std::nullopt) const {
    const json* v = fallback ? find(name) : &require(name);
    if (!v) return *fallback;
    auto expected = [&] { return fmt::format("an integer from {} to {}", low, high); };
    // An unsigned value past `high` may not fit an int64_t.
    if (!v->is_number_integer() ||
        (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(high)))
      bad(name, *v, expected());
    auto i = v->get<std::int64_t>();
    if (i < low || i > high) bad(name, *v, expected());
    return i;
  }

  std::string text(const json& v, const char* name, std::size_t limit) const {
    if (!v.is_string() || v.get_ref<const std::string&>().size() > limit)
      bad(name, v, fmt::format("a string of at most {} bytes", limit));
    return v.get<std::string>();
  }
  std::string text(const char* name, std::size_t limit,
                   std::optional<std::string> fallback = std::nullopt) const {
    const json* v = fallback ? find(name) : &require(name);
    if (!v) return *fallback;
    return text(*v, name, limit);
  }

  std::string node_id(const json& v, const char* name) const {
    if (!v.is_string() || !valid_node_id(v.get<std::string>()))
      bad(name, v,
          fmt::format("a node id (1 to {} letters, digits, '.', '_', '-')", kMaxNodeIdChars));
    return v.get<std::string>();
  }

  // A host name or address: printable, no spaces, not empty.
  std::string address(const char* name, bool required) const {
    std::optional<std::string> fallback;
    if (!required) fallback = "";
    std::string s = text(name, kMaxAddrChars, fallback);
    bool printable = std::all_of(s.begin(), s.end(), [](char c) {
      return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f;
    });
    if ((required && s.empty()) || !printable)
      bad(name, require(name), "a host name or address (printable, no spaces)");
    return s;
  }

  const json& root() const { return root_; }

  // Refuses a field other than `names`.
  void only(std::initializer_list<const char*> names) const {
    for (auto it = root_.begin(); it != root_.end(); ++it)
      if (std::none_of(names.begin(), names.end(), [&](const char* n) { return it.key() == n; }))
        fail(fmt::format("\"{}\" is not a field of this record", excerpt(it.key(), 80)));
  }

 private:
  const char* what_;
  json root_;
};

constexpr std::pair<RoundState, const char*> kRoundStates[] = {{RoundState::running, "running"},
                                                               {RoundState::succeeded, "succeeded"},
                                                               {RoundState::failed, "failed"}};

json failure_json(const FailureReport& f) {
  json j = {{"node", f.node},
            {"rank", f.rank},
            {"local_rank", f.local_rank},
            {"exit_status", f.exit_status},
            {"last_lines", f.last_lines}};
  if (!f.error_message.empty()) j["error_message"] = f.error_message;
  if (!f.error_traceback.empty()) j["error_traceback"] = f.error_traceback;
  return j;
}

FailureReport failure_of(const Reader& r) {
  FailureReport f;
  f.node = r.node_id(r.require("node"), "node");
  f.rank = r.integer("rank", -1, kMaxCount);
  f.local_rank = r.integer("local_rank", -1, kMaxCount);
  f.exit_status = static_cast<int>(r.integer("exit_status", 1, 255));
  const json& lines = r.require("last_lines");
  if (!lines.is_array() || lines.size() > kMaxReportLines)
    r.bad("last_lines", lines, fmt::format("a list of at most {} strings", kMaxReportLines));
  for (const auto& line : lines) f.last_lines.push_back(r.text(line, "last_lines", kMaxTextChars));
  f.error_message = r.text("error_message", kMaxTextChars, "");
  f.error_traceback = r.text("error_traceback", kMaxTracebackChars, "");
  return f;
}

}  // namespace

bool valid_node_id(const std::string& id) {
  return !id.empty() && id.size() <= kMaxNodeIdChars &&
         id.find_first_not_of(
             "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
             "0123456789._-") == std::string::npos;
}

std::string excerpt(const std::string& text, std::size_t limit) {
  if (text.size() <= limit) return text;
  std::size_t cut = limit;
  // Not inside a UTF-8 sequence: back up over continuation bytes.
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return text.substr(0, cut) + "...";
}

const char* to_string(RoundState state) {
  for (auto [known, name] : kRoundStates)
    if (known == state) return name;
  return "running";
}

std::string to_json(const CheckpointRequest& c) {
  return dump(json{
      {"round", c.round}, {"by", c.by}, {"reason", c.reason}, {"requested_ms", c.requested_ms}});
}

CheckpointRequest checkpoint_from_json(const std::string& text, std::int64_t round) {
  Reader r("checkpoint", text);
  r.only({"round", "by", "reason", "requested_ms"});
  CheckpointRequest c{r.integer("round", 1, kMaxRound), r.node_id(r.require("by"), "by"),
                      r.text("reason", kMaxTextChars, ""), r.integer("requested_ms", 0, kMaxRound)};
  if (c.round != round)
    r.bad("round", r.require("round"), fmt::format("{}, the round of its key", round));
  return c;
}

std::string mark_json(const std::string& node, std::int64_t round) {
  json j = {{"node", node}};
  if (round > 0) j["round"] = round;
  return dump(j);
}

void check_mark(const char* what, const std::string& text, const std::string& node,
                std::int64_t round) {
  Reader r(what, text);
  if (round > 0) {
    r.only({"node", "round"});
    if (r.integer("round", 1, kMaxRound) != round)
      r.bad("round", r.require("round"), fmt::format("{}, the round of its key", round));
  } else {
    r.only({"node"});
  }
  if (r.node_id(r.require("node"), "node") != node)
    r.bad("node", r.require("node"), fmt::format("\"{}\", the node of its key", excerpt(node)));
}

std::string to_json(const RoundRecord& r) {
  json j = {{"round", r.round},
            {"members", r.members},
            {"member_revisions", r.member_revisions},
            {"master_addr", r.master_addr},
            {"master_port", r.master_port},
            {"mpi_server_uri", r.mpi_server_uri},
            {"mpi_join_port", r.mpi_join_port},
            {"world_size", r.world_size},
            {"restarts", r.restarts},
            {"started_ms", r.started_ms},
            {"reason", r.reason},
            {"state", to_string(r.state)}};
  if (r.snapshots_held) j["snapshots_held"] = true;
  if (r.failure) j["failure"] = failure_json(*r.failure);
  return dump(j);
}

RoundRecord round_from_json(const std::string& text) {
  Reader r("round", text);
  RoundRecord out;
  out.round = r.integer("round", 1, kMaxRound);
  const json& members = r.require("members");
  if (!members.is_array()) r.bad("members", members, "a list of node ids");
  std::set<std::string> seen;
  for (const auto& m : members) {
    out.members.push_back(r.node_id(m, "members"));
    if (!seen.insert(out.members.back()).second)
      r.bad("members", members, "each node once (" + out.members.back() + " is listed twice)");
  }
  if (const json* revisions = r.find("member_revisions")) {
    if (!revisions->is_array() || (!revisions->empty() && revisions->size() != out.members.size()))
      r.bad("member_revisions", *revisions,
            fmt::format("a list of {} revisions, one per member", out.members.size()));
    for (const auto& v : *revisions) {
      if (!v.is_number_unsigned() || v.get<std::uint64_t>() < 1 ||
          v.get<std::uint64_t>() > static_cast<std::uint64_t>(kMaxRound))
        r.bad("member_revisions", *revisions, fmt::format("revisions from 1 to {}", kMaxRound));
      out.member_revisions.push_back(v.get<std::int64_t>());
    }
  }
  bool waiting = out.members.empty();
  out.master_addr = r.address("master_addr", !waiting);
  out.master_port = static_cast<int>(r.integer("master_port", waiting ? 0 : 1, 65535));
  out.mpi_server_uri = r.text("mpi_server_uri", kMaxTextChars, "");
  out.mpi_join_port = static_cast<int>(r.integer("mpi_join_port", 0, 65535, 0));
  out.world_size = r.integer("world_size", 0, kMaxCount);
  out.restarts = r.integer("restarts", 0, kMaxCount);
  out.started_ms = r.integer("started_ms", 0, kMaxRound);
  out.reason = r.text("reason", kMaxTextChars, "");
  if (const json* held = r.find("snapshots_held")) {
    if (!held->is_boolean()) r.bad("snapshots_held", *held, "true or false");
    out.snapshots_held = held->get<bool>();
  }
  const json& state = r.require("state");
  auto known = std::find_if(std::begin(kRoundStates), std::end(kRoundStates),
                            [&](const auto& s) { return state == s.second; });
  if (known == std::end(kRoundStates))
    r.bad("state", state, "\"running\", \"succeeded\" or \"failed\"");
  out.state = known->first;
  if (const json* f = r.find("failure")) out.failure = failure_of(Reader("round's failure", *f));
  auto members_count = static_cast<std::int64_t>(out.members.size());
  if (waiting ? out.world_size != 0
              : out.world_size < members_count || out.world_size % members_count != 0)
    r.bad("world_size", r.require("world_size"),
          fmt::format("a multiple of the {} member(s) (0 for a round without members)",
                      members_count));
  return out;
}

std::string to_json(const FailureReport& report) {
  return dump(failure_json(report));
}

FailureReport failure_from_json(const std::string& text) {
  return failure_of(Reader("failure", text));
}

std::string to_json(const NodeInfo& node) {
  json j = {{"id", node.id}, {"addr", node.addr}};
  if (node.rank >= 0) j["rank"] = node.rank;
  if (node.snapshot_port > 0) j["snapshot_port"] = node.snapshot_port;
  if (node.link_port > 0) j["link_port"] = node.link_port;
  return dump(j);
}

NodeInfo node_from_json(const std::string& text, const std::string& key_id,
                        std::int64_t create_revision) {
  Reader r("node", text);
  r.only({"id", "addr", "rank", "snapshot_port", "link_port"});
  NodeInfo node{r.node_id(r.require("id"), "id"), r.address("addr", true), create_revision,
                r.integer("rank", 0, kMaxCount, -1)};
  node.snapshot_port = static_cast<int>(r.integer("snapshot_port", 1, 65535, 0));
  node.link_port = static_cast<int>(r.integer("link_port", 1, 65535, 0));
  if (node.id != key_id)
    r.bad("id", r.require("id"), fmt::format("the id of its key, \"{}\"", excerpt(key_id)));
  return node;
}

WorkerError worker_error_from_json(const std::string& text) {
  // The file is the worker's: bounded like a record, but a longer message
  // or call stack is cut rather than refused.
  Reader r("error file", text, kMaxErrorFileBytes);
  WorkerError out;
  const json& message = r.require("message");
  auto cut_front = [](std::string s, std::size_t limit) {
    if (s.size() <= limit) return s;
    std::size_t from = s.size() - limit;
    while (from < s.size() && (static_cast<unsigned char>(s[from]) & 0xC0) == 0x80) ++from;
    return "..." + s.substr(from);
  };
  if (message.is_string()) {
    out.message = excerpt(message.get<std::string>(), kMaxTextChars - 3);
  } else if (message.is_object()) {
    Reader m("error file's message", message);
    const json* inner = m.find("message");
    if (!inner || !inner->is_string()) m.bad("message", inner ? *inner : json(), "a string");
    out.message = excerpt(inner->get<std::string>(), kMaxTextChars - 3);
    if (const json* extra = m.find("extraInfo"); extra && extra->is_object()) {
      auto stack = extra->find("py_callstack");
      if (stack != extra->end() && stack->is_string())
        out.traceback = cut_front(stack->get<std::string>(), kMaxTracebackChars - 3);
    }
  } else {
    r.bad("message", message, "a string or an object with a \"message\" string");
  }
  return out;
}

void check_round_fits(const RoundRecord& record, std::int64_t nproc_per_node,
                      const std::vector<std::int64_t>& valid_gpus) {
  auto members = static_cast<std::int64_t>(record.members.size());
  if (record.world_size != members * nproc_per_node)
    throw MalformedRecord(fmt::format(
        "round record: world size {} is not its {} member(s) x this job's {} worker(s) per node",
        record.world_size, members, nproc_per_node));
  if (members > 0 && !std::binary_search(valid_gpus.begin(), valid_gpus.end(), record.world_size))
    throw MalformedRecord(
        fmt::format("round record: world size {} is not one of this job's valid GPU counts [{}]",
                    record.world_size, fmt::join(valid_gpus, ", ")));
}

std::vector<std::string> settings_differences(const std::string& theirs_text,
                                              const std::string& mine_text) {
  Reader theirs("settings", theirs_text);
  json mine = json::parse(mine_text);
  const json* policy = theirs.find("policy");
  const json* params = theirs.find("params");
  if (!policy || !policy->is_string())
    theirs.bad("policy", policy ? *policy : json(), "the policy's name");
  if (!params || !params->is_object()) theirs.bad("params", params ? *params : json(), "an object");
  std::vector<std::string> differences;
  auto compare = [&](const std::string& name, const json& a, const json& b) {
    if (a != b)
      differences.push_back(
          fmt::format("{} is {} there, {} here", excerpt(name, 80), quoted(a), quoted(b)));
  };
  const json& t = theirs.root();
  compare("policy", *policy, mine["policy"]);
  compare("nproc_per_node", t.value("nproc_per_node", json()), mine["nproc_per_node"]);
  compare("--mpi-world", t.value("mpi_world", json(false)), mine["mpi_world"]);
  compare("--node-rank (a static rendezvous)", t.value("node_ranked", json(false)),
          mine.value("node_ranked", json(false)));
  const json& mp = mine["params"];
  for (auto it = mp.begin(); it != mp.end(); ++it)
    compare(it.key(), params->contains(it.key()) ? (*params)[it.key()] : json(), it.value());
  for (auto it = params->begin(); it != params->end(); ++it)
    if (!mp.contains(it.key())) compare(it.key(), it.value(), json());
  return differences;
}

}  // namespace ductile::agent
