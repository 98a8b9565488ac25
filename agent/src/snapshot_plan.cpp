// In-memory snapshots: the holdings records, read strictly, and the restore
// plan every member computes from them; see snapshot_plan.hpp.
#include "snapshot_plan.hpp"

#include <algorithm>
#include <charconv>
#include <optional>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "record_json.hpp"

namespace ductile::agent {
// Not an anonymous namespace: unity builds put several of the library's
// files into one translation unit, where their helpers' names would clash.
namespace snapshot_plan_detail {

using json = nlohmann::json;

constexpr const char* kManifest = "manifest.json";
constexpr const char* kManifestSha256 = "manifest.json.sha256";
constexpr const char* kManifestHmac = "manifest.json.hmac";

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string quoted(const json& value) {
  return excerpt(dump(value), 80);
}

// A decimal number without sign or leading zeros (as Python's str(int)
// writes it), from 0 to `high`; nullopt otherwise.
std::optional<std::int64_t> canonical_number(std::string_view digits, std::int64_t high) {
  if (digits.empty() || (digits.size() > 1 && digits.front() == '0')) return std::nullopt;
  std::int64_t value = 0;
  auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
  if (error != std::errc() || end != digits.data() + digits.size() || value < 0 || value > high)
    return std::nullopt;
  return value;
}

// The folder of the snapshot of step N.
std::string snapshot_tag(std::int64_t step) {
  return fmt::format("step{}", step);
}

// A folder name of the snapshot of `step`: "step<N>", or "step<N>.<k>" (the
// name a save gives a tag that exists already).
bool tag_of_step(const std::string& tag, std::int64_t step) {
  std::string plain = snapshot_tag(step);
  if (tag.rfind(plain, 0) != 0) return false;
  if (tag.size() == plain.size()) return true;
  return tag[plain.size()] == '.' &&
         canonical_number(std::string_view(tag).substr(plain.size() + 1), 999999999);
}

// A file name of a checkpoint written by `world` ranks: the manifest, its
// sidecars, or rank<r>-of-<world>.bin (0 <= r < world).
bool snapshot_file_valid(const std::string& name, std::int64_t world) {
  if (name == kManifest || name == kManifestSha256 || name == kManifestHmac) return true;
  std::string_view s(name);
  if (s.size() > kMaxSnapshotFileChars || s.rfind("rank", 0) != 0 || s.size() < 8 ||
      s.substr(s.size() - 4) != ".bin")
    return false;
  s = s.substr(4, s.size() - 8);
  auto of = s.find("-of-");
  if (of == std::string_view::npos) return false;
  auto rank = canonical_number(s.substr(0, of), kMaxCount);
  auto size = canonical_number(s.substr(of + 4), kMaxCount);
  return rank && size && *size == world && *rank < *size;
}

// The holdings record's fields, each error naming the record, the field
// (with its place: "own[0].files") and the bad value.
class HoldingsReader {
 public:
  explicit HoldingsReader(const std::string& text) {
    if (auto problem = parse_record_object(text, kMaxRecordBytes, root_); !problem.empty())
      fail(problem);
  }

  [[noreturn]] void fail(const std::string& problem) const {
    throw MalformedRecord(fmt::format("snapshots record: {}", problem));
  }
  [[noreturn]] void bad(const std::string& name, const json& value,
                        const std::string& expected) const {
    fail(fmt::format("\"{}\" is {}; expected {}", name, quoted(value), expected));
  }

  const json& root() const { return root_; }

  const json& require(const json& object, const std::string& place, const char* name) const {
    auto it = object.find(name);
    if (it == object.end()) fail(fmt::format("\"{}{}\" is missing", place, name));
    return *it;
  }

  void only(const json& object, const std::string& place,
            std::initializer_list<const char*> names) const {
    for (auto it = object.begin(); it != object.end(); ++it)
      if (std::none_of(names.begin(), names.end(), [&](const char* n) { return it.key() == n; }))
        fail(fmt::format("\"{}{}\" is not a field of this record", place, excerpt(it.key(), 80)));
  }

