// The agent's etcd, read from a mirror of its job's keys kept by a watch.
// See store_mirror.hpp.
#include "store_mirror.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <limits>

#include <fmt/format.h>

namespace ductile::agent {

namespace store_mirror_detail {

using std::chrono::milliseconds;

// The first wait before the watch is tried again, and the longest.
constexpr milliseconds kFirstRetry{100};
constexpr milliseconds kLongestRetry{2000};
// Changes remembered for changes_fd() (those between a read and the call).
constexpr std::size_t kRecentChanges = 4096;

bool under_any(const std::string& key, const std::vector<std::string>& prefixes) {
  return std::any_of(prefixes.begin(), prefixes.end(),
                     [&](const std::string& p) { return key.starts_with(p); });
}

std::size_t bytes_of(const KeyValue& kv) {
  return kv.key.size() + kv.value.size() + 64;
}

// Each range's keys, read, by key, and their bytes as bytes_of() counts them.
std::pair<std::map<std::string, KeyValue>, std::size_t> by_key(
    std::vector<std::vector<KeyValue>>& read) {
  std::pair<std::map<std::string, KeyValue>, std::size_t> out;
  for (auto& kvs : read)
    for (auto& kv : kvs) {
      out.second += bytes_of(kv);
      out.first.emplace(kv.key, std::move(kv));
    }
  return out;
}

}  // namespace store_mirror_detail

using namespace store_mirror_detail;

MirroredStore::MirroredStore(std::unique_ptr<EtcdStore> store, StoreFactory make_watch_store,
                             std::vector<KeyRange> ranges, milliseconds catch_up,
                             std::function<void(const std::string&)> log)
    : store_(std::move(store)),
      watch_store_(make_watch_store()),
      wanted_(ranges),
      catch_up_(catch_up),
      log_(std::move(log)),
      pending_(std::move(ranges)),
      repending_(true),
      wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  thread_ = std::thread([this] { run(); });
}

MirroredStore::~MirroredStore() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
    leave_watch_ = true;
  }
  changed_.notify_all();
  watch_store_->interrupt_watch();
  thread_.join();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void MirroredStore::follow(std::vector<KeyRange> ranges) {
  with_next_swap_.clear();
  if (ranges == wanted_) return;
  wanted_ = ranges;
  {
    std::lock_guard lock(mutex_);
    pending_ = std::move(ranges);
    repending_ = true;
    pending_held_ = false;
    live_ = false;
    starting_ = false;
    leave_watch_ = true;
  }
  changed_.notify_all();
  watch_store_->interrupt_watch();
}

void MirroredStore::follow_with_next_swap(std::vector<KeyRange> ranges) {
  if (ranges == wanted_) return;
  with_next_swap_ = std::move(ranges);
}

void MirroredStore::hold(const std::vector<KeyRange>& ranges, std::map<std::string, KeyValue> keys,
                         std::size_t bytes, std::int64_t revision) {
  keys_ = std::move(keys);
  bytes_ = bytes;
  // What a range kept still must show stays; a new range's read shows
  // everything up to `revision`.
  std::vector<Followed> followed;
  for (const auto& range : ranges) {
    Followed f{range, revision, 0, revision};
    for (const auto& old : followed_)
      if (old.range == range) f.needed = old.needed;
    followed.push_back(std::move(f));
  }
  followed_ = std::move(followed);
  ++generation_;
  // What changed in between is not known key by key.
  recent_.clear();
  recent_floor_ = revision;
  if (wake_armed_) wake();
}

