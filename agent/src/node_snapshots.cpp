// In-memory snapshots, on this node's side. See node_snapshots.hpp.
#include "node_snapshots.hpp"

#include <poll.h>

#include <algorithm>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ductile/error.hpp"

namespace ductile::agent {

// Not an anonymous namespace: a unity build puts several of the library's
// files into one translation unit, where their helpers' names would clash.
namespace node_snapshots_detail {

using std::chrono::milliseconds;

// The longest wait for a copy in flight when the replication is frozen,
// and for no progress of a restore's copy.
constexpr milliseconds kFreezeWait{10000};
constexpr milliseconds kRestoreCopyTimeout{30000};

// How long the members wait for each other's holdings, and for the
// gatherer's record: max(10 s, 4 x --lease-ttl).
milliseconds holdings_patience(const AgentOptions& o) {
  return std::max<milliseconds>(milliseconds(10000), 4 * milliseconds(o.lease_ttl));
}

// The last records of nodes gone kept at most (a job's nodes).
constexpr std::size_t kMaxNodesRemembered = 4096;

bool holds_any(const Holdings& h) {
  return !h.own.empty() || std::any_of(h.replicas.begin(), h.replicas.end(),
                                       [](const auto& entry) { return !entry.second.empty(); });
}

}  // namespace node_snapshots_detail

using namespace node_snapshots_detail;

void NodeSnapshots::make_area() {
  key_ = core::checkpoint_key_from_environment();
  bounds_.worlds = job_world_sizes(settings_.valid_gpus, settings_.nproc_per_node,
                                   settings_.min_nodes, settings_.max_nodes);
  area_ = std::make_unique<SnapshotArea>(o_.snapshot_dir, o_.job_id, self_.id);
  std::vector<std::string> removed;
  for (const auto& path : area_->removed_stale()) removed.push_back(path.string());
  if (!removed.empty())
    self_.log(fmt::format("removed the snapshot area(s) of agents no longer running: {}",
                          fmt::join(removed, ", ")));
  if (!area_->stale_search_complete())
    self_.log(fmt::format(
        "the search of {} for the snapshot areas of agents no longer running stopped at its bound "
        "({} areas, {} entries): remove the ductile-snapshots-* folders no agent uses",
        area_->root().parent_path().string(), kMaxSnapshotAreasSearched, kMaxSnapshotBaseEntries));
  workers_.set_snapshot_dir(area_->own());
}

void NodeSnapshots::serve() {
  // A job of one node has nobody to copy its snapshots to or from: nothing
  // is served, so no other user of the host can read them over loopback.
  if (!area_ || o_.rendezvous == RendezvousKind::embedded || o_.max_nodes == 1) return;
  replication_ = std::make_unique<SnapshotReplication>(*area_, self_, conn_.snapshot_auth(),
                                                       std::chrono::seconds(30),
                                                       std::chrono::milliseconds(15), key_);
  server_ = std::make_unique<SnapshotServer>(
      area_->root(), self_.addr, conn_.snapshot_auth(),
      [replication = replication_.get()](const SnapshotMessage& message) {
        return replication->on_message(message);
      });
}

void NodeSnapshots::close() {
  // The server first: its connections hand messages to the replication.
  server_.reset();
  replication_.reset();
  area_.reset();
}

void NodeSnapshots::discard() {
  if (area_) area_->remove();
}

Holdings NodeSnapshots::current_holdings() const {
  Holdings h;
  h.node = self_.id;
  h.addr = self_.addr;
  h.port = server_ ? server_->port() : 0;
  h.own = area_->own_copies();
  h.replicas = area_->replica_copies();
  return h;
}

std::optional<NodeInfo> NodeSnapshots::registration(const std::string& node, std::int64_t lease) {
  if (lease == 0) return std::nullopt;
  if (auto known = registered_.find(node);
      known != registered_.end() && known->second.lease == lease)
    return known->second;
  const auto kv = conn_.store().get(self_.key("nodes/" + node));
  if (!kv || kv->lease == 0) return std::nullopt;
  NodeInfo info;
  try {
    info = node_from_json(kv->value, node, kv->create_revision);
  } catch (const MalformedRecord&) {
    return std::nullopt;  // the membership logs it
  }
  info.lease = kv->lease;
  if (registered_.size() >= kMaxNodesRemembered) registered_.clear();
  registered_[node] = info;
  if (info.lease != lease) return std::nullopt;
  return info;
}

std::optional<Holdings> NodeSnapshots::accepted(const KeyValue& kv, const std::string& node,
                                                const char* if_ignored) {
  try {
    Holdings holdings;
    if (auto seen = parsed_.find(kv.key);
        seen != parsed_.end() && seen->second.first == kv.mod_revision) {
      holdings = seen->second.second;
    } else {
      holdings = holdings_from_json(kv.value, node);
      if (parsed_.size() >= kMaxNodesRemembered) parsed_.clear();
      parsed_[kv.key] = {kv.mod_revision, holdings};
    }
    // A node's record is on its registration's lease (a key that etcdctl
    // or another client wrote is not; see "Untrusted contents").
    const auto registered = registration(node, kv.lease);
    if (!registered)
      throw MalformedRecord(fmt::format(
          "snapshots record: it is not on the lease of node {}'s registration", excerpt(node)));
    if (auto problem = holdings_problem(holdings, bounds_); !problem.empty())
      throw MalformedRecord(problem);
    if (registered->snapshot_port <= 0 && holds_any(holdings))
      throw MalformedRecord(fmt::format(
          "snapshots record: node {}'s registration names no snapshot server", excerpt(node)));
    holdings.addr = registered->addr;
    holdings.port = registered->snapshot_port;
    return holdings;
  } catch (const MalformedRecord& e) {
    conn_.ignore_record(kv, e.what(), if_ignored);
    return std::nullopt;
  }
}

void NodeSnapshots::publish(const Holdings& holdings) {
  // Nothing held, nothing published: no record, whose absence says the
  // same (a job whose workers keep no snapshots writes none).
  if (published_.empty() && !holds_any(holdings)) return;
  const std::string record = to_json(holdings);
  // A new lease (the old one expired or was revoked) took the record with
  // it: written again.
  if (record == published_ && conn_.lease() == published_lease_) return;
  conn_.store().put(self_.key("snapshots/" + self_.id), record, conn_.lease());
  published_ = record;
  published_lease_ = conn_.lease();
}

void NodeSnapshots::follow(const std::vector<KeyValue>* records,
                           const std::optional<RoundRecord>& round) {
  if (!area_) return;
  take_release();
  const std::string prefix = self_.key("snapshots/");
  // The area is listed once a pass: its own copies' manifests are read there.
  Holdings mine = current_holdings();
  note_reached(bounds_, mine.own, restored_step_);
  std::map<std::string, Holdings> live;
  if (records) {
    for (const auto& kv : *records) {
      if (conn_.ignored(kv) || !kv.key.starts_with(prefix)) continue;
      const std::string node = kv.key.substr(prefix.size());
      if (node == self_.id) continue;  // its own holdings are the area's
      if (auto holdings = accepted(kv, node, "its snapshots are neither replicated nor restored"))
        live[node] = std::move(*holdings);
    }
    if (last_seen_.size() + live.size() > kMaxNodesRemembered) last_seen_.clear();
    for (const auto& [node, holdings] : live) last_seen_[node] = holdings;
  } else if (round && round->round == round_holdings_round_) {
    // Not following every node's record: the members' holdings as the
    // round began; newer snapshots are pulled when their origin notifies.
    live = round_holdings_;
  }
  if (restored_step_ >= 0 && !mine.own.empty() && mine.own.front().step > restored_step_ &&
      mine.own.front().sha256 != own_at_restore_) {
    // The workers loaded the restored snapshot (this round's committed a
    // newer one since): its copy is memory nothing needs.
    release_restore();
    lost_replicas_after_ = restored_step_;
    restored_step_ = -1;
  }
  if (lost_replicas_after_ >= 0 && round && !mine.own.empty() &&
      std::all_of(mine.own.begin(), mine.own.end(),
                  [&](const SnapshotCopy& c) { return c.step > lost_replicas_after_; })) {
    // This node's own part of every snapshot before the restore is gone:
    // the replicas of nodes no longer members cannot complete one again.
    std::error_code ec;
    for (const auto& [node, copies] : mine.replicas)
      if (std::find(round->members.begin(), round->members.end(), node) == round->members.end())
        std::filesystem::remove_all(area_->replicas() / node, ec);
    lost_replicas_after_ = -1;
    mine = current_holdings();
  }
  own_held_ = !mine.own.empty();
  publish(mine);
  if (replication_ && round && round->state == RoundState::running &&
      round->round == workers_.current_round() && workers_.member() && !workers_.empty())
    replication_->update(round->members, std::move(live));
}

std::optional<std::filesystem::path> NodeSnapshots::prepare_round(const RoundRecord& round) {
  if (!area_) return std::filesystem::path();
  // A member of this round is gone (said once): the leader forms the next
  // round without it, and this node waits for that one.
  if (round.round == abandoned_round_) return std::nullopt;
  // The holdings must stay as published while the members decide: no
  // replica comes or goes meanwhile.
  if (replication_ && !replication_->freeze(kFreezeWait))
    self_.log(
        fmt::format("round {}: a replica's copy did not stop within {} ms; its folder is "
                    "left out of this node's holdings",
                    round.round, kFreezeWait.count()));
  struct Thaw {
    SnapshotReplication* replication;
    ~Thaw() {
      if (replication) replication->thaw();
    }
  } thaw{replication_.get()};
  if (replication_) replication_->start_round(round.members);
  note_reached(bounds_, area_->own_copies(), restored_step_);
  KeyValueStore& store = conn_.store();
  if (holdings_round_ != 0 && holdings_round_ != round.round) {
    store.erase(self_.key(fmt::format("holdings/{}/{}", holdings_round_, self_.id)));
    holdings_round_ = 0;
  }
  if (!round.snapshots_held) {
    // No node held a snapshot when the round formed (the leader follows
    // every node's record), which every member reads alike: nothing to
    // agree on, and no member's holdings to exchange.
    release_restore();
    restored_step_ = -1;
    return std::filesystem::path();
  }
  const Holdings mine = current_holdings();
  publish(mine);
  store.put(self_.key(fmt::format("holdings/{}/{}", round.round, self_.id)), to_json(mine),
            conn_.lease());
  holdings_round_ = round.round;
  auto members = await_members(round, mine);
  if (!members) return std::nullopt;
  round_holdings_.clear();
  round_holdings_round_ = round.round;
  for (const auto& h : members->members)
    if (h.node != self_.id) round_holdings_[h.node] = h;
  if (members->members.empty()) return std::filesystem::path();
  return restore(round, members->members, members->lost);
}

std::string NodeSnapshots::gatherer(const RoundRecord& round) {
  if (round.member_revisions.size() != round.members.size() || round.members.empty()) return {};
  const auto oldest =
      std::min_element(round.member_revisions.begin(), round.member_revisions.end());
  return round.members[static_cast<std::size_t>(oldest - round.member_revisions.begin())];
}

std::vector<Holdings> NodeSnapshots::lost_holdings(const RoundRecord& round) const {
  std::vector<Holdings> lost;
  for (const auto& [node, holdings] : last_seen_)
    if (std::find(round.members.begin(), round.members.end(), node) == round.members.end() &&
        holds_any(holdings) && lost.size() < kMaxLostNodesListed)
      lost.push_back(holdings);
  return lost;
}

void NodeSnapshots::write_round_holdings(const RoundHoldings& gathered) {
  KeyValueStore& store = conn_.store();
  const std::string record = to_json(gathered);
  if (record.size() > kMaxRoundHoldingsBytes) {
    self_.log(fmt::format(
        "round {}: the members' snapshot holdings take {} bytes, over the {} of a record: the "
        "other members start without a restore from memory",
        gathered.round, record.size(), kMaxRoundHoldingsBytes));
    return;
  }
  store.put(self_.key(fmt::format("restore/{}", gathered.round)), record, conn_.lease());
  if (gathered_round_ != 0 && gathered_round_ != gathered.round)
    store.erase(self_.key(fmt::format("restore/{}", gathered_round_)));
  gathered_round_ = gathered.round;
}

bool NodeSnapshots::wait_for_change(const std::vector<std::string>& prefixes) {
  // Until the next change under `prefixes`, or the poll interval; a stop
  // signal is looked for in steps this short.
  const int changes = conn_.store().changes_fd(prefixes);
  const auto next = std::chrono::steady_clock::now() + o_.poll_interval;
  for (auto at = std::chrono::steady_clock::now(); at < next;
       at = std::chrono::steady_clock::now()) {
    if (o_.stop_signal && o_.stop_signal->load() != 0) return false;
    const auto step = std::min<milliseconds>(
        milliseconds(100), std::chrono::duration_cast<milliseconds>(next - at) + milliseconds(1));
    if (changes < 0) {
      std::this_thread::sleep_for(step);
      continue;
    }
    pollfd ready{changes, POLLIN, 0};
    if (::poll(&ready, 1, static_cast<int>(step.count())) > 0) break;
  }
  return true;
}

std::optional<RoundHoldings> NodeSnapshots::await_gatherer(const RoundRecord& round,
                                                           const Holdings& mine,
                                                           const std::string& gatherer) {
  const milliseconds patience = holdings_patience(o_);
  const auto deadline = std::chrono::steady_clock::now() + patience;
  const std::string key = self_.key(fmt::format("restore/{}", round.round));
  auto next_departure_check = std::chrono::steady_clock::now() + o_.poll_interval;
  for (;;) {
    auto reads = conn_.store().read({RangeRead{key}, RangeRead{self_.key("round")}});
    if (!reads[0].empty() && !conn_.ignored(reads[0].front())) {
      const KeyValue& kv = reads[0].front();
      try {
        // The gatherer's record is on its registration's lease (a key that
        // etcdctl or another client wrote is not; see "Untrusted contents").
        if (!registration(gatherer, kv.lease))
          throw MalformedRecord(fmt::format(
              "restore record: it is not on the lease of node {}'s registration", gatherer));
        RoundHoldings gathered = round_holdings_from_json(kv.value, round.round, round.members);
        for (auto* list : {&gathered.members, &gathered.lost})
          for (const auto& h : *list)
            if (auto problem = holdings_problem(h, bounds_); !problem.empty())
              throw MalformedRecord(problem);
        for (auto& h : gathered.members)
          if (h.node == self_.id) h = mine;
        return gathered;
      } catch (const MalformedRecord& e) {
        conn_.ignore_record(kv, e.what(), "this node waits for a valid one");
      }
    }
    // A newer round: this one does not start.
    if (!reads[1].empty()) try {
        if (round_from_json(reads[1].front().value).round > round.round) {
          abandoned_round_ = round.round;
          return std::nullopt;
        }
      } catch (const MalformedRecord&) {
        // The membership logs it.
      }
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_departure_check) {
      // The gatherer died before it wrote the record: the leader forms
      // the next round without it.
      next_departure_check = now + o_.poll_interval;
      const auto at = std::find(round.members.begin(), round.members.end(), gatherer);
      const auto kv = conn_.store().get(self_.key("nodes/" + gatherer));
      if (!kv || kv->lease == 0 ||
          kv->create_revision !=
              round.member_revisions[static_cast<std::size_t>(at - round.members.begin())]) {
        self_.log(fmt::format(
            "round {}: member {}, which gathers the members' snapshot holdings, left before it "
            "published them (registration gone); the round does not start, the next one is "
            "formed without it",
            round.round, gatherer));
        abandoned_round_ = round.round;
        return std::nullopt;
      }
    }
    if (now >= deadline) {
      self_.log(fmt::format(
          "round {}: no snapshot holdings from member {}, which gathers them, within {} ms "
          "(max(10 s, 4 x --lease-ttl)); the workers start without a restore from memory",
          round.round, gatherer, patience.count()));
      return RoundHoldings{round.round, {}, {}};
    }
    if (!wait_for_change({key, self_.key("round")})) return std::nullopt;
  }
}

