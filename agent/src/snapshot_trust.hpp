// What an agent checks before it trusts a snapshot another node offers:
// the steps and world sizes a holdings record names (they must fit the
// job), and, when the job signs its checkpoints (DUCTILE_CHECKPOINT_KEY or
// DUCTILE_CHECKPOINT_KEY_FILE), a copied snapshot's manifest HMAC and the
// SHA-256 of each shard file the signed manifest records; and the log of
// failures that repeat, a line per interval. Internal to libductile_agent.
//
// Threading: the functions are pure, any thread; LogLimiter is for any
// thread. Errors: verify_signed_snapshot throws ductile::Error (io) naming
// the file and what is wrong.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "agent_common.hpp"
#include "ductile/core/files.hpp"
#include "snapshot_plan.hpp"

namespace ductile::agent {

// The snapshots a record of this job may name.
struct SnapshotBounds {
  // The world sizes a round of the job may have, ascending.
  std::vector<std::int64_t> worlds;
  // The newest step this node's workers committed or restored; none before
  // they committed one (no step is refused then).
  std::optional<std::int64_t> reached;
  // How far past `reached` another node's snapshot may be: the members'
  // workers commit the same steps, a node at most a snapshot or two ahead
  // of what this node listed last.
  std::int64_t ahead = 1;
};

// The world sizes of the job's rounds: n x nproc_per_node for n from
// min_nodes to max_nodes that valid_gpus holds (every n when it is empty).
std::vector<std::int64_t> job_world_sizes(const std::vector<std::int64_t>& valid_gpus,
                                          std::int64_t nproc_per_node, std::int64_t min_nodes,
                                          std::int64_t max_nodes);

// This node's own copies (newest first) and the step it restored last (-1:
// none): the bounds' `reached` and `ahead` (two snapshot intervals, the
// interval being the distance of its two newest own steps).
void note_reached(SnapshotBounds& bounds, const std::vector<SnapshotCopy>& own,
                  std::int64_t restored);

// "" when every copy of `holdings` fits `bounds`; otherwise the first copy
// that does not, its field and value and what would be valid
// ("\"own[0].world\" is 1; expected a world size of this job (2, 3)").
std::string holdings_problem(const Holdings& holdings, const SnapshotBounds& bounds);

// Checks the complete snapshot in `folder` against `key`: its
// manifest.json.hmac holds the HMAC-SHA256 of manifest.json's bytes under
// the key, and each rank file has the SHA-256 the manifest records for it.
void verify_signed_snapshot(const std::filesystem::path& folder, const core::CheckpointKey& key);

// A line per kind (a failure and what it concerns: "the copies of node b's
// snapshots") and interval: the first is logged, the others within the
// interval counted, and the next line logged says how many there were.
class LogLimiter {
 public:
  explicit LogLimiter(const NodeIdentity& self,
                      std::chrono::milliseconds interval = std::chrono::seconds(10))
      : self_(self), interval_(interval) {}
  void log(const std::string& kind, const std::string& line);

 private:
  struct Kind {
    std::chrono::steady_clock::time_point last;
    std::size_t unlogged = 0;
  };
  const NodeIdentity& self_;
  const std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::map<std::string, Kind> kinds_;
};

}  // namespace ductile::agent
