// The job's membership as this agent sees it: its own registration
// (registration.cpp: the node's key, claimed at start and again when lost,
// and the job's settings), the live nodes' registrations and the round
// records (membership.cpp). Internal to libductile_agent; owned by Agent
// (agent_impl.hpp).
//
// Threading: the agent's thread only. Errors: StoreError from the store;
// ductile::Error (after withdrawing from the job) when another agent holds
// this node's id or node rank, or the job runs with other settings.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent_common.hpp"
#include "connection.hpp"
#include "ductile/agent/job_policy.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "ductile/error.hpp"

namespace ductile::agent {

class Membership {
 public:
  // `settings`: the job's, set before register_node().
  Membership(const AgentOptions& options, const RendezvousSettings& settings,
             const NodeIdentity& self, RendezvousConnection& conn)
      : o_(options), settings_(settings), self_(self), conn_(conn) {}

  // registration.cpp
  // At start: claims the node's key, waiting for the registration of a
  // previous run of this node to expire; throws ductile::Error when another
  // live agent holds the id.
  void register_node();
  // After register_node(): notes this registration's revision and checks
  // this agent's settings against the job's (writing them when it is the
  // first agent of a run).
  void join(const JobPolicy& policy);
  // The oldest live registrations join() read from the age index, records
  // included, and this agent when fewer are older (at most kLeaderWindow;
  // an elastic job's), for the loop's first pass; once.
  std::optional<std::vector<NodeInfo>> take_join_window() {
    return std::exchange(join_window_, std::nullopt);
  }
  // In the loop: registers again when this node's key is gone or was
  // overwritten (a lost lease, a deletion, a hostile write).
  void reclaim_node_key(const std::string& why);
  // Removes a previous run's failure, done, checkpoint and saved records
  // (the first agent of a run, or the leader starting one over them).
  void clear_previous_run();
  // The age index (an elastic job's): ages/<create revision, 20 digits>/<id>
  // holds a copy of each registration on its lease, so that the oldest
  // registrations are the first keys of a range, which etcd answers by
  // reading those keys only (a range sorted by creation costs etcd 3.4 a
  // read of every key in it). Each pass: writes this agent's entry when
  // its registration's revision or lease changed since the last, and
  // removes the entry it replaces. Throws StoreError.
  void keep_age_entry();
  // The age index's first kLeaderWindow entries (`records`: with their
  // records, else keys only).
  RangeRead age_window(bool records) const;
  // The live registrations an age_window() read names, oldest first (from
  // keys only: id, create revision and lease, no address).
  std::vector<NodeInfo> oldest_by_age(const std::vector<KeyValue>& kvs);

  // membership.cpp
  // The live agents' registrations: leased keys holding valid records (or
  // a valid record before it was overwritten), sorted by age. Sets *own_ok
  // when this agent's own key holds its own record on its lease. every_key:
  // kvs are every registration (else some: the others' last valid records
  // are kept).
  std::vector<NodeInfo> live_nodes(const std::vector<KeyValue>& kvs, bool* own_ok, bool every_key);
  // This agent's key holds its own record on its lease (and own_revision()
  // is that key's create revision).
  bool own_registration_ok(const std::vector<KeyValue>& own);
  // The round record, when it is one that fits this job.
  std::optional<RoundRecord> read_round(const std::optional<KeyValue>& kv);
  // A round that ended (succeeded or failed) before this agent first
  // registered: a previous run's, not this one's.
  bool previous_run(const RoundRecord& round, const KeyValue& kv) const;

  // The create revision of this agent's registration: a round lists it for
  // each member, and a round that lists this node's id with another one was
  // formed for an earlier run of the node.
  std::int64_t own_revision() const { return own_revision_; }
  std::int64_t highest_round() const { return highest_round_; }  // the highest seen
  const std::optional<RoundRecord>& last_good_round() const { return last_good_round_; }
  // The revision of the round record read_round() took for a previous run's.
  std::int64_t previous_run_revision() const { return previous_run_logged_; }

 private:
  enum class Claim { held, taken, retry };
  // One attempt to hold nodes/<id> on this agent's lease: held (written),
  // taken (a live registration of another lease; *holder set), retry (the
  // key changed meanwhile). A key without a lease, or with a record no
  // agent writes, is replaced.
  // `joined`: set, on a first registration, to join_reads() as they were
  // read with it, in the same request.
  Claim claim_node_key(std::optional<KeyValue>* holder,
                       std::optional<std::vector<std::vector<KeyValue>>>* joined = nullptr);
  // What join() reads: this agent's key, some registrations (an elastic
  // job's first in key order: whether others run; a static job's all), the
  // settings, the round and (elastic) the age index's first entries.
  std::vector<RangeRead> join_reads() const;
  // `first`: the settings and round records as join() read them, for the
  // first attempt.
  void check_settings(const std::vector<NodeInfo>& others, const JobPolicy& policy,
                      std::vector<std::vector<KeyValue>> first);
  [[noreturn]] void refuse_duplicate(const KeyValue& holder, const std::string& how);
  // Leaves the job before it joined (the lease revoked) and throws `error`.
  [[noreturn]] void withdraw(const Error& error);

  // This node's registration record.
  NodeInfo own_record() const;
  std::string age_key(std::int64_t revision) const;

  const AgentOptions& o_;
  const RendezvousSettings& settings_;
  const NodeIdentity& self_;
  RendezvousConnection& conn_;
  std::int64_t own_revision_ = 0;
  // The revision and lease of this agent's age index entry (0: none).
  std::int64_t age_revision_ = 0, age_lease_ = 0;
  // The revision of this agent's first registration: a round that ended
  // before it was a previous run's.
  std::int64_t first_revision_ = 0;
  std::int64_t highest_round_ = 0;
  std::optional<std::vector<NodeInfo>> join_window_;  // see take_join_window()
  // join_reads() as register_node() read them, for join(); once.
  std::optional<std::vector<std::vector<KeyValue>>> registered_reads_;
  std::optional<RoundRecord> last_good_round_;  // the last valid round record seen
  // The round record last parsed and found valid, and its revision: each
  // pass reads the record, which names every member; only a new one is
  // parsed and checked again.
  std::int64_t parsed_round_revision_ = 0;
  RoundRecord parsed_round_;
  std::int64_t previous_run_logged_ = 0;         // the round record's revision logged
  std::map<std::string, NodeInfo> known_nodes_;  // key -> its last valid record
};

}  // namespace ductile::agent
