// Replicas of the other nodes' snapshots, pulled in the background, and
// the copy of one whole snapshot from its holders (a replica, a restore).
// Internal to libductile_agent; owned by Agent (agent_impl.hpp).
//
// During a round, with R the workers' snapshot_replicas (own/replicas),
// the member at group index i of n pulls, for k = 1..R (k < n), the newest
// committed own snapshot of member (i - k) mod n into
// replicas/<node>/<tag>/ (staged in <tag>.tmp, then renamed; checked
// against the manifest's SHA-256 and the sizes the manifest gives), and
// keeps the 2 newest of each node.
//
// Threading: SnapshotReplication runs one thread of its own; its public
// functions are for the agent's thread. Errors: a copy that fails is
// logged and not tried again (the holder's next snapshot is);
// copy_snapshot throws ductile::Error (io).
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
// copied (or hard-linked, when local) into `dest`.tmp, the manifest first
// and checked against `sha256` and its sidecar, each rank file's size
// against the manifest's (with `complete`, every shard file the manifest
// lists must be among them); then renamed to `dest`. `timeout`: the longest
// wait without progress; `abandon`, when set, stops the copy. Throws
// ductile::Error (io) naming the file and the problem (the staging folder
// is then removed).
void copy_snapshot(const std::vector<SnapshotFileSource>& sources,
                   const std::filesystem::path& dest, const std::string& sha256,
                   const std::string& secret, std::chrono::milliseconds timeout, bool complete,
                   const std::atomic<bool>* abandon = nullptr);

class SnapshotReplication {
 public:
  SnapshotReplication(const SnapshotArea& area, const NodeIdentity& self, std::string secret,
                      std::chrono::milliseconds timeout = std::chrono::seconds(30));
  // Stops the thread (an in-flight copy is abandoned).
  ~SnapshotReplication();
  SnapshotReplication(const SnapshotReplication&) = delete;
  SnapshotReplication& operator=(const SnapshotReplication&) = delete;

  // The round's members in group order and the live holdings read from
  // the rendezvous (by node); the thread pulls what they call for.
  void update(std::vector<std::string> members, std::map<std::string, Holdings> holdings);
  // Pulls nothing more and waits (up to `wait`) for the copy in flight to
  // end or be abandoned; true when none is in flight any longer.
  bool freeze(std::chrono::milliseconds wait);
  // Pulls again from the next update() on.
  void thaw();
  // Copies finished so far (a test's and the log's count).
  std::size_t copies_made() const { return copies_made_.load(); }

 private:
  void run();
  // One pass over the members: the first replica missing pulled; true when
  // one was pulled (another may be missing).
  bool pull_once(const std::vector<std::string>& members,
                 const std::map<std::string, Holdings>& holdings);
  void prune(const std::filesystem::path& node_dir);

  const SnapshotArea& area_;
  const NodeIdentity& self_;
  const std::string secret_;
  const std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::string> members_;
  std::map<std::string, Holdings> holdings_;
  bool pending_ = false;  // an update not looked at yet
  bool frozen_ = false;
  bool busy_ = false;  // a pass is running
  bool stopping_ = false;
  std::atomic<bool> abandon_{false};
  std::atomic<std::size_t> copies_made_{0};
  std::set<std::string> failed_;  // "<node>/<sha256>" whose copy failed (logged once)
  std::thread thread_;
};

}  // namespace ductile::agent
