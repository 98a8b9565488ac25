// This node's registration in the job: its key (one agent per node id),
// claimed at start and again when lost, and the job's settings record. See
// membership.hpp.
#include <unistd.h>

#include <algorithm>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ductile/error.hpp"
#include "membership.hpp"

namespace ductile::agent {

using json = nlohmann::json;

NodeInfo Membership::own_record() const {
  NodeInfo record{self_.id, self_.addr, 0, o_.node_rank};
  record.snapshot_port = self_.snapshot_port;
  record.link_port = self_.link_port;
  return record;
}

std::string Membership::age_key(std::int64_t revision) const {
  return self_.key(fmt::format("ages/{:020}/{}", revision, self_.id));
}

RangeRead Membership::age_window(bool records) const {
  RangeRead read{self_.key("ages/"), true, kLeaderWindow};
  read.keys_only = !records;
  return read;
}

void Membership::keep_age_entry() {
  const std::int64_t lease = conn_.lease();
  if (o_.node_rank >= 0 || own_revision_ <= 0 ||
      (age_revision_ == own_revision_ && age_lease_ == lease))
    return;
  // The new entry before the old one goes: the node is never missing from
  // the index while its registration lives.
  conn_.store().put(age_key(own_revision_), to_json(own_record()), lease);
  if (age_revision_ > 0 && age_revision_ != own_revision_)
    conn_.store().erase(age_key(age_revision_));
  age_revision_ = own_revision_;
  age_lease_ = lease;
}

Membership::Claim Membership::claim_node_key(
    std::optional<KeyValue>* holder, std::optional<std::vector<std::vector<KeyValue>>>* joined) {
  const std::string k = self_.key("nodes/" + self_.id), value = to_json(own_record());
  if (joined) {
    // The first registration and join()'s reads in one request: each
    // costs a round trip to a store that many agents load as they start.
    *joined = conn_.store().compare_and_swap_then_read(k, 0, value, conn_.lease(), join_reads());
    if (*joined) return Claim::held;
  } else if (conn_.store().compare_and_swap(k, 0, value, conn_.lease())) {
    return Claim::held;
  }
  auto existing = conn_.store().get(k);
  if (!existing) return Claim::retry;  // deleted or expired meanwhile
  bool ours = existing->lease == conn_.lease();
  std::string problem;
  if (existing->lease == 0) {
    problem = "it has no lease, so no agent keeps it alive";
  } else if (!ours) {
    try {
      node_from_json(existing->value, self_.id, existing->create_revision);
    } catch (const MalformedRecord& e) {
      problem = e.what();
    }
  }
  if (ours || !problem.empty()) {
    if (!problem.empty())
      conn_.ignore_record(*existing, problem, "replaced by this agent's registration");
    return conn_.store().compare_and_swap(k, existing->mod_revision, value, conn_.lease())
               ? Claim::held
               : Claim::retry;
  }
  *holder = existing;
  return Claim::taken;
}

void Membership::withdraw(const Error& error) {
  conn_.close();
  throw error;
}

void Membership::refuse_duplicate(const KeyValue& holder, const std::string& how) {
  std::string addr = "?";
  try {
    addr = node_from_json(holder.value, self_.id, 0).addr;
  } catch (const MalformedRecord&) {
  }
  withdraw(Error(ErrorKind::invalid_argument,
                 fmt::format("--node-id '{}' is in use: another agent of job '{}' on {} is "
                             "registered under it (address {}) and {}; give every agent its own "
                             "--node-id, or leave --node-id out for a generated one",
                             self_.id, o_.job_id, conn_.store().describe(), addr, how)));
}

void Membership::register_node() {
  using clock = std::chrono::steady_clock;
  std::int64_t watched_lease = 0, last_remaining = 0;
  clock::time_point deadline{};
  for (int changes = 0;;) {
    std::optional<KeyValue> holder;
    Claim claim = Claim::retry;
    try {
      claim = claim_node_key(&holder, &registered_reads_);
    } catch (const StoreUnavailable&) {
      throw;  // a slow or absent store: the caller waits for it (agent.cpp)
    } catch (const StoreError& e) {
      // A store that refuses the write (a hosted one full of keys) or does
      // not answer: this agent cannot join; the job's agents go on.
      withdraw(
          Error(ErrorKind::communication,
                fmt::format("cannot register this node in job '{}': {}", o_.job_id, e.what())));
    }
    if (claim == Claim::held) return;
    if (claim == Claim::retry) {
      if (++changes > 100)
        throw std::runtime_error("this node's key keeps changing under " +
                                 self_.key("nodes/" + self_.id));
      continue;
    }
    // A live registration of another lease: a previous run of this node
    // (killed before it could revoke its lease: the key goes when the lease
    // expires) or another agent started with the same id (it renews its
    // lease every TTL/3, so the lease outlives its time left, or the time
    // left goes up). etcd truncates the time left to whole seconds.
    std::int64_t remaining = conn_.store().lease_remaining(holder->lease);
    if (remaining < 0) {
      // Expired: etcd deletes the key within moments.
    } else if (holder->lease != watched_lease) {
      watched_lease = holder->lease;
      deadline = clock::now() + std::chrono::seconds(remaining + 2);
      self_.log(fmt::format(
          "node id '{}' is registered by another lease ({} s left): waiting for it to "
          "expire (a previous run of this node?) or be renewed (another agent with this id)",
          self_.id, remaining));
    } else if (remaining > last_remaining || clock::now() > deadline) {
      refuse_duplicate(*holder, "keeps its lease alive");
    }
    last_remaining = remaining;
    std::this_thread::sleep_for(o_.poll_interval);
  }
}

void Membership::reclaim_node_key(const std::string& why) {
  self_.log(fmt::format("this node's registration {}; registering again", why));
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::optional<KeyValue> holder;
    Claim claim = claim_node_key(&holder);
    if (claim == Claim::held) return;
    if (claim == Claim::taken) {
      std::int64_t remaining = conn_.store().lease_remaining(holder->lease);
      if (remaining >= 0) refuse_duplicate(*holder, "took this node's id while it was away");
    }
  }
  // The key keeps changing: the next pass tries again.
}

