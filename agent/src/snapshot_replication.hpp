// Replicas of the other nodes' snapshots, pulled in the background, and
// the copy of one whole snapshot from its holders (a replica, a restore).
// Internal to libductile_agent; owned by Agent (agent_impl.hpp).
//
// During a round, with R the workers' snapshot_replicas (own/replicas),
// the member at group index i of n pulls, for k = 1..R (k < n), the newest
// committed own snapshot of member (i - k) mod n into
// replicas/<node>/<tag>/ (staged in <tag>.tmp, then renamed; checked
// against the manifest's SHA-256 and the sizes the manifest gives, and with
// a checkpoint key against the manifest's HMAC and the shards' SHA-256), and
// keeps the 2 newest of each node: the older is removed before a new one
// is copied, so that 2 are held at any moment. A replica is removed only
// once its successor is verified: a snapshot of a tag already held (the
// steps after a restore count again) is copied beside it first.
// Copies come from the origin's registered address only: the holdings
// update() gives name it (node_snapshots.hpp).
//
// A new snapshot is pulled at once: the origin looks at own/latest when
// the kernel reports a write or rename in own/ (inotify; without it, every
// watch_interval while its workers keep snapshots or for 2 s after a
// commit, else every 100 ms) and, when its
// workers commit a snapshot, sends a notify
// (snapshot_server.hpp) to each of its successors (members (i + k) mod n,
// k = 1..min(R, n - 1)); a holder whose copy is complete sends a have
// back. A notify is pulled when its snapshot is one the origin published
// (its snapshots/<node> record), or when it names a step newer than all
// the origin published (the record follows the notify): its manifest is
// then checked against its SHA-256 before anything else is copied, and
// once one such copy of the origin failed no other is tried until the
// next update(). Any other notify is refused and logged (a line per origin
// every 10 s). The origin writes own/replicated (a temporary file renamed): the
// newest step every successor of the round holds, as a decimal line, or
// "off" when it has none; the workers read it.
//
// Threading: SnapshotReplication runs two threads of its own (pulls, and
// the watch of own/latest that sends the notifies); on_message() is for
// the server's threads, the other public functions for the agent's
// thread. Errors: a copy that fails is
// logged (a line per origin every 10 s) and not tried again (the holder's
// next snapshot is); a published one the origin answers it no longer
// holds (it was superseded while the copy was asked for) is not tried
// again and not logged. copy_snapshot throws ductile::Error (io; not_found when the one
// holder of a file answered that it holds no such file).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "agent_common.hpp"
#include "snapshot_area.hpp"
#include "snapshot_plan.hpp"
#include "snapshot_server.hpp"
#include "snapshot_trust.hpp"

namespace ductile::agent {

// Replicas kept of each node's snapshots.
inline constexpr std::size_t kReplicasKeptPerNode = 2;

// Where one file of a snapshot is copied from: this node's area (`local`
// set) or a holder's server.
struct SnapshotFileSource {
  std::string file;
  std::string host;  // the holder's snapshot server
  int port = 0;
  std::string relative;         // the file's path in the holder's area
  std::filesystem::path local;  // the file, when this node holds it
};

// Builds `dest` (a folder that must not exist) as a complete copy of the
// snapshot whose manifest's SHA-256 is `sha256`: every file of `sources`
// (a file listed more than once has several holders, tried in order until
// one gives it)
// copied (or hard-linked, when local) into `dest`.tmp, the manifest first
// and checked against `sha256` and its sidecar, each rank file's size
// against the manifest's (with `complete`, every shard file the manifest
// lists must be among them); with `key`, verify_signed_snapshot's checks
// (snapshot_trust.hpp); then renamed to `dest`. `timeout`: the longest
// wait without progress; `abandon`, when set, stops the copy; `auth`: how
// the holders' servers are asked (snapshot_server.hpp). Throws
// ductile::Error (io) naming the file and the problem (the staging folder
// is then removed).
void copy_snapshot(const std::vector<SnapshotFileSource>& sources,
                   const std::filesystem::path& dest, const std::string& sha256,
                   const SnapshotAuth& auth, std::chrono::milliseconds timeout, bool complete,
                   const std::atomic<bool>* abandon = nullptr,
                   const core::CheckpointKey* key = nullptr);

class SnapshotReplication {
 public:
  // `watch_interval`: how often own/latest is looked at; `key`: the job's
  // checkpoint key, none when it has none.
  SnapshotReplication(const SnapshotArea& area, const NodeIdentity& self, SnapshotAuth auth,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30),
                      std::chrono::milliseconds watch_interval = std::chrono::milliseconds(15),
                      std::optional<core::CheckpointKey> key = std::nullopt);
  // Stops the threads (an in-flight copy is abandoned).
  ~SnapshotReplication();
  SnapshotReplication(const SnapshotReplication&) = delete;
  SnapshotReplication& operator=(const SnapshotReplication&) = delete;