std::optional<RoundHoldings> NodeSnapshots::await_members(const RoundRecord& round,
                                                          const Holdings& mine) {
  const std::string gathering = gatherer(round);
  if (!gathering.empty() && gathering != self_.id) return await_gatherer(round, mine, gathering);
  const milliseconds patience = holdings_patience(o_);
  const auto deadline = std::chrono::steady_clock::now() + patience;
  const std::string prefix = self_.key(fmt::format("holdings/{}/", round.round));
  const std::set<std::string> members(round.members.begin(), round.members.end());
  auto next_departure_check = std::chrono::steady_clock::now();
  for (;;) {
    std::map<std::string, Holdings> found;
    const auto records = conn_.store().get_prefix(prefix);
    const auto now = std::chrono::steady_clock::now();
    const bool late = now >= deadline;
    // Woken by each member's record as it comes: the records are looked at
    // once there can be enough of them.
    if (records.size() >= members.size() || late)
      for (const auto& kv : records) {
        const std::string node = kv.key.substr(prefix.size());
        if (node == self_.id || !members.count(node) || conn_.ignored(kv)) continue;
        if (auto holdings = accepted(kv, node, "that member's snapshots are not restored from"))
          found[node] = std::move(*holdings);
      }
    // This node's own, as it wrote them: a node that serves nothing (one
    // node alone: port 0) has a record no other node would accept, and
    // restores from its own area.
    if (members.count(self_.id)) found[self_.id] = mine;
    if (found.size() == round.members.size()) {
      RoundHoldings gathered{round.round, {}, lost_holdings(round)};
      for (const auto& node : round.members) gathered.members.push_back(std::move(found[node]));
      if (!gathering.empty()) write_round_holdings(gathered);
      return gathered;
    }
    // A member that died before it wrote its holdings never writes them:
    // once its registration is gone (its lease expired) or is another one
    // (it registered again, without its workers), the round cannot start
    // and the leader forms the next one without it. Waiting out the
    // patience here would hold this node (and, on the leader, that next
    // round) for nothing. Looked for once a poll interval, not at each
    // record that wakes the wait.
    if (now >= next_departure_check) {
      next_departure_check = now + o_.poll_interval;
      std::vector<std::string> gone;
      for (std::size_t i = 0; i < round.members.size(); ++i) {
        const std::string& node = round.members[i];
        if (found.count(node) || node == self_.id) continue;
        const auto kv = conn_.store().get(self_.key("nodes/" + node));
        if (!kv || kv->lease == 0 ||
            (!round.member_revisions.empty() && kv->create_revision != round.member_revisions[i]))
          gone.push_back(node);
      }
      if (!gone.empty()) {
        self_.log(
            fmt::format("round {}: member(s) {} left before they published their snapshot "
                        "holdings (registration gone); the round does not start, the next one "
                        "is formed without them",
                        round.round, fmt::join(gone, ", ")));
        abandoned_round_ = round.round;
        return std::nullopt;
      }
    }
    if (late) {
      std::vector<std::string> missing;
      for (const auto& node : round.members)
        if (!found.count(node)) missing.push_back(node);
      self_.log(fmt::format(
          "round {}: no snapshot holdings from member(s) {} within {} ms (max(10 s, 4 x "
          "--lease-ttl)); the workers start without a restore from memory",
          round.round, fmt::join(missing, ", "), patience.count()));
      // The other members wait for the gathered record: it says the same.
      RoundHoldings none{round.round, {}, {}};
      if (!gathering.empty()) write_round_holdings(none);
      return none;
    }
    // Until the next holdings record (or round) arrives.
    if (!wait_for_change({prefix, self_.key("round")})) return std::nullopt;
  }
}