void MirroredStore::run() {
  milliseconds retry = kFirstRetry;
  bool resync = true;
  std::vector<KeyRange> ranges;
  while (!stop_) {
    try {
      {
        std::lock_guard lock(mutex_);
        if (repending_) {
          ranges = pending_;
          repending_ = false;
          leave_watch_ = false;
          resync = !std::exchange(pending_held_, false);
        }
      }
      if (resync && ranges.empty()) {
        std::lock_guard lock(mutex_);
        if (repending_) continue;
        hold(ranges, {}, 0, 0);
        resync = false;
      }
      if (resync) {
        ++range_reads_;
        auto [read, revision] = watch_store_->read_ranges_at(ranges);
        auto [keys, bytes] = by_key(read);
        std::lock_guard lock(mutex_);
        if (keys.size() > kMaxMirroredKeys || bytes > kMaxMirroredBytes) {
          over_bound_ = true;
          break;
        }
        if (repending_) continue;  // asked for other ranges meanwhile
        hold(ranges, std::move(keys), bytes, revision);
        resync = false;
      }
      std::int64_t from = 0;
      {
        std::lock_guard lock(mutex_);
        // Each range resumes after its own last change: one start for all,
        // the oldest (a change seen again is applied again, to no effect).
        from = std::numeric_limits<std::int64_t>::max();
        for (const auto& f : followed_) from = std::min(from, f.revision + 1);
      }
      if (ranges.empty()) {
        // Nothing to follow: the thread waits for follow() or the end.
        std::unique_lock lock(mutex_);
        live_ = true;
        changed_.notify_all();
        changed_.wait(lock, [this] { return stop_.load() || repending_; });
        live_ = false;
        continue;
      }
      watch_store_->watch(
          ranges, from,
          [&](const WatchMessage& message) {
            if (message.compact_revision > 0 || message.canceled) {
              resync = true;  // the changes since a revision held are gone: read them all again
              return false;
            }
            std::lock_guard lock(mutex_);
            if (repending_) return false;
            live_ = true;
            starting_ = false;
            retry = kFirstRetry;
            for (const auto& event : message.events) {
              const int at_range = range_of(event.kv.key);
              if (at_range < 0) continue;
              Followed& f = followed_[static_cast<std::size_t>(at_range)];
              auto at = keys_.find(event.kv.key);
              if (at != keys_.end()) {
                bytes_ -= bytes_of(at->second);
                keys_.erase(at);
              }
              if (!event.deleted) {
                bytes_ += bytes_of(event.kv);
                keys_.emplace(event.kv.key, event.kv);
              }
              f.revision = std::max(f.revision, event.kv.mod_revision);
              recent_.emplace_back(event.kv.mod_revision, event.kv.key);
              if (recent_.size() > kRecentChanges) {
                recent_floor_ = recent_.front().first;
                recent_.pop_front();
              }
              if (wake_armed_ && event.kv.mod_revision > f.read_at &&
                  under_any(event.kv.key, wake_prefixes_))
                wake();
            }
            if (keys_.size() > kMaxMirroredKeys || bytes_ > kMaxMirroredBytes) {
              over_bound_ = true;
              live_ = false;
            }
            changed_.notify_all();
            return !over_bound_;
          },
          leave_watch_);
    } catch (const StoreError&) {
      // etcd unreachable or restarting: reads go to etcd meanwhile (and see
      // the outage as the agent always did); the watch resumes from the
      // revisions held.
    }
    std::unique_lock lock(mutex_);
    live_ = false;
    if (starting_) {
      starting_ = false;  // reads waiting for the watch go to etcd
      changed_.notify_all();
    }
    if (over_bound_) break;
    if (repending_) continue;
    changed_.wait_for(lock, retry, [this] { return stop_.load() || repending_; });
    retry = std::min(retry * 2, kLongestRetry);
  }
  std::unique_lock lock(mutex_);
  live_ = false;
  if (over_bound_) {
    keys_.clear();
    bytes_ = 0;
    lock.unlock();
    log_(fmt::format(
        "the job's keys the agent follows are over {} keys or {} MiB: the agent reads them "
        "from etcd at each pass instead of following them",
        kMaxMirroredKeys, kMaxMirroredBytes >> 20));
  }
}

int MirroredStore::range_of(const std::string& key) const {
  for (std::size_t i = 0; i < followed_.size(); ++i)
    if (followed_[i].range.contains(key)) return static_cast<int>(i);
  return -1;
}

