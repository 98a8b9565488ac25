// The live nodes' registrations and the round records, as this agent reads
// them from the rendezvous. See membership.hpp.
#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "membership.hpp"

namespace ductile::agent {

std::vector<NodeInfo> Membership::live_nodes(const std::vector<KeyValue>& kvs, bool* own_ok,
                                             bool every_key) {
  std::vector<NodeInfo> alive;
  std::map<std::string, NodeInfo> known;
  const std::string nodes = self_.key("nodes/");
  *own_ok = false;
  for (const auto& kv : kvs) {
    std::string id = kv.key.substr(nodes.size());
    if (kv.lease == 0) {
      conn_.ignore_record(kv, "it has no lease, so no agent keeps it alive",
                          "not counted as a node (a stale or hand-written key?)");
      continue;
    }
    // A record ignored at this revision already is not parsed again (junk
    // keys cost a lookup each, not a parse, on every pass).
    if (conn_.ignored(kv)) {
      auto it = known_nodes_.find(kv.key);
      if (it != known_nodes_.end() && it->second.create_revision == kv.create_revision) {
        alive.push_back(it->second);
        alive.back().lease = kv.lease;
        known[kv.key] = it->second;
      }
      continue;
    }
    try {
      alive.push_back(node_from_json(kv.value, id, kv.create_revision));
      alive.back().lease = kv.lease;
      known[kv.key] = alive.back();
      if (id == self_.id) *own_ok = kv.lease == conn_.lease() && alive.back().addr == self_.addr;
    } catch (const MalformedRecord& e) {
      // A key that held a node's valid record was overwritten (its create
      // revision is the same): the node stays as it was; else it is not one.
      auto it = known_nodes_.find(kv.key);
      bool was_valid = it != known_nodes_.end() && it->second.create_revision == kv.create_revision;
      conn_.ignore_record(
          kv, e.what(),
          was_valid ? "the node's last valid record stands" : "not counted as a node");
      if (was_valid) {
        alive.push_back(it->second);
        alive.back().lease = kv.lease;
        known[kv.key] = it->second;
      }
    }
  }
  conn_.report_ignored();
  if (every_key) {
    known_nodes_ = std::move(known);
  } else {
    // Some of the keys: what is known of the others stays.
    for (auto& [k, node] : known) known_nodes_[k] = std::move(node);
  }
  // By age; a static job's nodes by their node rank.
  std::sort(alive.begin(), alive.end(),
            [ranked = o_.node_rank >= 0](const NodeInfo& a, const NodeInfo& b) {
              if (ranked && a.rank != b.rank) return a.rank < b.rank;
              return a.create_revision < b.create_revision;
            });
  return alive;
}

std::vector<NodeInfo> Membership::oldest_by_age(const std::vector<KeyValue>& kvs) {
  std::vector<NodeInfo> oldest;
  const std::string ages = self_.key("ages/");
  constexpr std::size_t kDigits = 20;
  for (const auto& kv : kvs) {
    // ages/<create revision, 20 digits>/<id>
    const std::string name = kv.key.substr(std::min(ages.size(), kv.key.size()));
    std::int64_t revision = 0;
    const bool digits =
        name.size() > kDigits + 1 && name[kDigits] == '/' &&
        std::all_of(name.begin(), name.begin() + kDigits,
                    [](char c) { return c >= '0' && c <= '9'; }) &&
        std::from_chars(name.data(), name.data() + kDigits, revision).ec == std::errc{} &&
        revision > 0;
    if (!digits || kv.lease == 0) {
      if (!conn_.ignored(kv))
        conn_.ignore_record(kv,
                            !digits ? "not an age index entry (ages/<create revision, 20 digits>/"
                                      "<node id>)"
                                    : "it has no lease, so no agent keeps it alive",
                            "not counted as a node");
      continue;
    }
    NodeInfo node;
    node.id = name.substr(kDigits + 1);
    node.create_revision = revision;
    if (!kv.value.empty()) {
      if (conn_.ignored(kv)) continue;
      try {
        node = node_from_json(kv.value, node.id, node.create_revision);
      } catch (const MalformedRecord& e) {
        conn_.ignore_record(kv, e.what(), "not counted as a node");
        continue;
      }
    }
    node.lease = kv.lease;
    oldest.push_back(std::move(node));
  }
  conn_.report_ignored();
  return oldest;
}

bool Membership::own_registration_ok(const std::vector<KeyValue>& own) {
  if (own.size() != 1 || own.front().lease != conn_.lease()) return false;
  try {
    own_revision_ = own.front().create_revision;
    return node_from_json(own.front().value, self_.id, own.front().create_revision).addr ==
           self_.addr;
  } catch (const MalformedRecord& e) {
    conn_.ignore_record(own.front(), e.what(), "this agent writes its registration again");
    return false;
  }
}

bool Membership::previous_run(const RoundRecord& round, const KeyValue& kv) const {
  return round.state != RoundState::running && kv.mod_revision < first_revision_;
}

std::optional<RoundRecord> Membership::read_round(const std::optional<KeyValue>& kv) {
  if (!kv) return std::nullopt;
  try {
    if (kv->mod_revision == 0 || kv->mod_revision != parsed_round_revision_) {
      parsed_round_revision_ = 0;
      parsed_round_ = round_from_json(kv->value);
      check_round_fits(parsed_round_, o_.nproc_per_node, settings_.valid_gpus);
      parsed_round_revision_ = kv->mod_revision;
    }
    RoundRecord round = parsed_round_;
    highest_round_ = std::max(highest_round_, round.round);
    conn_.forget_ignored(kv->key);
    if (previous_run(round, *kv)) {
      // Whatever order this run's agents registered in, none of them takes
      // the old run's end for its own: the leader starts a new run.
      if (previous_run_logged_ != kv->mod_revision)
        self_.log(
            fmt::format("round {} of job '{}' {} before this agent registered: a previous run; "
                        "this is a new run",
                        round.round, o_.job_id, to_string(round.state)));
      previous_run_logged_ = kv->mod_revision;
      return std::nullopt;
    }
    last_good_round_ = round;
    return round;
  } catch (const MalformedRecord& e) {
    conn_.ignore_record(
        *kv, e.what(),
        "this node keeps its round; the leader replaces the record with the last valid "
        "one");
    return std::nullopt;
  }
}

}  // namespace ductile::agent