std::filesystem::path NodeSnapshots::restore(const RoundRecord& round,
                                             const std::vector<Holdings>& members,
                                             const std::vector<Holdings>& lost) {
  const auto plan = plan_restore(members, lost, self_.id);
  // The last round's restore is not needed any longer: its workers are
  // stopped.
  release_restore();
  restored_step_ = -1;
  const bool held = std::any_of(members.begin(), members.end(), holds_any) ||
                    std::any_of(lost.begin(), lost.end(), holds_any);
  // A job's first round, when no node holds anything: no line.
  if (held) self_.log(restore_message(round.round, plan));
  const auto* chosen = std::get_if<RestorePlan>(&plan);
  if (!chosen) return {};
  auto source_at = [&](const std::string& file, const Holdings& holder,
                       const std::string& relative) {
    SnapshotFileSource s;
    s.file = file;
    s.relative = relative;
    if (holder.node == self_.id) {
      s.local = area_->root() / relative;
    } else {
      s.host = holder.addr;
      s.port = holder.port;
    }
    return s;
  };
  std::vector<SnapshotFileSource> sources;
  for (const auto& source : chosen->sources) {
    const auto holder = std::find_if(members.begin(), members.end(),
                                     [&](const Holdings& h) { return h.node == source.holder; });
    if (holder == members.end()) {
      self_.log(
          fmt::format("round {}: the plan names {} as the holder of {}, which is no "
                      "member; the workers resume from their disk checkpoint",
                      round.round, source.holder, source.file));
      return {};
    }
    sources.push_back(source_at(source.file, *holder, source.path));
    // Every other member's copy of the same file: tried, in the members'
    // order, when the planned holder cannot give it.
    for (const auto& other : members) {
      auto offer = [&](const SnapshotCopy& copy, const std::string& relative) {
        if (copy.sha256 != chosen->sha256 ||
            std::find(copy.files.begin(), copy.files.end(), source.file) == copy.files.end() ||
            (other.node == source.holder && relative == source.path))
          return;
        sources.push_back(source_at(source.file, other, relative));
      };
      for (const auto& copy : other.own) offer(copy, "own/" + copy.tag + "/" + source.file);
      for (const auto& [node, copies] : other.replicas)
        for (const auto& copy : copies)
          offer(copy, "replicas/" + node + "/" + copy.tag + "/" + source.file);
    }
  }
  const auto dest = area_->restore() / chosen->tag;
  try {
    copy_snapshot(sources, dest, chosen->sha256, conn_.snapshot_auth(), kRestoreCopyTimeout, true,
                  nullptr, key_ ? &*key_ : nullptr);
  } catch (const Error& e) {
    // The other members restore it: workers started here from another
    // state would train a different model. The round fails instead, as it
    // does when a worker fails, and is formed again.
    throw RestoreFailed{fmt::format(
        "round {}: error: cannot copy step {} from memory, every holder of a file tried ({}); "
        "this node's workers are not started and the round fails",
        round.round, chosen->step, e.what())};
  }
  if (key_)
    self_.log(
        fmt::format("round {}: the snapshot of step {} is verified: its manifest's "
                    "HMAC-SHA256 under the key of {}, and each shard file's SHA-256 the "
                    "manifest records",
                    round.round, chosen->step, key_->variable));
  else
    self_.log(fmt::format(
        "round {}: the snapshot of step {} is unauthenticated: its files were checked against "
        "the SHA-256 its holders' records give, which anyone who can write to the rendezvous "
        "store can forge; set {} or {} (as for disk checkpoints) to verify it",
        round.round, chosen->step, core::kCheckpointKeyVariable, core::kCheckpointKeyFileVariable));
  restored_step_ = chosen->step;
  // The job goes on from this step, which every member now holds whole:
  // an older snapshot's files lie on the same nodes as this one's, so no
  // further loss leaves one of them complete where this one is not, and a
  // newer one lacks a lost node's part for good. Their memory goes before
  // the new round's snapshots are written.
  drop_snapshots([&](std::int64_t step) { return step != chosen->step; }, true);
  // Published at once: the other members stop asking for what went.
  publish(current_holdings());
  if (replication_) replication_->pull_after(chosen->step);
  const auto own = area_->own_copies();
  own_at_restore_ = own.empty() ? std::string() : own.front().sha256;
  return dest;
}