int MirroredStore::range_of(const RangeRead& read) const {
  if (!read.prefix) return range_of(read.key);
  const KeyRange wanted = prefix_range(read.key);
  for (std::size_t i = 0; i < followed_.size(); ++i) {
    const KeyRange& r = followed_[i].range;
    if (wanted.key >= r.key && wanted.end <= r.end) return static_cast<int>(i);
  }
  return -1;
}

bool MirroredStore::caught_up(std::unique_lock<std::mutex>& lock, const std::vector<int>& ranges) {
  auto ready = [&] {
    if (!live_) return !starting_;  // decided: not from the mirror; or the watch starts
    return std::all_of(ranges.begin(), ranges.end(), [&](int i) {
      const Followed& f = followed_[static_cast<std::size_t>(i)];
      return f.revision >= f.needed;
    });
  };
  if (!live_ && !starting_) return false;
  return changed_.wait_for(lock, catch_up_, ready) && live_;
}

std::vector<KeyValue> MirroredStore::answer(const RangeRead& read) const {
  std::vector<KeyValue> out;
  if (!read.prefix) {
    if (auto at = keys_.find(read.key); at != keys_.end()) out.push_back(at->second);
    return out;
  }
  // The keys are ranked by pointer, and only those answered are copied: a
  // pass asks for the oldest few of many registrations.
  std::vector<const KeyValue*> found;
  for (auto at = keys_.lower_bound(read.key); at != keys_.end() && at->first.starts_with(read.key);
       ++at)
    found.push_back(&at->second);
  std::size_t count = found.size();
  if (read.limit > 0) count = std::min(count, static_cast<std::size_t>(read.limit));
  if (read.oldest_first) {
    // Create revisions are unique: no two keys tie.
    std::partial_sort(found.begin(), found.begin() + static_cast<std::ptrdiff_t>(count),
                      found.end(), [](const KeyValue* a, const KeyValue* b) {
                        return a->create_revision < b->create_revision;
                      });
  }
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) out.push_back(*found[i]);
  return out;
}

std::vector<std::vector<KeyValue>> MirroredStore::read(const std::vector<RangeRead>& reads) {
  {
    std::unique_lock lock(mutex_);
    std::vector<int> ranges;
    bool mirrored = live_ || starting_;
    for (const auto& r : reads) {
      const int i = range_of(r);
      if (i < 0) mirrored = false;
      ranges.push_back(i);
    }
    const std::uint64_t generation = generation_;
    if (mirrored && caught_up(lock, ranges) && generation == generation_) {
      std::vector<std::vector<KeyValue>> out;
      for (const auto& r : reads) out.push_back(answer(r));
      for (auto& f : followed_) f.read_at = f.revision;
      ++mirrored_reads_;
      return out;
    }
  }
  ++direct_reads_;
  auto out = store_->read(reads);
  read_directly(out);
  return out;
}

void MirroredStore::read_directly(const std::vector<std::vector<KeyValue>>& out) {
  // A later read from the mirror shows these records or newer ones.
  std::lock_guard lock(mutex_);
  for (const auto& result : out)
    for (const auto& kv : result)
      if (const int i = range_of(kv.key); i >= 0) {
        auto& f = followed_[static_cast<std::size_t>(i)];
        f.needed = std::max(f.needed, kv.mod_revision);
      }
}

void MirroredStore::wake() {
  wake_armed_ = false;
  const std::uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
}

int MirroredStore::changes_fd(const std::vector<std::string>& prefixes) {
  if (wake_fd_ < 0) return -1;
  std::lock_guard lock(mutex_);
  if (!live_) return -1;  // reads go to etcd: the caller polls
  // A key no range follows never wakes the caller: it polls.
  for (const auto& p : prefixes)
    if (range_of(RangeRead{p, true}) < 0 && range_of(p) < 0) return -1;
  std::uint64_t count = 0;
  (void)!::read(wake_fd_, &count, sizeof(count));
  wake_prefixes_ = prefixes;
  wake_armed_ = true;
  // Changes applied between the caller's read and now.
  std::int64_t oldest_read = std::numeric_limits<std::int64_t>::max();
  for (const auto& f : followed_) oldest_read = std::min(oldest_read, f.read_at);
  if (recent_floor_ > oldest_read) {
    wake();
  } else {
    for (auto at = recent_.rbegin(); at != recent_.rend(); ++at) {
      const int i = range_of(at->second);
      if (i >= 0 && at->first > followed_[static_cast<std::size_t>(i)].read_at &&
          under_any(at->second, wake_prefixes_)) {
        wake();
        break;
      }
    }
  }
  return wake_fd_;
}

