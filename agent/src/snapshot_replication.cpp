// Replicas pulled in the background, and whole snapshots copied from their
// holders. See snapshot_replication.hpp.
#include "snapshot_replication.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

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
// The longest wait for a notify's or a have's answer (the server answers
// at once).
constexpr std::chrono::milliseconds kMessageTimeout{5000};
// A replica's folder while it is copied beside a held one of the same tag.
constexpr const char* kNextSuffix = ".next";

// One file into the staging folder: hard-linked from this node's area (the
// same file system), else fetched from its holder. Its size is checked
// against `expected` when given, and `limit`.
void copy_snapshot_file(const SnapshotFileSource& source, const fs::path& to,
                        std::optional<std::uintmax_t> expected, std::uintmax_t limit,
                        const SnapshotAuth& auth, std::chrono::milliseconds timeout,
                        const std::atomic<bool>* abandon) {
  if (source.local.empty()) {
    fetch_file(source.host, source.port, source.relative, to, auth, timeout, expected, limit,
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
  struct stat info{};
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

// own/latest looked at this often when no inotify event came (a watch
// that missed one: own/ replaced under it).
constexpr std::chrono::milliseconds kWatchFallback{1000};
// Without inotify (a user may have 128 instances at most: the 129th agent
// of a user on one host has none), own/latest is looked at every
// watch_interval_ while the round's workers say they keep snapshots (their
// own/replicas), and for kWatchBusy after a commit seen; else every
// kWatchIdle: workers that commit nothing cost few wake-ups, and a first
// commit is seen within kWatchIdle.
constexpr std::chrono::milliseconds kWatchBusy{2000};
constexpr std::chrono::milliseconds kWatchIdle{100};

// A descriptor closed when the scope ends.
struct ClosedOnExit {
  int fd = -1;
  explicit ClosedOnExit(int opened) : fd(opened) {}
  ClosedOnExit(const ClosedOnExit&) = delete;
  ClosedOnExit& operator=(const ClosedOnExit&) = delete;
  ~ClosedOnExit() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace snapshot_replication_detail

using namespace snapshot_replication_detail;

void copy_snapshot(const std::vector<SnapshotFileSource>& sources, const fs::path& dest,
                   const std::string& sha256, const SnapshotAuth& auth,
                   std::chrono::milliseconds timeout, bool complete,
                   const std::atomic<bool>* abandon, const core::CheckpointKey* key) {
  fs::path staging = dest;
  staging += ".tmp";
  std::error_code ec;
  fs::remove_all(staging, ec);
  if (::mkdir(staging.c_str(), 0700) != 0)
    throw Error(ErrorKind::io, fmt::format("cannot make '{}' for a snapshot's copy: {}",
                                           staging.string(), std::strerror(errno)));
  try {
    // Each file's holders, in the order given.
    std::map<std::string, std::vector<const SnapshotFileSource*>> holders;
    for (const auto& source : sources) {
      if (!snapshot_file_name(source.file))
        throw Error(ErrorKind::io, fmt::format("'{}' is not a snapshot file", source.file));
      holders[source.file].push_back(&source);
    }
    // One holder after the other until one gives the file and `check`
    // accepts it; every holder's error when none does.
    auto copy_from_any = [&](const std::string& file, std::optional<std::uintmax_t> expected,
                             std::uintmax_t limit,
                             const std::function<void(const SnapshotFileSource&)>& check) {
      const auto& list = holders.at(file);
      std::vector<std::string> errors;
      for (const SnapshotFileSource* source : list) {
        try {
          copy_snapshot_file(*source, staging / file, expected, limit, auth, timeout, abandon);
          check(*source);
          return;
        } catch (const Error& e) {
          fs::remove(staging / file, ec);
          if (list.size() == 1 || (abandon && abandon->load())) throw;
          errors.push_back(e.what());
        }
      }
      throw Error(ErrorKind::io, fmt::format("'{}' of snapshot {} from none of its {} holders: {}",
                                             file, sha256, list.size(), fmt::join(errors, "; ")));
    };
    if (!holders.count(kSnapshotManifest))
      throw Error(ErrorKind::io, fmt::format("no holder of the manifest of snapshot {}", sha256));
    copy_from_any(
        kSnapshotManifest, std::nullopt, kMaxManifestBytes, [&](const SnapshotFileSource& source) {
          const auto actual = file_sha256(staging / kSnapshotManifest, kMaxManifestBytes);
          if (actual != sha256)
            throw Error(
                ErrorKind::io,
                fmt::format("the manifest copied from {} has SHA-256 {}, not the "
                            "snapshot's {}",
                            source.local.empty() ? fmt::format("{}:{}", source.host, source.port)
                                                 : source.local.string(),
                            actual.value_or("<unreadable>"), sha256));
        });
    const auto sizes = manifest_shard_sizes(staging / kSnapshotManifest);
    if (!sizes)
      throw Error(
          ErrorKind::io,
          fmt::format("the manifest of snapshot {} lists no shard files with their sizes", sha256));
    for (const auto& [file, list] : holders) {
      if (file == kSnapshotManifest) continue;
      std::int64_t world = 0;
      snapshot_file_name(file, &world);
      if (world != 0) {
        const auto size = sizes->find(file);
        if (size == sizes->end())
          throw Error(ErrorKind::io,
                      fmt::format("'{}' is not a shard file the manifest of snapshot {} lists",
                                  file, sha256));
        copy_from_any(file, size->second, size->second, [](const SnapshotFileSource&) {});
      } else {
        copy_from_any(file, std::nullopt, kMaxSidecarBytes, [](const SnapshotFileSource&) {});
      }
    }
    if (complete)
      for (const auto& [file, size] : *sizes)
        if (!holders.count(file))
          throw Error(ErrorKind::io, fmt::format("no holder of '{}' of snapshot {}", file, sha256));
    if (read_checksum_sidecar(staging / kSnapshotChecksum) != sha256)
      throw Error(ErrorKind::io,
                  fmt::format("the copy of snapshot {} has no sidecar {} naming its SHA-256",
                              sha256, kSnapshotChecksum));
    if (key) verify_signed_snapshot(staging, *key);
    if (::rename(staging.c_str(), dest.c_str()) != 0)
      throw Error(ErrorKind::io, fmt::format("cannot rename '{}' to '{}': {}", staging.string(),
                                             dest.string(), std::strerror(errno)));
  } catch (...) {
    fs::remove_all(staging, ec);
    throw;
  }
}

SnapshotReplication::SnapshotReplication(const SnapshotArea& area, const NodeIdentity& self,
                                         SnapshotAuth auth, std::chrono::milliseconds timeout,
                                         std::chrono::milliseconds watch_interval,
                                         std::optional<core::CheckpointKey> key)
    : area_(area),
      self_(self),
      auth_(std::move(auth)),
      key_(std::move(key)),
      log_(self),
      timeout_(timeout),
      watch_interval_(watch_interval),
      watch_wake_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  thread_ = std::thread([this] { run(); });
  watcher_ = std::thread([this] { watch(); });
}

SnapshotReplication::~SnapshotReplication() {
  {
    std::unique_lock lock(mutex_);
    stopping_ = true;
  }
  {
    std::unique_lock lock(ack_mutex_);
    watch_stopping_ = true;
  }
  abandon_ = true;
  abandon_watch_ = true;
  changed_.notify_all();
  watch_stop_.notify_all();
  const std::uint64_t one = 1;
  if (watch_wake_ >= 0) (void)!::write(watch_wake_, &one, sizeof(one));
  thread_.join();
  watcher_.join();
  if (watch_wake_ >= 0) ::close(watch_wake_);
}

void SnapshotReplication::update(std::vector<std::string> members,
                                 std::map<std::string, Holdings> holdings) {
  {
    std::unique_lock lock(mutex_);
    members_ = std::move(members);
    holdings_ = std::move(holdings);
    unpublished_failed_.clear();
    pending_ = true;
  }
  changed_.notify_all();
}

void SnapshotReplication::start_round(std::vector<std::string> members) {
  std::set<std::string> earlier;
  for (const auto& copy : list_snapshot_copies(area_.own(), false)) earlier.insert(copy.sha256);
  {
    std::unique_lock lock(mutex_);
    acknowledged_.clear();
  }
  pull_floor_ = -1;
  std::unique_lock lock(ack_mutex_);
  in_round_ = true;
  round_members_ = std::move(members);
  before_round_ = std::move(earlier);
  committed_.clear();
  acked_.clear();
  replicated_.clear();
  // What the workers committed before the round is not announced.
  latest_seen_ = read_small_file(area_.own() / kSnapshotLatest, kMaxSidecarBytes).value_or("");
  write_replicated();
}

std::vector<std::string> SnapshotReplication::successors() const {
  std::vector<std::string> out;
  const auto self = std::find(round_members_.begin(), round_members_.end(), self_.id);
  if (self == round_members_.end()) return out;
  const auto wanted = area_.replicas_wanted();
  const auto n = static_cast<std::int64_t>(round_members_.size());
  const auto i = static_cast<std::int64_t>(self - round_members_.begin());
  for (std::int64_t k = 1; wanted && k <= *wanted && k < n; ++k)
    out.push_back(round_members_[static_cast<std::size_t>((i + k) % n)]);
  return out;
}

void SnapshotReplication::write_replicated() {
  std::string text;
  const auto wanted = area_.replicas_wanted();
  if (round_members_.size() <= 1 || (wanted && *wanted == 0)) {
    text = "off\n";
  } else {
    const auto next = successors();
    std::int64_t step = next.empty() ? 0 : INT64_MAX;
    for (const auto& node : next) {
      const auto acked = acked_.find(node);
      step = std::min(step, acked == acked_.end() ? 0 : acked->second);
    }
    text = std::to_string(step) + "\n";
  }
  if (text == replicated_) return;
  // Renamed over the last one: the workers never read half of it.
  const fs::path file = area_.own() / kSnapshotReplicatedFile;
  fs::path staging = file;
  staging += ".tmp";
  const int fd =
      ::open(staging.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
  bool written =
      fd >= 0 && ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  if (fd >= 0) written = ::close(fd) == 0 && written;
  if (!written || ::rename(staging.c_str(), file.c_str()) != 0) {
    self_.log(fmt::format("cannot write '{}': {}", file.string(), std::strerror(errno)));
    ::unlink(staging.c_str());
    return;
  }
  replicated_ = text;
}

std::string SnapshotReplication::on_message(const SnapshotMessage& message) {
  if (message.kind == SnapshotMessage::Kind::notify) {
    if (message.origin == self_.id)
      return fmt::format("a notify of node {}'s own snapshot sent to node {} itself",
                         message.origin, self_.id);
    {
      std::unique_lock lock(ack_mutex_);
      // Not a member (yet): the periodic pull catches up.
      if (!in_round_ || std::find(round_members_.begin(), round_members_.end(), message.origin) ==
                            round_members_.end())
        return "";
    }
    std::string refused;
    {
      std::unique_lock lock(mutex_);
      const auto held = holdings_.find(message.origin);
      const std::vector<SnapshotCopy> none;
      const auto& own = held == holdings_.end() ? none : held->second.own;
      const bool published = std::any_of(own.begin(), own.end(), [&](const SnapshotCopy& c) {
        return c.tag == message.tag && c.sha256 == message.sha256;
      });
      // The origin's record follows its notify: a step newer than it
      // published is tried, its manifest checked first, until one fails.
      const auto step = snapshot_tag_step(message.tag);
      const bool newer = held != holdings_.end() && step && (own.empty() || *step > own[0].step);
      if (published || (newer && !unpublished_failed_.count(message.origin))) {
        notices_[message.origin] = message;
      } else {
        refused = fmt::format(
            "snapshot {} ({}) is not one node {} published (its snapshots/{} record){}",
            excerpt(message.tag, 80), excerpt(message.sha256, 80), message.origin, message.origin,
            newer ? ", and a copy of another snapshot it had not published failed since its "
                    "record was last read"
                  : "");
      }
    }
    if (!refused.empty()) {
      log_.log(fmt::format("the notifies refused of node {}", message.origin),
               fmt::format("refusing a notify: {}; nothing is copied", refused));
      return refused;
    }
    changed_.notify_all();
    return "";
  }
  if (message.origin != self_.id)
    return fmt::format("a have of node {}'s snapshot sent to node {}", message.origin, self_.id);
  std::unique_lock lock(ack_mutex_);
  if (!in_round_) return "";
  const auto next = successors();
  if (std::find(next.begin(), next.end(), message.holder) == next.end()) return "";
  std::int64_t step = 0;
  if (auto known = committed_.find(message.sha256); known != committed_.end()) {
    step = known->second;
  } else if (!before_round_.count(message.sha256) &&
             read_checksum_sidecar(area_.own() / message.tag / kSnapshotChecksum) ==
                 message.sha256) {
    // Committed this round, between two looks at own/latest.
    step = snapshot_tag_step(message.tag).value_or(0);
  } else {
    return "";  // a snapshot of an earlier round, or one no longer held
  }
  auto& acked = acked_[message.holder];
  acked = std::max(acked, step);
  write_replicated();
  return "";
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
  notices_.clear();
}

void SnapshotReplication::watch() {
  // own/latest is looked at when the kernel says a file of own/ was
  // written or renamed into place (the workers' commit), else every
  // kWatchFallback: an agent whose workers commit nothing wakes for
  // nothing. Without inotify, every watch_interval_ while the workers keep
  // snapshots or commit (kWatchBusy), else every kWatchIdle.
  ClosedOnExit changes(watch_wake_ >= 0 ? inotify_init1(IN_NONBLOCK | IN_CLOEXEC) : -1);
  if (changes.fd >= 0 &&
      inotify_add_watch(changes.fd, area_.own().c_str(), IN_MOVED_TO | IN_CLOSE_WRITE) < 0) {
    ::close(changes.fd);
    changes.fd = -1;
  }
  auto last_commit = std::chrono::steady_clock::now() - kWatchBusy;
  std::optional<std::string> last_latest;  // own/latest as last read here
  std::unique_lock lock(ack_mutex_);
  for (;;) {
    if (changes.fd < 0) {
      const bool busy = std::chrono::steady_clock::now() - last_commit < kWatchBusy ||
                        (in_round_ && area_.replicas_wanted().has_value());
      if (watch_stop_.wait_for(lock, busy ? watch_interval_ : kWatchIdle,
                               [this] { return watch_stopping_; }))
        return;
    } else {
      if (watch_stopping_) return;
      lock.unlock();
      pollfd fds[] = {{changes.fd, POLLIN, 0}, {watch_wake_, POLLIN, 0}};
      ::poll(fds, 2, static_cast<int>(kWatchFallback.count()));
      alignas(inotify_event) char events[4096];
      while (::read(changes.fd, events, sizeof(events)) > 0) {
      }
      lock.lock();
      if (watch_stopping_) return;
    }
    lock.unlock();
    const auto latest = read_small_file(area_.own() / kSnapshotLatest, kMaxSidecarBytes);
    lock.lock();
    if (latest != last_latest) {
      last_commit = std::chrono::steady_clock::now();
      last_latest = latest;
    }
    if (!latest || *latest == latest_seen_ || !in_round_) continue;
    const std::string tag = latest->substr(0, latest->find('\n'));
    lock.unlock();
    auto copy = snapshot_tag_step(tag) ? read_snapshot_copy(area_.own() / tag) : std::nullopt;
    lock.lock();
    if (!copy) continue;  // looked at again next time
    latest_seen_ = *latest;
    if (committed_.size() >= 64) committed_.erase(committed_.begin());
    committed_[copy->sha256] = copy->step;
    const auto next = successors();
    write_replicated();  // "off" when the workers keep no replicas
    lock.unlock();
    std::map<std::string, Holdings> holdings;
    {
      std::unique_lock pulls(mutex_);
      holdings = holdings_;
    }
    SnapshotMessage message;
    message.kind = SnapshotMessage::Kind::notify;
    message.origin = self_.id;
    message.tag = copy->tag;
    message.sha256 = copy->sha256;
    message.files = copy->files;
    for (const auto& node : next) {
      const auto held = holdings.find(node);
      if (held == holdings.end() || held->second.port <= 0) continue;  // the periodic pull
      try {
        send_snapshot_message(held->second.addr, held->second.port, message, auth_, kMessageTimeout,
                              &abandon_watch_);
      } catch (const Error& e) {
        log_.log(
            fmt::format("the announcements to node {}", node),
            fmt::format("cannot announce snapshot {} to node {}: {}", copy->tag, node, e.what()));
      }
    }
    lock.lock();
  }
}

void SnapshotReplication::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock,
                  [this] { return stopping_ || ((pending_ || !notices_.empty()) && !frozen_); });
    if (stopping_) return;
    const bool periodic = pending_;
    pending_ = false;
    busy_ = true;
    const auto members = members_;
    const auto holdings = holdings_;
    auto notices = std::move(notices_);
    notices_.clear();
    lock.unlock();
    try {
      // The announced snapshots first: their workers may wait for them.
      for (const auto& [origin, notice] : notices) {
        const auto from = holdings.find(origin);
        if (abandon_ || from == holdings.end() || from->second.port <= 0) continue;
        // A published snapshot's files are the record's.
        const auto& own = from->second.own;
        const auto published = std::find_if(own.begin(), own.end(), [&](const SnapshotCopy& c) {
          return c.tag == notice.tag && c.sha256 == notice.sha256;
        });
        SnapshotCopy copy;
        if (published != own.end()) {
          copy = *published;
        } else {
          copy.tag = notice.tag;
          copy.step = snapshot_tag_step(notice.tag).value_or(0);
          copy.sha256 = notice.sha256;
          copy.files = notice.files;
        }
        if (!pull(from->second, copy, published != own.end()) && published == own.end() &&
            failed_.count(origin + "/" + copy.sha256)) {
          std::unique_lock failed(mutex_);
          unpublished_failed_.insert(origin);
        }
      }
      while (periodic && !abandon_ && pull_once(members, holdings)) {
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
    // A record read before the origin's last notify: its newest snapshot
    // is held already, this one may be gone.
    const SnapshotCopy& newest = held->second.own.front();
    const auto replicas = list_snapshot_copies(area_.replicas() / node, false);
    if (!replicas.empty() && replicas.front().step > newest.step) continue;
    if (pull(held->second, newest, true)) return true;
  }
  return false;
}

bool SnapshotReplication::pull(const Holdings& from, const SnapshotCopy& copy, bool published) {
  const std::string& node = from.node;
  const std::string key = node + "/" + copy.sha256;
  if (node == self_.id || !valid_node_id(node) || failed_.count(key) ||
      !snapshot_tag_step(copy.tag) || copy.step <= pull_floor_)
    return false;
  const fs::path node_dir = area_.replicas() / node;
  const fs::path dest = node_dir / copy.tag;
  std::error_code ec;
  // Another snapshot of the same name (the steps after a restore count
  // again): the holder's newer one replaces it once it is verified, copied
  // beside it meanwhile.
  bool replaces = false;
  if (fs::exists(dest, ec)) {
    auto existing = read_snapshot_copy(dest);
    if (existing && existing->sha256 == copy.sha256) {
      acknowledge(from, copy);
      return false;
    }
    replaces = true;
  }
  fs::path into = dest;
  if (replaces) into += kNextSuffix;
  if (::mkdir(node_dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Error(ErrorKind::io,
                fmt::format("cannot make '{}': {}", node_dir.string(), std::strerror(errno)));
  // The oldest replica goes before the new one arrives, not after: no more
  // than kReplicasKeptPerNode of a node's snapshots are held at any moment.
  // The newest kept is the one every member can still restore: the workers
  // wait until it is replicated before the state changes again.
  prune(node_dir, kReplicasKeptPerNode - 1);
  std::vector<SnapshotFileSource> sources;
  for (const auto& file : copy.files)
    sources.push_back({file, from.addr, from.port, "own/" + copy.tag + "/" + file, {}});
  try {
    fs::remove_all(into, ec);  // a copy beside a held one, cut short
    copy_snapshot(sources, into, copy.sha256, auth_, timeout_, false, &abandon_,
                  key_ ? &*key_ : nullptr);
  } catch (const Error& e) {
    if (abandon_) return false;
    if (failed_.size() >= kMaxFailuresRemembered) failed_.clear();
    failed_.insert(key);
    // The origin no longer holds a snapshot it published: it removed it as
    // its successor committed, or as a restore left it behind (the record
    // this copy was asked from was read before). Nothing is lost that is
    // not superseded, and nothing is said. (A notify of a snapshot it never
    // published and does not hold is logged.)
    if (published && e.kind() == ErrorKind::not_found) return false;
    log_.log(fmt::format("the copies of node {}'s snapshots", node),
             fmt::format("cannot replicate snapshot {} of node {}: {}", copy.tag, node, e.what()));
    return false;
  }
  if (replaces) {
    fs::remove_all(dest, ec);
    if (::rename(into.c_str(), dest.c_str()) != 0) {
      const int error = errno;
      fs::remove_all(into, ec);
      throw Error(ErrorKind::io, fmt::format("cannot rename '{}' to '{}': {}", into.string(),
                                             dest.string(), std::strerror(error)));
    }
  }
  ++copies_made_;
  acknowledge(from, copy);
  return true;
}

void SnapshotReplication::acknowledge(const Holdings& origin, const SnapshotCopy& copy) {
  const std::string key = origin.node + "/" + copy.sha256;
  {
    std::unique_lock lock(mutex_);
    if (acknowledged_.count(key)) return;
    if (acknowledged_.size() >= kMaxFailuresRemembered) acknowledged_.clear();
  }
  SnapshotMessage message;
  message.kind = SnapshotMessage::Kind::have;
  message.holder = self_.id;
  message.origin = origin.node;
  message.tag = copy.tag;
  message.sha256 = copy.sha256;
  try {
    send_snapshot_message(origin.addr, origin.port, message, auth_, kMessageTimeout, &abandon_);
  } catch (const Error& e) {
    if (abandon_) return;  // told at the next pass
    // Not tried again for this snapshot (the origin is gone, or refuses):
    // its next snapshot's copy is acknowledged anew.
    log_.log(fmt::format("the acknowledgements to node {}", origin.node),
             fmt::format("cannot tell node {} that its snapshot {} is replicated: {}", origin.node,
                         copy.tag, e.what()));
  }
  std::unique_lock lock(mutex_);
  acknowledged_.insert(key);
}

void SnapshotReplication::prune(const fs::path& node_dir, std::size_t keep) {
  std::vector<std::pair<std::int64_t, std::string>> folders;
  std::vector<std::string> stale;  // copies cut short (none runs now)
  std::error_code ec;
  fs::directory_iterator it(node_dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (auto step = snapshot_tag_step(name))
      folders.emplace_back(*step, name);
    else if (name.ends_with(".tmp") || name.ends_with(kNextSuffix))
      stale.push_back(name);
  }
  std::sort(folders.begin(), folders.end(), std::greater<>());
  for (std::size_t i = keep; i < folders.size(); ++i) stale.push_back(folders[i].second);
  for (const auto& name : stale) fs::remove_all(node_dir / name, ec);
}

}  // namespace ductile::agent
