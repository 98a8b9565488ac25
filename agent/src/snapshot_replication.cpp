// Replicas pulled in the background, and whole snapshots copied from their
// holders. See snapshot_replication.hpp.
#include "snapshot_replication.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "ductile/error.hpp"
#include "snapshot_server.hpp"

namespace ductile::agent {

namespace fs = std::filesystem;

// Not an anonymous namespace: a unity build puts several of the library's
// files into one translation unit, where their helpers' names would clash.
namespace snapshot_replication_detail {

// Failed copies remembered (not tried again); past it the memory is
// cleared.
constexpr std::size_t kMaxFailuresRemembered = 1024;

// One file into the staging folder: hard-linked from this node's area (the
// same file system), else fetched from its holder. Its size is checked
// against `expected` when given, and `limit`.
void copy_snapshot_file(const SnapshotFileSource& source, const fs::path& to,
                        std::optional<std::uintmax_t> expected, std::uintmax_t limit,
                        const std::string& secret, std::chrono::milliseconds timeout,
                        const std::atomic<bool>* abandon) {
  if (source.local.empty()) {
    fetch_file(source.host, source.port, source.relative, to, secret, timeout, expected, limit,
               abandon);
    return;
  }
  // link() never follows a link: a link in the area stays one, refused
  // below.
  if (::link(source.local.c_str(), to.c_str()) != 0) {
    std::error_code ec;
    if (fs::symlink_status(source.local, ec).type() != fs::file_type::regular ||
        !fs::copy_file(source.local, to, ec))
      throw Error(ErrorKind::io,
                  fmt::format("cannot copy '{}' to '{}': {}", source.local.string(), to.string(),
                              ec ? ec.message() : "not a regular file"));
  }
  struct stat info {};
  if (::lstat(to.c_str(), &info) != 0 || !S_ISREG(info.st_mode))
    throw Error(ErrorKind::io, fmt::format("'{}' is not a regular file: refused as a snapshot file",
                                           source.local.string()));
  const auto size = static_cast<std::uintmax_t>(info.st_size);
  if ((expected && size != *expected) || size > limit)
    throw Error(
        ErrorKind::io,
        fmt::format("'{}' has {} bytes, not the {} its manifest gives", source.local.string(), size,
                    expected ? std::to_string(*expected) : "at most " + std::to_string(limit)));
}

}  // namespace snapshot_replication_detail

using namespace snapshot_replication_detail;

void copy_snapshot(const std::vector<SnapshotFileSource>& sources, const fs::path& dest,
                   const std::string& sha256, const std::string& secret,
                   std::chrono::milliseconds timeout, bool complete,
                   const std::atomic<bool>* abandon) {
  fs::path staging = dest;
  staging += ".tmp";
  std::error_code ec;
  fs::remove_all(staging, ec);
  if (::mkdir(staging.c_str(), 0700) != 0)
    throw Error(ErrorKind::io, fmt::format("cannot make '{}' for a snapshot's copy: {}",
                                           staging.string(), std::strerror(errno)));
  try {
    auto manifest = std::find_if(sources.begin(), sources.end(), [](const SnapshotFileSource& s) {
      return s.file == kSnapshotManifest;
    });
    if (manifest == sources.end())
      throw Error(ErrorKind::io, fmt::format("no holder of the manifest of snapshot {}", sha256));
    copy_snapshot_file(*manifest, staging / kSnapshotManifest, std::nullopt, kMaxManifestBytes,
                       secret, timeout, abandon);
    const auto actual = file_sha256(staging / kSnapshotManifest, kMaxManifestBytes);
    if (actual != sha256)
      throw Error(
          ErrorKind::io,
          fmt::format("the manifest copied from {} has SHA-256 {}, not the snapshot's {}",
                      manifest->local.empty() ? fmt::format("{}:{}", manifest->host, manifest->port)
                                              : manifest->local.string(),
                      actual.value_or("<unreadable>"), sha256));
    const auto sizes = manifest_shard_sizes(staging / kSnapshotManifest);
    if (!sizes)
      throw Error(
          ErrorKind::io,
          fmt::format("the manifest of snapshot {} lists no shard files with their sizes", sha256));
    std::set<std::string> copied;
    for (const auto& source : sources) {
      if (source.file == kSnapshotManifest) continue;
      std::int64_t world = 0;
      if (!snapshot_file_name(source.file, &world) || !copied.insert(source.file).second)
        throw Error(ErrorKind::io,
                    fmt::format("'{}' is not a snapshot file (or is listed twice)", source.file));
      if (world != 0) {
        const auto size = sizes->find(source.file);
        if (size == sizes->end())
          throw Error(ErrorKind::io,
                      fmt::format("'{}' is not a shard file the manifest of snapshot {} lists",
                                  source.file, sha256));
        copy_snapshot_file(source, staging / source.file, size->second, size->second, secret,
                           timeout, abandon);
      } else {
        copy_snapshot_file(source, staging / source.file, std::nullopt, kMaxSidecarBytes, secret,
                           timeout, abandon);
      }
    }
    if (complete)
      for (const auto& [file, size] : *sizes)
        if (!copied.count(file))
          throw Error(ErrorKind::io, fmt::format("no holder of '{}' of snapshot {}", file, sha256));
    if (read_checksum_sidecar(staging / kSnapshotChecksum) != sha256)
      throw Error(ErrorKind::io,
                  fmt::format("the copy of snapshot {} has no sidecar {} naming its SHA-256",
                              sha256, kSnapshotChecksum));
    if (::rename(staging.c_str(), dest.c_str()) != 0)
      throw Error(ErrorKind::io, fmt::format("cannot rename '{}' to '{}': {}", staging.string(),
                                             dest.string(), std::strerror(errno)));
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
}

SnapshotReplication::SnapshotReplication(const SnapshotArea& area, const NodeIdentity& self,
                                         std::string secret, std::chrono::milliseconds timeout)
    : area_(area), self_(self), secret_(std::move(secret)), timeout_(timeout) {
  thread_ = std::thread([this] { run(); });
}

SnapshotReplication::~SnapshotReplication() {
  {
    std::unique_lock lock(mutex_);
    stopping_ = true;
  }
  abandon_ = true;
  changed_.notify_all();
  thread_.join();
}

void SnapshotReplication::update(std::vector<std::string> members,
                                 std::map<std::string, Holdings> holdings) {
  {
    std::unique_lock lock(mutex_);
    members_ = std::move(members);
    holdings_ = std::move(holdings);
    pending_ = true;
  }
  changed_.notify_all();
}

bool SnapshotReplication::freeze(std::chrono::milliseconds wait) {
  std::unique_lock lock(mutex_);
  frozen_ = true;
  abandon_ = true;
  return changed_.wait_for(lock, wait, [this] { return !busy_; });
}

void SnapshotReplication::thaw() {
  std::unique_lock lock(mutex_);
  frozen_ = false;
  abandon_ = false;
  pending_ = false;  // the holdings of before the freeze are stale
}

void SnapshotReplication::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [this] { return stopping_ || (pending_ && !frozen_); });
    if (stopping_) return;
    pending_ = false;
    busy_ = true;
    const auto members = members_;
    const auto holdings = holdings_;
    lock.unlock();
    try {
      while (!abandon_ && pull_once(members, holdings)) {
      }
    } catch (const std::exception& e) {
      // The area's file system failing: the agent goes on without
      // replicas of this pass.
      self_.log(fmt::format("snapshot replication: {}", e.what()));
    }
    lock.lock();
    busy_ = false;
    changed_.notify_all();
  }
}