void MirroredStore::wrote(const std::string& key, bool prefix) {
  const std::int64_t at = store_->changed_at();
  if (at == 0) return;
  std::lock_guard lock(mutex_);
  // The range of the key, or every range the prefix written meets.
  const KeyRange written = prefix ? prefix_range(key) : single_key(key);
  for (auto& f : followed_)
    if (written.key < f.range.end && f.range.key < written.end) f.needed = std::max(f.needed, at);
}

std::int64_t MirroredStore::grant_lease(std::int64_t ttl_seconds) {
  return store_->grant_lease(ttl_seconds);
}

bool MirroredStore::keep_alive(std::int64_t lease) {
  return store_->keep_alive(lease);
}

void MirroredStore::revoke_lease(std::int64_t lease) {
  store_->revoke_lease(lease);
}

std::int64_t MirroredStore::lease_remaining(std::int64_t lease) {
  return store_->lease_remaining(lease);
}

void MirroredStore::put(const std::string& key, const std::string& value, std::int64_t lease) {
  store_->put(key, value, lease);
  wrote(key);
}

void MirroredStore::erase(const std::string& key) {
  store_->erase(key);
  wrote(key);
}

void MirroredStore::erase_prefix(const std::string& prefix) {
  store_->erase_prefix(prefix);
  wrote(prefix, true);
}

bool MirroredStore::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                     const std::string& value, std::int64_t lease) {
  const bool written = store_->compare_and_swap(key, expected_mod_revision, value, lease);
  if (written)
    wrote(key);
  else
    swap_lost(key);
  return written;
}

std::optional<std::vector<std::vector<KeyValue>>> MirroredStore::compare_and_swap_then_read(
    const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
    std::int64_t lease, const std::vector<RangeRead>& reads) {
  // With no ranges to follow from it, `contents` stays empty.
  std::vector<std::vector<KeyValue>> contents;
  auto found = store_->compare_and_swap_then_read_ranges(key, expected_mod_revision, value, lease,
                                                         reads, with_next_swap_, contents);
  if (!found) {
    swap_lost(key);
    return found;
  }
  if (with_next_swap_.empty()) {
    wrote(key);
    read_directly(*found);
    return found;
  }
  std::vector<KeyRange> ranges = std::exchange(with_next_swap_, {});
  auto [keys, bytes] = by_key(contents);
  wanted_ = ranges;
  {
    std::lock_guard lock(mutex_);
    pending_ = ranges;
    repending_ = true;
    live_ = false;
    leave_watch_ = true;
    // Too many to hold: the watch reads them and stops (run()).
    pending_held_ = keys.size() <= kMaxMirroredKeys && bytes <= kMaxMirroredBytes;
    starting_ = pending_held_;
    if (pending_held_) hold(ranges, std::move(keys), bytes, store_->changed_at());
  }
  changed_.notify_all();
  watch_store_->interrupt_watch();
  return found;
}

void MirroredStore::swap_lost(const std::string& key) {
  // Someone else changed the key: the mirror must show that change (or a
  // newer one) before the caller reads it again, or a retry would see the
  // state it failed against.
  const auto now = store_->read({RangeRead{key}});
  std::int64_t changed = 0;
  for (const auto& kv : now.front()) changed = kv.mod_revision;
  std::lock_guard lock(mutex_);
  if (const int i = range_of(key); i >= 0 && changed > 0) {
    auto& f = followed_[static_cast<std::size_t>(i)];
    f.needed = std::max(f.needed, changed);
  }
}

std::string MirroredStore::describe() const {
  return store_->describe();
}

}  // namespace ductile::agent