  std::int64_t integer(const json& v, const std::string& name, std::int64_t low,
                       std::int64_t high) const {
    auto expected = [&] { return fmt::format("an integer from {} to {}", low, high); };
    if (!v.is_number_integer()) bad(name, v, expected());
    if (v.is_number_unsigned()) {
      auto u = v.get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(high) || static_cast<std::int64_t>(u) < low)
        bad(name, v, expected());
      return static_cast<std::int64_t>(u);
    }
    auto i = v.get<std::int64_t>();
    if (i < low || i > high) bad(name, v, expected());
    return i;
  }

  std::string node_id(const json& v, const std::string& name) const {
    if (!v.is_string() || !valid_node_id(v.get<std::string>()))
      bad(name, v,
          fmt::format("a node id (1 to {} letters, digits, '.', '_', '-')", kMaxNodeIdChars));
    return v.get<std::string>();
  }

  // A host name or address: printable, no spaces, not empty.
  std::string address(const json& v, const std::string& name) const {
    auto expected =
        fmt::format("a host name or address of 1 to {} printable characters", kMaxAddrChars);
    if (!v.is_string()) bad(name, v, expected);
    const auto& s = v.get_ref<const std::string&>();
    bool printable = std::all_of(s.begin(), s.end(), [](char c) {
      return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f;
    });
    if (s.empty() || s.size() > kMaxAddrChars || !printable) bad(name, v, expected);
    return s;
  }

  SnapshotCopy copy(const json& v, const std::string& place) const {
    if (!v.is_object()) bad(place, v, "a snapshot (an object)");
    std::string at = place + ".";
    only(v, at, {"tag", "step", "world", "sha256", "files"});
    SnapshotCopy c;
    c.step = integer(require(v, at, "step"), at + "step", 0, kMaxRound);
    const json& tag = require(v, at, "tag");
    if (!tag.is_string() || !tag_of_step(tag.get_ref<const std::string&>(), c.step))
      bad(at + "tag", tag,
          fmt::format("\"{0}\" or \"{0}.<k>\", a folder of its step", snapshot_tag(c.step)));
    c.tag = tag.get<std::string>();
    c.world = integer(require(v, at, "world"), at + "world", 1, kMaxCount);
    const json& sha = require(v, at, "sha256");
    if (!sha.is_string() || sha.get_ref<const std::string&>().size() != 64 ||
        sha.get_ref<const std::string&>().find_first_not_of("0123456789abcdef") !=
            std::string::npos)
      bad(at + "sha256", sha, "a SHA-256 (64 lowercase hexadecimal digits)");
    c.sha256 = sha.get<std::string>();
    const json& files = require(v, at, "files");
    auto files_expected = fmt::format(
        "a sorted list of at most {} distinct file names of a checkpoint of world size {} "
        "(manifest.json, manifest.json.sha256, manifest.json.hmac, rank<r>-of-{}.bin)",
        kMaxSnapshotFiles, c.world, c.world);
    if (!files.is_array() || files.size() > kMaxSnapshotFiles)
      bad(at + "files", files, files_expected);
    for (const auto& f : files) {
      if (!f.is_string() || !snapshot_file_valid(f.get_ref<const std::string&>(), c.world))
        bad(at + "files", f, files_expected);
      if (!c.files.empty() && !(c.files.back() < f.get_ref<const std::string&>()))
        bad(at + "files", f,
            fmt::format("file names sorted and each once (it follows \"{}\")",
                        excerpt(c.files.back(), 80)));
      c.files.push_back(f.get<std::string>());
    }
    return c;
  }