bool SnapshotReplication::pull_once(const std::vector<std::string>& members,
                                    const std::map<std::string, Holdings>& holdings) {
  const auto wanted = area_.replicas_wanted();
  if (!wanted || *wanted <= 0) return false;
  const auto self = std::find(members.begin(), members.end(), self_.id);
  if (self == members.end()) return false;
  const auto n = static_cast<std::int64_t>(members.size());
  const auto i = static_cast<std::int64_t>(self - members.begin());
  for (std::int64_t k = 1; k <= *wanted && k < n; ++k) {
    const std::string& node = members[static_cast<std::size_t>(((i - k) % n + n) % n)];
    const auto held = holdings.find(node);
    if (node == self_.id || !valid_node_id(node) || held == holdings.end() ||
        held->second.own.empty() || held->second.port <= 0)
      continue;
    const SnapshotCopy& copy = held->second.own.front();
    const std::string key = node + "/" + copy.sha256;
    if (failed_.count(key) || !snapshot_tag_step(copy.tag)) continue;
    const fs::path node_dir = area_.replicas() / node;
    const fs::path dest = node_dir / copy.tag;
    std::error_code ec;
    if (fs::exists(dest, ec)) {
      auto existing = read_snapshot_copy(dest);
      if (existing && existing->sha256 == copy.sha256) continue;
      // Another snapshot of the same name (the steps after a restore
      // count again): the holder's newer one replaces it.
      fs::remove_all(dest, ec);
    }
    if (::mkdir(node_dir.c_str(), 0700) != 0 && errno != EEXIST)
      throw Error(ErrorKind::io,
                  fmt::format("cannot make '{}': {}", node_dir.string(), std::strerror(errno)));
    std::vector<SnapshotFileSource> sources;
    for (const auto& file : copy.files)
      sources.push_back(
          {file, held->second.addr, held->second.port, "own/" + copy.tag + "/" + file, {}});
    try {
      copy_snapshot(sources, dest, copy.sha256, secret_, timeout_, false, &abandon_);
    } catch (const Error& e) {
      if (abandon_) return false;
      if (failed_.size() >= kMaxFailuresRemembered) failed_.clear();
      failed_.insert(key);
      self_.log(
          fmt::format("cannot replicate snapshot {} of node {}: {}", copy.tag, node, e.what()));
      continue;
    }
    ++copies_made_;
    prune(node_dir);
    return true;
  }
  return false;
}

void SnapshotReplication::prune(const fs::path& node_dir) {
  std::vector<std::pair<std::int64_t, std::string>> folders;
  std::vector<std::string> stale;  // copies cut short (none runs now)
  std::error_code ec;
  fs::directory_iterator it(node_dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (auto step = snapshot_tag_step(name))
      folders.emplace_back(*step, name);
    else if (name.ends_with(".tmp"))
      stale.push_back(name);
  }
  std::sort(folders.begin(), folders.end(), std::greater<>());
  for (std::size_t i = kReplicasKeptPerNode; i < folders.size(); ++i)
    stale.push_back(folders[i].second);
  for (const auto& name : stale) fs::remove_all(node_dir / name, ec);
}

}  // namespace ductile::agent