bool NodeSnapshots::held_anywhere() const {
  if (!area_) return false;
  if (own_held_) return true;
  return std::any_of(last_seen_.begin(), last_seen_.end(),
                     [](const auto& seen) { return holds_any(seen.second); });
}

std::filesystem::path NodeSnapshots::pending_restore(std::int64_t round) const {
  if (!area_) return {};
  return area_->restore() / fmt::format("round{}", round);
}

void NodeSnapshots::link_restore(std::int64_t round, const std::filesystem::path& prepared) {
  const auto link = pending_restore(round);
  auto staged = link;
  staged += ".tmp";
  std::error_code ec;
  std::filesystem::remove(staged, ec);
  std::filesystem::create_directory_symlink(prepared.filename(), staged, ec);
  if (!ec) std::filesystem::rename(staged, link, ec);
  if (ec)
    throw Error(ErrorKind::io, fmt::format("cannot link the restore {} at {}: {}",
                                           prepared.string(), link.string(), ec.message()));
}

milliseconds NodeSnapshots::prepare_bound() const {
  const auto wait = holdings_patience(o_);
  const auto hold = std::max<milliseconds>(milliseconds(5000), 2 * milliseconds(o_.lease_ttl));
  return 2 * wait + hold + kRestoreCopyTimeout;
}