  // A node's copies: at most kMaxSnapshotCopies, newest first, each tag once.
  std::vector<SnapshotCopy> copies(const json& v, const std::string& place) const {
    if (!v.is_array() || v.size() > kMaxSnapshotCopies)
      bad(place, v, fmt::format("a list of at most {} snapshots", kMaxSnapshotCopies));
    std::vector<SnapshotCopy> out;
    for (std::size_t i = 0; i < v.size(); ++i) {
      auto name = fmt::format("{}[{}]", place, i);
      out.push_back(copy(v[i], name));
      if (out.size() > 1 && out[out.size() - 2].step < out.back().step)
        bad(name + ".step", v[i]["step"],
            fmt::format("at most {}: the snapshots newest first", out[out.size() - 2].step));
      for (std::size_t j = 0; j + 1 < out.size(); ++j)
        if (out[j].tag == out.back().tag) bad(name + ".tag", v[i]["tag"], "each folder once");
    }
    return out;
  }

 private:
  json root_;
};

json copy_json(const SnapshotCopy& c) {
  return json{{"tag", c.tag},
              {"step", c.step},
              {"world", c.world},
              {"sha256", c.sha256},
              {"files", c.files}};
}

// A snapshot's identity: copies agree on all three or are different
// snapshots (the same tag written by two different runs, or a bad record).
using SnapshotKey = std::tuple<std::int64_t, std::string, std::int64_t>;  // step, sha256, world

SnapshotKey key_of(const SnapshotCopy& c) {
  return {c.step, c.sha256, c.world};
}

// One member's copy of a snapshot: its own (origin = the member) or a
// replica of `origin`.
struct Held {
  const Holdings* holder;
  std::string origin;
  bool own;
  const SnapshotCopy* copy;
};

bool lists(const SnapshotCopy& c, const std::string& file) {
  return std::binary_search(c.files.begin(), c.files.end(), file);
}

std::string path_of(const Held& h, const std::string& file) {
  if (h.own) return fmt::format("own/{}/{}", h.copy->tag, file);
  return fmt::format("replicas/{}/{}/{}", h.origin, h.copy->tag, file);
}

// Every copy of the records, grouped by snapshot, in a fixed order: the
// records' order, own copies before replicas within a record, replicas by
// node id.
std::map<SnapshotKey, std::vector<Held>> copies_by_snapshot(const std::vector<Holdings>& records) {
  std::map<SnapshotKey, std::vector<Held>> out;
  for (const auto& h : records) {
    for (const auto& c : h.own) out[key_of(c)].push_back({&h, h.node, true, &c});
    for (const auto& [node, list] : h.replicas)
      for (const auto& c : list) out[key_of(c)].push_back({&h, node, false, &c});
  }
  return out;
}

// The files a snapshot needs: the manifest, its checksum, its HMAC when any
// member's copy lists one, and every rank's shards.
std::vector<std::string> needed_files(std::int64_t world, const std::vector<Held>& copies) {
  std::vector<std::string> files = {kManifest, kManifestSha256};
  if (std::any_of(copies.begin(), copies.end(),
                  [](const Held& h) { return lists(*h.copy, kManifestHmac); }))
    files.emplace_back(kManifestHmac);
  for (std::int64_t r = 0; r < world; ++r)
    files.push_back(fmt::format("rank{}-of-{}.bin", r, world));
  return files;
}

// The first copy listing `file`: own copies before replicas, each in the
// members' order; nullptr when none does.
const Held* canonical_holder(const std::vector<Held>& copies, const std::string& file) {
  for (bool own : {true, false})
    for (const auto& h : copies)
      if (h.own == own && lists(*h.copy, file)) return &h;
  return nullptr;
}

// What `file` holds, for a message, and whether that is plural.
std::pair<std::string, bool> describe(const std::string& file) {
  if (file == kManifest) return {"the manifest", false};
  if (file == kManifestSha256) return {"the manifest's checksum", false};
  if (file == kManifestHmac) return {"the manifest's HMAC", false};
  // rank<r>-of-<W>.bin
  return {fmt::format("rank {}'s shards", file.substr(4, file.find("-of-") - 4)), true};
}

std::string join_nodes(const std::set<std::string>& nodes) {
  std::string out;
  std::size_t i = 0;
  for (const auto& n : nodes) {
    if (i > 0) out += i + 1 == nodes.size() ? " and " : ", ";
    out += n;
    ++i;
  }
  return out;
}

// The lost nodes whose last records list `file` of snapshot `key`.
std::set<std::string> lost_holders(const std::vector<Holdings>& lost, const SnapshotKey& key,
                                   const std::string& file) {
  std::set<std::string> out;
  for (const auto& h : lost) {
    auto holds = [&](const SnapshotCopy& c) { return key_of(c) == key && lists(c, file); };
    bool found = std::any_of(h.own.begin(), h.own.end(), holds);
    for (const auto& [node, list] : h.replicas)
      found = found || std::any_of(list.begin(), list.end(), holds);
    if (found) out.insert(h.node);
  }
  return out;
}

std::string held_only_by(const std::set<std::string>& nodes) {
  return fmt::format("held only by lost node{} {}", nodes.size() == 1 ? "" : "s",
                     join_nodes(nodes));
}

// Why no snapshot is complete: what the newest one the members hold part
// of lacks, or, when they hold none, where the newest one was.
std::string why_incomplete(const std::map<SnapshotKey, std::vector<Held>>& candidates,
                           const std::vector<Holdings>& lost) {
  if (candidates.empty()) {
    auto lost_copies = copies_by_snapshot(lost);
    if (lost_copies.empty()) return "no snapshot in memory";
    const auto& [key, copies] = *lost_copies.rbegin();
    std::set<std::string> nodes;
    for (const auto& h : copies) nodes.insert(h.holder->node);
    return fmt::format("step {} was {}; no member holds a snapshot", std::get<0>(key),
                       held_only_by(nodes));
  }
  const auto& [key, copies] =
      *std::max_element(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
        // Newest step first; the same order as the choice.
        return std::get<0>(a.first) != std::get<0>(b.first)
                   ? std::get<0>(a.first) < std::get<0>(b.first)
                   : a.first > b.first;
      });
  for (const auto& file : needed_files(std::get<2>(key), copies)) {
    if (canonical_holder(copies, file)) continue;
    auto [what, plural] = describe(file);
    auto nodes = lost_holders(lost, key, file);
    if (nodes.empty())
      return fmt::format("{} of step {} {} held by no member", what, std::get<0>(key),
                         plural ? "are" : "is");
    return fmt::format("{} of step {} {} {}", what, std::get<0>(key), plural ? "were" : "was",
                       held_only_by(nodes));
  }
  return "no snapshot in memory";  // unreachable: the newest one is incomplete
}