void Membership::clear_previous_run() {
  for (const char* records : {"failure/", "done/", "checkpoint/", "saved/"})
    conn_.store().erase_prefix(self_.key(records));
}

std::vector<RangeRead> Membership::join_reads() const {
  // Whether other agents run: the first two registrations in key order
  // (this one is among them otherwise; etcd reads those keys only) and the
  // age index's entries. A static job checks every node rank (its leader,
  // the lowest, reads them anyway).
  if (o_.node_rank >= 0)
    return {RangeRead{self_.key("nodes/" + self_.id)},
            RangeRead{self_.key("nodes/"), true, 0, true}, RangeRead{self_.key("settings")},
            RangeRead{self_.key("round")}};
  return {RangeRead{self_.key("nodes/" + self_.id)}, RangeRead{self_.key("nodes/"), true, 2},
          RangeRead{self_.key("settings")}, RangeRead{self_.key("round")}, age_window(true)};
}

void Membership::join(const JobPolicy& policy) {
  // One request, the registration's when it could read them too.
  const bool ranked = o_.node_rank >= 0;
  auto reads = registered_reads_ ? std::move(*registered_reads_) : conn_.store().read(join_reads());
  registered_reads_.reset();
  own_revision_ = first_revision_ = reads[0].empty() ? 0 : reads[0].front().create_revision;
  // At once: until it is written, agents that join read an age index
  // without this one, and may take another for their leader.
  keep_age_entry();
  bool own_ok = false;
  auto others = live_nodes(reads[1], &own_ok, ranked);
  if (!ranked) {
    // Read with the registration, before this agent wrote its own entry:
    // it is placed by its age.
    join_window_ = oldest_by_age(reads[4]);
    std::erase_if(*join_window_, [&](const NodeInfo& n) { return n.id == self_.id; });
    NodeInfo own = own_record();
    own.create_revision = own_revision_;
    own.lease = conn_.lease();
    join_window_->insert(std::upper_bound(join_window_->begin(), join_window_->end(), own,
                                          [](const NodeInfo& a, const NodeInfo& b) {
                                            return a.create_revision < b.create_revision;
                                          }),
                         std::move(own));
    if (join_window_->size() > static_cast<std::size_t>(kLeaderWindow))
      join_window_->resize(static_cast<std::size_t>(kLeaderWindow));
  }
  std::erase_if(others, [&](const NodeInfo& n) { return n.id == self_.id; });
  if (others.empty() && join_window_)
    for (const auto& n : *join_window_)
      if (n.id != self_.id) others.push_back(n);
  check_settings(others, policy, {std::move(reads[2]), std::move(reads[3])});
}