void NodeSnapshots::release_restore() {
  std::error_code ec;
  for (std::filesystem::directory_iterator it(area_->restore(), ec), end; !ec && it != end;
       it.increment(ec))
    std::filesystem::remove_all(it->path(), ec);
}

void NodeSnapshots::drop_snapshots(const std::function<bool(std::int64_t)>& unwanted,
                                   bool interrupted) {
  std::vector<std::filesystem::path> folders{area_->own()};
  std::error_code ec;
  for (std::filesystem::directory_iterator it(area_->replicas(), ec), end; !ec && it != end;
       it.increment(ec))
    folders.push_back(it->path());
  std::vector<std::filesystem::path> dropped;
  for (const auto& folder : folders)
    for (std::filesystem::directory_iterator it(folder, ec), end; !ec && it != end;
         it.increment(ec)) {
      std::string name = it->path().filename().string();
      // The replication's own staging folders are its to remove.
      const bool staging = folder == area_->own() && name.ends_with(".tmp");
      if (staging) name.resize(name.size() - 4);
      const auto tag_step = snapshot_tag_step(name);
      if (tag_step && (staging ? interrupted : unwanted(*tag_step))) dropped.push_back(it->path());
    }
  for (const auto& path : dropped) std::filesystem::remove_all(path, ec);
}

