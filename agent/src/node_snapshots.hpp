// In-memory snapshots, on this node's side: its snapshot area (the
// workers' DUCTILE_SNAPSHOT_DIR), the server of the area's files, the
// holdings it publishes (snapshots/<node>, on its lease), the replicas it
// pulls of other members' snapshots, and the restore of a new round: its
// final holdings published (holdings/<round>/<node>), every member's
// awaited, the same plan computed from them as every member does, the
// files it lacks fetched into restore/<tag>/ and passed to its workers
// (DUCTILE_SNAPSHOT_RESTORE). The round's oldest member reads every
// member's holdings record and writes them, with the last holdings of the
// nodes lost, into restore/<round> (on its lease); the other members read
// that one record, and compute the same plan from it. Internal to libductile_agent; owned by Agent
// (agent_impl.hpp).
//
// Trust: a snapshots/<node> or holdings/<round>/<node> record is taken
// only on the lease of that node's registration (nodes/<node>), as the
// done and saved marks are (restore/<round>: on the lease of the round's
// oldest member, whose registration addresses it gives are taken as the
// leader's round record is), and with steps and world sizes that fit the
// job (snapshot_trust.hpp); any other is ignored, and logged. A node's
// snapshots are copied from the address and snapshot port of its
// registration, never from one its records name. With a checkpoint key
// (DUCTILE_CHECKPOINT_KEY or DUCTILE_CHECKPOINT_KEY_FILE) every copy is
// checked against the manifest's HMAC and the shards' SHA-256 it records;
// without one a restore says that it is unauthenticated.
//
// Threading: the agent's thread only, but discard() (a stop signal's
// thread, as the process ends); the server and the replication run
// threads of their own. Errors: StoreError from the store;
// ductile::Error when the area cannot be made or served, or the checkpoint
// key's variables are not valid (invalid_argument, naming the variable).
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent_common.hpp"
#include "connection.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "node_workers.hpp"
#include "snapshot_area.hpp"
#include "snapshot_plan.hpp"
#include "snapshot_replication.hpp"
#include "snapshot_server.hpp"
#include "snapshot_trust.hpp"

namespace ductile::agent {

// prepare_round() could not copy the snapshot the other members restore:
// this node's workers must not start (see NodeSnapshots::fail_round).
struct RestoreFailed {
  std::string message;
};

class NodeSnapshots {
 public:
  NodeSnapshots(const AgentOptions& options, const RendezvousSettings& settings,
                const NodeIdentity& self, RendezvousConnection& conn, NodeWorkers& workers)
      : o_(options), settings_(settings), self_(self), conn_(conn), workers_(workers) {}
  ~NodeSnapshots() { close(); }

  // Reads the checkpoint key and makes the area; every round's workers
  // get its own/ folder.
  void make_area();
  // Serves the area and starts the replication (after the rendezvous is
  // open: the job's secret is known).
  void serve();
  // Where the area is served (registered with the node); 0: nowhere.
  int port() const { return server_ ? server_->port() : 0; }
  // The read of every node's holdings, for the pass's request.
  RangeRead holdings_read() const { return RangeRead{self_.key("snapshots/"), true}; }
  // Each pass, with that read's records (null: an agent that follows only
  // its own part of the job, which knows the members' holdings as its
  // round began): publishes this node's holdings when they changed (or the
  // lease did), remembers each node's last record, and tells the
  // replication the current round's members.
  void follow(const std::vector<KeyValue>* records, const std::optional<RoundRecord>& round);
  // A new round this node is a member of, its old workers stopped: the
  // restore (see above; none, at once, when the round says that no node
  // held a snapshot). Returns the snapshot folder the workers resume
  // from, empty for none; nullopt when a stop signal came meanwhile, or
  // when a member left before it published its holdings (the round is not
  // entered: the leader forms the next one without that member).
  // Throws RestoreFailed when no holder of one of the snapshot's files
  // gives it (each tried in turn).
  std::optional<std::filesystem::path> prepare_round(const RoundRecord& round);
  // This node cannot enter `round` (a RestoreFailed's message): logs it and
  // reports the round failed (failure/<round>), as a worker's failure is,
  // so that the round is formed again.
  void fail_round(const RoundRecord& round, const std::string& message);
  // Whether a node this one follows (every node, on the leader) or this
  // one holds a snapshot: the next round may restore one.
  bool held_anywhere() const;
  // Where `round`'s restore will be, for workers started while
  // prepare_round() still waits (DUCTILE_SNAPSHOT_RESTORE, with
  // DUCTILE_SNAPSHOT_RESTORE_WAIT: they wait for it); empty without an
  // area. link_restore() makes it name the folder prepare_round() gave
  // (a symbolic link, renamed into place: it appears whole).
  std::filesystem::path pending_restore(std::int64_t round) const;
  void link_restore(std::int64_t round, const std::filesystem::path& prepared);
  // The longest prepare_round() may wait and copy for a round: the
  // members' holdings, the gatherer's record, a pause of running workers
  // and the copy.
  std::chrono::milliseconds prepare_bound() const;
  // Stops serving and copying, and removes the area.
  void close();
  // The process ends at once (a stop signal outside the loop): only the
  // area's files go.
  void discard();

