// This node's snapshot area: the private directory where its workers write
// their in-memory snapshots (own/), where the agent keeps the replicas it
// pulled of other nodes' snapshots (replicas/<node>/<tag>/) and where it
// assembles a snapshot to restore (restore/<tag>/). Created when the agent
// starts, removed when it leaves. Internal to libductile_agent.
//
// The area is <base>/ductile-snapshots-<job id>-<node id>-<pid>-<random>
// (each agent's own, even for two agents of one job and node id), base
// being --snapshot-dir or, by default, /dev/shm when it is a directory
// (tmpfs: memory, not disk), else the system's temporary directory.
//
// An agent holds an exclusive flock on <area>/lock all its life; the area
// is made under a hidden name and renamed once locked. When an area is
// made, every ductile-snapshots-* directory in the same base that is this
// user's, of mode 0700, with a lock no one holds (its agent was killed) is
// removed; a live agent's is left alone. The base's other entries, however
// many, are passed over by name.
//
// Ownership: SnapshotArea owns the directory and removes it (with what is
// in it) when destroyed or remove()d. Threading: the listing functions
// only read the file system and may run on any thread; a folder removed
// while it is listed is left out. Errors: the constructor throws
// ductile::Error (invalid_argument) when `base` is not a directory, (io)
// when the area cannot be made or locked, naming it and --snapshot-dir.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "snapshot_plan.hpp"

namespace ductile::agent {

// The bounds of the search for dead agents' areas in a base.
inline constexpr std::size_t kMaxSnapshotBaseEntries = 10'000'000;
inline constexpr std::size_t kMaxSnapshotAreasSearched = 4096;

// Names in the area: what the workers write, and the folders the agent
// makes.
inline constexpr const char* kSnapshotManifest = "manifest.json";
inline constexpr const char* kSnapshotChecksum = "manifest.json.sha256";
inline constexpr const char* kSnapshotHmac = "manifest.json.hmac";
inline constexpr const char* kSnapshotLatest = "latest";
inline constexpr const char* kSnapshotReplicasFile = "replicas";
// Written by the agent for its workers: the newest step the round's
// successors hold a replica of ("<step>\n"), or "off\n" (snapshot_replication.hpp).
inline constexpr const char* kSnapshotReplicatedFile = "replicated";
// Written by the workers' leader after a restore ("<step>\n"), once a newer
// snapshot is held by its replicas everywhere: the restored copy and the
// snapshots up to that step are freed, and the file removed (the workers
// wait for that before they write their next snapshot).
inline constexpr const char* kSnapshotReleaseFile = "release";
// Held (flock, exclusive) by the agent that owns the area, all its life.
inline constexpr const char* kSnapshotLockFile = "lock";
// The largest manifest (or sidecar, or pointer) the agent reads.
inline constexpr std::uintmax_t kMaxManifestBytes = 64u << 20;
inline constexpr std::uintmax_t kMaxSidecarBytes = 4096;

// A regular file (never a link's target, never blocked on) of at most
// `limit` bytes; none when it is not one or cannot be read.
std::optional<std::string> read_small_file(const std::filesystem::path& file, std::uintmax_t limit);
// A snapshot folder's name: "step<N>" (or "step<N>.<k>", the name a save
// gives a tag that exists already); its step, or none.
std::optional<std::int64_t> snapshot_tag_step(const std::string& tag);
// A file a snapshot folder may hold: the manifest, its sidecars, or a
// rank file "rank<r>-of-<W>.bin" (r < W); `world` is set to W for a rank
// file.
bool snapshot_file_name(const std::string& name, std::int64_t* world = nullptr);
// The committed copy in `folder` (named `tag`), with `sha256` checked
// against its sidecar when given; none when it is not one (no sidecar, no
// rank file, rank files of two world sizes, a file of another name, more
// than kMaxSnapshotFiles).
std::optional<SnapshotCopy> read_snapshot_copy(const std::filesystem::path& folder);
// The copies in `dir` (one folder each), newest first, at most
// kMaxSnapshotCopies. With `latest` (a workers' root): only the folder
// `latest` names and those of older steps are committed; without: every
// folder but a staging one (".tmp").
std::vector<SnapshotCopy> list_snapshot_copies(const std::filesystem::path& dir, bool latest);
// The hex SHA-256 of a file of at most `limit` bytes; none when it cannot
// be read or is larger.
std::optional<std::string> file_sha256(const std::filesystem::path& file, std::uintmax_t limit);
// The hex SHA-256 a sidecar ("<hex>  manifest.json") names; none when it
// is not one.
std::optional<std::string> read_checksum_sidecar(const std::filesystem::path& file);
// The shard files a manifest lists and their sizes ({"shards": [{"file",
// "bytes"}]}); none when the manifest is not one.
std::optional<std::map<std::string, std::uintmax_t>> manifest_shard_sizes(
    const std::filesystem::path& manifest);

class SnapshotArea {
 public:
  // Makes the area (see above). `base`: --snapshot-dir, empty for the
  // default.
  SnapshotArea(const std::string& base, const std::string& job_id, const std::string& node_id);
  ~SnapshotArea();
  SnapshotArea(const SnapshotArea&) = delete;
  SnapshotArea& operator=(const SnapshotArea&) = delete;

  const std::filesystem::path& root() const { return root_; }
  std::filesystem::path own() const { return root_ / "own"; }
  std::filesystem::path replicas() const { return root_ / "replicas"; }
  std::filesystem::path restore() const { return root_ / "restore"; }

  // The workers' committed snapshots, newest first.
  std::vector<SnapshotCopy> own_copies() const { return list_snapshot_copies(own(), true); }
  // The replicas held, by the node they are of (at most
  // kMaxReplicatedNodes), each newest first.
  std::map<std::string, std::vector<SnapshotCopy>> replica_copies() const;
  // The workers' snapshot_replicas (own/replicas); none before they wrote
  // it, or when it is not a count.
  std::optional<std::int64_t> replicas_wanted() const;
  // Removes the area and what it holds (idempotent).
  void remove();
  // The areas of dead agents removed when this one was made (see above).
  const std::vector<std::filesystem::path>& removed_stale() const { return removed_stale_; }
  // False when the search for dead agents' areas stopped at a bound (more
  // than kMaxSnapshotAreasSearched areas, or kMaxSnapshotBaseEntries
  // entries in the base).
  bool stale_search_complete() const { return stale_search_complete_; }

 private:
  std::filesystem::path root_;
  bool removed_ = false;
  int lock_fd_ = -1;  // <root>/lock, flocked while the area lives
  std::vector<std::filesystem::path> removed_stale_;
  bool stale_search_complete_ = true;
};

}  // namespace ductile::agent