std::string holdings_json(const Holdings& holdings) {
  json own = json::array();
  for (const auto& c : holdings.own) own.push_back(copy_json(c));
  json replicas = json::object();
  for (const auto& [node, list] : holdings.replicas) {
    json copies = json::array();
    for (const auto& c : list) copies.push_back(copy_json(c));
    replicas[node] = std::move(copies);
  }
  return dump(json{{"node", holdings.node},
                   {"addr", holdings.addr},
                   {"port", holdings.port},
                   {"own", std::move(own)},
                   {"replicas", std::move(replicas)}});
}

Holdings read_holdings(const std::string& text, const std::string& key_node) {
  HoldingsReader r(text);
  const json& root = r.root();
  r.only(root, "", {"node", "addr", "port", "own", "replicas"});
  Holdings h;
  h.node = r.node_id(r.require(root, "", "node"), "node");
  if (h.node != key_node)
    r.bad("node", root["node"], fmt::format("\"{}\", the node of its key", excerpt(key_node)));
  h.addr = r.address(r.require(root, "", "addr"), "addr");
  h.port = static_cast<int>(r.integer(r.require(root, "", "port"), "port", 1, 65535));
  h.own = r.copies(r.require(root, "", "own"), "own");
  const json& replicas = r.require(root, "", "replicas");
  if (!replicas.is_object() || replicas.size() > kMaxReplicatedNodes)
    r.bad("replicas", replicas,
          fmt::format("an object of at most {} nodes' snapshots", kMaxReplicatedNodes));
  for (auto it = replicas.begin(); it != replicas.end(); ++it) {
    auto place = fmt::format("replicas.{}", excerpt(it.key(), 80));
    std::string node = r.node_id(json(it.key()), place);
    if (node == h.node)
      r.fail(fmt::format("\"{}\": a node holds no replica of its own snapshots", place));
    h.replicas[node] = r.copies(it.value(), place);
  }
  return h;
}