void Membership::check_settings(const std::vector<NodeInfo>& others_alive, const JobPolicy& policy,
                                std::vector<std::vector<KeyValue>> first) {
  json mine = json::parse(policy.settings_json());
  mine["nproc_per_node"] = o_.nproc_per_node;
  mine["mpi_world"] = o_.mpi_world;
  if (o_.node_rank >= 0) mine["node_ranked"] = true;
  const std::string settings_text = mine.dump();
  bool others = !others_alive.empty();
  if (!others) {
    // First agent of a (new) run: state a finished or crashed run left
    // behind is not this run's. An agent that registered meanwhile may
    // have read a crashed run's round, which it is not in: this run's
    // rounds are numbered after it, so that its first is never taken for
    // that one.
    if (first.size() == 2 && !first[1].empty()) {
      try {
        const RoundRecord left = round_from_json(first[1].front().value);
        if (left.state == RoundState::running)
          highest_round_ = std::max(highest_round_, left.round);
      } catch (const MalformedRecord&) {
        // Erased all the same; no agent takes such a record for a round.
      }
    }
    conn_.store().erase(self_.key("round"));
    clear_previous_run();
  }
  // A static rendezvous: one agent per node rank (the oldest keeps it).
  for (const auto& n : others_alive)
    if (o_.node_rank >= 0 && n.rank == o_.node_rank && n.create_revision < own_revision_) {
      withdraw(
          Error(ErrorKind::invalid_argument,
                fmt::format("--node-rank {} is in use: the agent '{}' (address {}) of job '{}' "
                            "on {} registered it first; give every node its own --node-rank "
                            "from 0 to {}",
                            o_.node_rank, n.id, n.addr, o_.job_id, conn_.store().describe(),
                            settings_.max_nodes - 1)));
    }
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto reads =
        attempt == 0 && others && first.size() == 2
            ? std::move(first)
            : conn_.store().read({RangeRead{self_.key("settings")}, RangeRead{self_.key("round")}});
    std::optional<KeyValue> existing;
    if (!reads[0].empty()) existing = reads[0].front();
    if (existing && existing->value == settings_text) return;
    // The settings of a run that ended before this agent registered are
    // that run's: this run writes its own (the round's end was written
    // after them).
    bool stale = false;
    if (existing && !reads[1].empty()) {
      try {
        RoundRecord round = round_from_json(reads[1].front().value);
        stale = previous_run(round, reads[1].front()) &&
                existing->mod_revision < reads[1].front().mod_revision;
      } catch (const MalformedRecord&) {
      }
    }
    if (existing && others && !stale) {
      std::vector<std::string> differences;
      try {
        differences = settings_differences(existing->value, settings_text);
        if (differences.empty()) return;  // the same settings, written differently
      } catch (const MalformedRecord& e) {
        conn_.ignore_record(*existing, e.what(), "replaced by this agent's settings");
      }
      if (!differences.empty()) {
        withdraw(Error(ErrorKind::config,
                       fmt::format("job id '{}' is in use on {} with another configuration: {} ({} "
                                   "here); give another --job-id or the job's configuration",
                                   o_.job_id, conn_.store().describe(),
                                   fmt::join(differences, "; "), o_.config.string())));
      }
    }
    if (conn_.store().compare_and_swap(self_.key("settings"), existing ? existing->mod_revision : 0,
                                       settings_text))
      return;
  }
  throw std::runtime_error(
      "the job's settings record keeps changing; is another job starting "
      "with the same --job-id?");
}

}  // namespace ductile::agent