  // The round's members in group order and the live holdings read from
  // the rendezvous (by node, each on its node's registration's lease, its
  // address and port the registered ones); the thread pulls what they call
  // for, and finds there where the members' servers listen.
  void update(std::vector<std::string> members, std::map<std::string, Holdings> holdings);
  // A new round this node is a member of, before its workers start: the
  // acknowledgements of the last round are dropped (and pull_after's
  // step), and own/replicated is written "off" (one member: no successor)
  // or "0". Only snapshots the workers commit from now on are announced to
  // the successors.
  void start_round(std::vector<std::string> members);
  // The snapshot server's handler (snapshot_server.hpp): a notify is queued
  // for the pulling thread (ignored when its origin is no member of the
  // round, refused when it is no snapshot the origin published: see
  // above), a have is counted. Returns at once; any thread.
  std::string on_message(const SnapshotMessage& message);
  // After a restore of `step` (before the round's workers start): no
  // snapshot of that step or an older one is pulled this round. Every
  // member holds the restored one whole, and a copy would only add to the
  // memory held until the round's own snapshots are replicated.
  void pull_after(std::int64_t step) { pull_floor_ = step; }
  // Pulls nothing more and waits (up to `wait`) for the copy in flight to
  // end or be abandoned; true when none is in flight any longer.
  bool freeze(std::chrono::milliseconds wait);
  // Pulls again from the next update() on.
  void thaw();
  // Copies finished so far (a test's and the log's count).
  std::size_t copies_made() const { return copies_made_.load(); }

 private:
  void run();
  void watch();
  // One pass over the members: the first replica missing pulled; true when
  // one was pulled (another may be missing).
  bool pull_once(const std::vector<std::string>& members,
                 const std::map<std::string, Holdings>& holdings);
  // `copy` of node `origin` (served at `from`) into replicas/; true when
  // it was copied now, false when it was held already or failed.
  // `published`: the copy is one of the origin's snapshots/<node> record
  // (else a notify's, ahead of it).
  bool pull(const Holdings& from, const SnapshotCopy& copy, bool published);
  // Tells `origin` (once a round) that this node holds `copy` of it.
  void acknowledge(const Holdings& origin, const SnapshotCopy& copy);
  // Removes the copies cut short and all but the `keep` newest replicas.
  void prune(const std::filesystem::path& node_dir, std::size_t keep);
  // The members (i + k) mod n, k = 1..min(R, n - 1), of the round (caller
  // holds ack_mutex_).
  std::vector<std::string> successors() const;
  // own/replicated from the acknowledgements (caller holds ack_mutex_).
  void write_replicated();

  const SnapshotArea& area_;
  const NodeIdentity& self_;
  const SnapshotAuth auth_;
  const std::optional<core::CheckpointKey> key_;
  LogLimiter log_;
  const std::chrono::milliseconds timeout_;
  const std::chrono::milliseconds watch_interval_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> members_;
  std::map<std::string, Holdings> holdings_;
  std::map<std::string, SnapshotMessage> notices_;  // by origin: the newest not pulled yet
  bool pending_ = false;                            // an update not looked at yet
  bool frozen_ = false;
  bool busy_ = false;  // a pass is running
  bool stopping_ = false;
  std::atomic<bool> abandon_{false};
  std::atomic<std::size_t> copies_made_{0};
  std::atomic<std::int64_t> pull_floor_{-1};  // pull_after's step this round
  std::set<std::string> failed_;              // "<node>/<sha256>" whose copy failed (logged once)
  // The origins whose notify of a snapshot they had not published failed
  // to copy since the last update().
  std::set<std::string> unpublished_failed_;
  std::set<std::string> acknowledged_;  // "<node>/<sha256>" told its origin this round

  // The origin's side: what the successors acknowledged this round.
  mutable std::mutex ack_mutex_;
  bool in_round_ = false;
  std::vector<std::string> round_members_;
  std::string latest_seen_;             // own/latest's text last looked at
  std::set<std::string> before_round_;  // the sha256 of the own snapshots of earlier rounds
  std::map<std::string, std::int64_t> committed_;  // sha256 -> step, committed this round
  std::map<std::string, std::int64_t> acked_;      // successor -> newest step it holds
  std::string replicated_;                         // own/replicated's text last written
  std::condition_variable watch_stop_;
  bool watch_stopping_ = false;
  int watch_wake_ = -1;                     // an eventfd: wakes the watch's poll to stop
  std::atomic<bool> abandon_watch_{false};  // a notify in flight cut short: stopping
  std::thread thread_;
  std::thread watcher_;
};

}  // namespace ductile::agent