 private:
  Holdings current_holdings() const;
  // The holdings `kv` (a record of `node`) holds when they are to be
  // trusted (see above), its address and port the registration's; none
  // otherwise, the record ignored saying `if_ignored`.
  std::optional<Holdings> accepted(const KeyValue& kv, const std::string& node,
                                   const char* if_ignored);
  // The registration of `node` when it is on `lease`: read again when the
  // lease is not the one last read.
  std::optional<NodeInfo> registration(const std::string& node, std::int64_t lease);
  void publish(const Holdings& holdings);
  // Every member's holdings/<round>/ record, waited for (bounded); none
  // when a stop signal came, or when a member whose record is missing is no
  // longer registered (the round is then abandoned: see abandoned_round_).
  // `mine`: this node's own holdings, as published for the round.
  std::optional<RoundHoldings> await_members(const RoundRecord& round, const Holdings& mine);
  // Not the gatherer: its restore/<round> record, waited for (bounded);
  // none when a stop signal came, a newer round was formed, or the
  // gatherer left.
  std::optional<RoundHoldings> await_gatherer(const RoundRecord& round, const Holdings& mine,
                                              const std::string& gatherer);
  // The member that gathers the round's holdings: its oldest; none for a
  // round without the members' revisions (every member reads every record).
  static std::string gatherer(const RoundRecord& round);
  // The last holdings seen of the nodes that are not members of `round`.
  std::vector<Holdings> lost_holdings(const RoundRecord& round) const;
  void write_round_holdings(const RoundHoldings& gathered);
  // Until a key under `prefixes` changes, or the poll interval; false when
  // a stop signal came.
  bool wait_for_change(const std::vector<std::string>& prefixes);
  std::filesystem::path restore(const RoundRecord& round, const std::vector<Holdings>& members,
                                const std::vector<Holdings>& lost);
  // Removes what restore/ holds.
  void release_restore();
  // Removes the own and replica snapshot folders of the steps `unwanted`
  // names, and with `interrupted` the workers' staging folders in own/.
  void drop_snapshots(const std::function<bool(std::int64_t)>& unwanted, bool interrupted);
  // The workers' own/release, when there is one: what it names freed, the
  // file removed.
  void take_release();

  const AgentOptions& o_;
  const RendezvousSettings& settings_;
  const NodeIdentity& self_;
  RendezvousConnection& conn_;
  NodeWorkers& workers_;
  std::unique_ptr<SnapshotArea> area_;
  std::unique_ptr<SnapshotServer> server_;
  std::unique_ptr<SnapshotReplication> replication_;
  std::optional<core::CheckpointKey> key_;
  SnapshotBounds bounds_;
  std::map<std::string, NodeInfo> registered_;  // by node: its registration last read
  // By key: a record's revision and what it parsed to (each pass reads
  // every node's record; only a changed one is parsed again).
  std::map<std::string, std::pair<std::int64_t, Holdings>> parsed_;
  bool own_held_ = false;  // this node held its own snapshot at the last follow()
  std::string published_;  // the record last written to snapshots/<node>
  std::int64_t published_lease_ = 0;
  std::int64_t holdings_round_ = 0;  // the round of the holdings/ record written last
  std::int64_t gathered_round_ = 0;  // the round of the restore/ record written last
  // The members' holdings (but this node's) as round_holdings_round_ began.
  std::map<std::string, Holdings> round_holdings_;
  std::int64_t round_holdings_round_ = 0;
  // A round one of whose members left before it published its holdings:
  // never entered (prepare_round() answers nullopt for it at once).
  std::int64_t abandoned_round_ = 0;
  // The last record of each node seen (a lost node's stays).
  std::map<std::string, Holdings> last_seen_;
  // The step of the snapshot in restore/ (-1: none): released once this
  // round's workers committed a newer one, so that a node holds no more
  // than its own and its replicas' snapshots.
  std::int64_t restored_step_ = -1;
  std::string own_at_restore_;  // the SHA-256 of the newest own snapshot then (the last round's)
  // After a restore of this step (-1: none): the replicas of nodes that
  // are no longer members are removed once every own snapshot is newer.
  std::int64_t lost_replicas_after_ = -1;
};

}  // namespace ductile::agent