void NodeSnapshots::take_release() {
  const auto file = area_->own() / kSnapshotReleaseFile;
  std::error_code ec;
  if (std::filesystem::symlink_status(file, ec).type() == std::filesystem::file_type::not_found)
    return;
  const auto text = read_small_file(file, kMaxSidecarBytes);
  const auto step =
      text ? snapshot_tag_step("step" + text->substr(0, text->find('\n'))) : std::nullopt;
  if (step) {
    // Every node's snapshot after the restored one is replicated (the
    // workers agreed on it): nothing before it can be restored any more.
    release_restore();
    drop_snapshots([&](std::int64_t held) { return held <= *step; }, false);
  } else {
    self_.log(fmt::format("'{}' is not a release request (a step and a newline); removed",
                          file.string()));
  }
  std::filesystem::remove(file, ec);
}

void NodeSnapshots::fail_round(const RoundRecord& round, const std::string& message) {
  self_.log(message);
  FailureReport report;
  report.node = self_.id;
  report.exit_status = 1;
  report.error_message = excerpt(message, kMaxTextChars - 3);
  // A worker's failure reported first stands.
  conn_.store().compare_and_swap(self_.key(fmt::format("failure/{}", round.round)), 0,
                                 to_json(report));
}

}  // namespace ductile::agent