std::variant<RestorePlan, std::string> plan(const std::vector<Holdings>& members,
                                            const std::vector<Holdings>& lost,
                                            const std::string& self) {
  auto candidates = copies_by_snapshot(members);
  std::int64_t newest_seen = 0;
  for (const auto* records : {&members, &lost})
    for (const auto& [key, copies] : copies_by_snapshot(*records))
      newest_seen = std::max(newest_seen, std::get<0>(key));

  // Newest step first; for one step, the snapshots in (sha256, world)
  // order, so every member takes the same.
  std::vector<const std::pair<const SnapshotKey, std::vector<Held>>*> order;
  for (const auto& entry : candidates) order.push_back(&entry);
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return std::get<0>(a->first) > std::get<0>(b->first);
  });

  for (const auto* entry : order) {
    const auto& [key, copies] = *entry;
    auto files = needed_files(std::get<2>(key), copies);
    bool complete = std::all_of(files.begin(), files.end(), [&](const std::string& f) {
      return canonical_holder(copies, f) != nullptr;
    });
    if (!complete) continue;

    RestorePlan chosen;
    chosen.step = std::get<0>(key);
    chosen.sha256 = std::get<1>(key);
    chosen.world = std::get<2>(key);
    chosen.tag = snapshot_tag(chosen.step);
    chosen.newest_step_seen = std::max(newest_seen, chosen.step);
    std::set<std::string> own_origins;
    std::set<std::string> replica_origins;
    for (const auto& file : files) {
      const Held* canonical = canonical_holder(copies, file);
      // The counts come from the canonical holder, the same on every
      // member; only the source prefers this node.
      if (file.rfind("rank", 0) == 0)
        (canonical->own ? own_origins : replica_origins).insert(canonical->origin);
      const Held* source = canonical;
      for (bool own : {true, false}) {
        auto mine = std::find_if(copies.begin(), copies.end(), [&](const Held& h) {
          return h.own == own && h.holder->node == self && lists(*h.copy, file);
        });
        if (mine != copies.end() && source->holder->node != self) source = &*mine;
      }
      chosen.sources.push_back({file, source->holder->node, path_of(*source, file)});
    }
    for (const auto& node : own_origins) replica_origins.erase(node);
    chosen.own_nodes = static_cast<int>(own_origins.size());
    chosen.replica_nodes = static_cast<int>(replica_origins.size());
    std::sort(chosen.sources.begin(), chosen.sources.end(),
              [](const FileSource& a, const FileSource& b) { return a.file < b.file; });
    return chosen;
  }
  return why_incomplete(candidates, lost);
}

std::string message(std::int64_t round, const std::variant<RestorePlan, std::string>& outcome) {
  if (const auto* why = std::get_if<std::string>(&outcome))
    return fmt::format(
        "round {}: no complete snapshot in memory ({}); the workers resume from their disk "
        "checkpoint",
        round, *why);
  const auto& p = std::get<RestorePlan>(outcome);
  std::string replicas;
  if (p.replica_nodes > 0)
    replicas = fmt::format(", {} replica{}", p.replica_nodes, p.replica_nodes == 1 ? "" : "s");
  std::int64_t lost = std::max<std::int64_t>(0, p.newest_step_seen - p.step);
  return fmt::format(
      "round {}: restored step {} from memory: {} of {} nodes' own copies{}; {} step{} lost", round,
      p.step, p.own_nodes, p.own_nodes + p.replica_nodes, replicas, lost, lost == 1 ? "" : "s");
}

}  // namespace snapshot_plan_detail

std::string to_json(const Holdings& holdings) {
  return snapshot_plan_detail::holdings_json(holdings);
}

Holdings holdings_from_json(const std::string& text, const std::string& key_node) {
  return snapshot_plan_detail::read_holdings(text, key_node);
}

std::string to_json(const RoundHoldings& holdings) {
  std::string out = fmt::format("{{\"round\":{},\"members\":[", holdings.round);
  auto list = [&out](const std::vector<Holdings>& entries) {
    for (std::size_t i = 0; i < entries.size(); ++i) {
      if (i > 0) out.push_back(',');
      out.append(to_json(entries[i]));
    }
  };
  list(holdings.members);
  out.append("],\"lost\":[");
  list(holdings.lost);
  out.append("]}");
  return out;
}

RoundHoldings round_holdings_from_json(const std::string& text, std::int64_t round,
                                       const std::vector<std::string>& members) {
  if (text.size() > kMaxRoundHoldingsBytes)
    throw MalformedRecord(fmt::format("restore record: {} bytes, over the {} a record may have",
                                      text.size(), kMaxRoundHoldingsBytes));
  const nlohmann::json root = nlohmann::json::parse(text, nullptr, false);
  if (root.is_discarded() || !root.is_object() || root.size() != 3 || !root.contains("round") ||
      !root.contains("members") || !root.contains("lost"))
    throw MalformedRecord(
        "restore record: not a JSON object of \"round\", \"members\" and \"lost\"");
  if (!root["round"].is_number_integer() || root["round"].get<std::int64_t>() != round)
    throw MalformedRecord(fmt::format("restore record: \"round\" is {}, not {}",
                                      excerpt(root["round"].dump(), 40), round));
  const nlohmann::json& listed = root["members"];
  const nlohmann::json& lost = root["lost"];
  // No members' holdings: the round starts without a restore.
  if (!listed.is_array() || (!listed.empty() && listed.size() != members.size()))
    throw MalformedRecord(
        fmt::format("restore record: \"members\" is not a list of the round's {} members' holdings",
                    members.size()));
  if (!lost.is_array() || lost.size() > kMaxLostNodesListed)
    throw MalformedRecord(
        fmt::format("restore record: \"lost\" is not a list of at most {} nodes' holdings",
                    kMaxLostNodesListed));
  auto node_of = [](const nlohmann::json& entry) {
    auto it = entry.is_object() ? entry.find("node") : entry.end();
    if (it == entry.end() || !it->is_string())
      throw MalformedRecord("restore record: a holdings entry without its \"node\"");
    return it->get<std::string>();
  };
  RoundHoldings out;
  out.round = round;
  for (std::size_t i = 0; i < listed.size(); ++i) {
    if (node_of(listed[i]) != members[i])
      throw MalformedRecord(fmt::format("restore record: member {} is {}, not {}", i,
                                        excerpt(node_of(listed[i]), 80), members[i]));
    out.members.push_back(holdings_from_json(listed[i].dump(), members[i]));
  }
  for (const auto& entry : lost)
    out.lost.push_back(holdings_from_json(entry.dump(), node_of(entry)));
  return out;
}

std::variant<RestorePlan, std::string> plan_restore(const std::vector<Holdings>& members,
                                                    const std::vector<Holdings>& lost,
                                                    const std::string& self) {
  return snapshot_plan_detail::plan(members, lost, self);
}

std::string restore_message(std::int64_t round,
                            const std::variant<RestorePlan, std::string>& plan) {
  return snapshot_plan_detail::message(round, plan);
}

}  // namespace ductile::agent
