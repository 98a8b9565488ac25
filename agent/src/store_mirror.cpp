// The agent's etcd, read from a mirror of its job's keys kept by a watch.
// See store_mirror.hpp.
#include "store_mirror.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

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

}  // namespace store_mirror_detail

using namespace store_mirror_detail;

MirroredStore::MirroredStore(std::unique_ptr<EtcdStore> store, StoreFactory make_watch_store,
                             std::string prefix, milliseconds catch_up,
                             std::function<void(const std::string&)> log)
    : store_(std::move(store)),
      watch_store_(make_watch_store()),
      prefix_(std::move(prefix)),
      catch_up_(catch_up),
      log_(std::move(log)),
      wake_fd_(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
  thread_ = std::thread([this] { follow(); });
}

MirroredStore::~MirroredStore() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  watch_store_->interrupt_watch();
  thread_.join();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void MirroredStore::follow() {
  milliseconds retry = kFirstRetry;
  bool resync = true;
  while (!stop_) {
    try {
      if (resync) {
        auto [kvs, revision] = watch_store_->read_prefix_at(prefix_);
        std::map<std::string, KeyValue> keys;
        std::size_t bytes = 0;
        for (auto& kv : kvs) {
          bytes += bytes_of(kv);
          keys.emplace(kv.key, std::move(kv));
        }
        std::lock_guard lock(mutex_);
        if (keys.size() > kMaxMirroredKeys || bytes > kMaxMirroredBytes) {
          over_bound_ = true;
          break;
        }
        keys_ = std::move(keys);
        bytes_ = bytes;
        revision_ = revision;
        resync = false;
        // What changed in between is not known key by key.
        recent_.clear();
        recent_floor_ = revision;
        if (wake_armed_) wake();
      }
      std::int64_t from = 0;
      {
        std::lock_guard lock(mutex_);
        from = revision_ + 1;
      }
      watch_store_->watch(
          prefix_, from,
          [&](const WatchMessage& message) {
            if (message.compact_revision > 0 || message.canceled) {
              resync = true;  // the changes since revision_ are gone: read them all again
              return false;
            }
            std::lock_guard lock(mutex_);
            live_ = true;
            retry = kFirstRetry;
            for (const auto& event : message.events) {
              auto at = keys_.find(event.kv.key);
              if (at != keys_.end()) {
                bytes_ -= bytes_of(at->second);
                keys_.erase(at);
              }
              if (!event.deleted) {
                bytes_ += bytes_of(event.kv);
                keys_.emplace(event.kv.key, event.kv);
              }
              revision_ = std::max(revision_, event.kv.mod_revision);
              recent_.emplace_back(event.kv.mod_revision, event.kv.key);
              if (recent_.size() > kRecentChanges) {
                recent_floor_ = recent_.front().first;
                recent_.pop_front();
              }
              if (wake_armed_ && event.kv.mod_revision > wake_after_ &&
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
          stop_);
    } catch (const StoreError&) {
      // etcd unreachable or restarting: reads go to etcd meanwhile (and see
      // the outage as the agent always did); the watch resumes from the
      // revision held.
    }
    std::unique_lock lock(mutex_);
    live_ = false;
    if (over_bound_) break;
    changed_.wait_for(lock, retry, [this] { return stop_.load(); });
    retry = std::min(retry * 2, kLongestRetry);
  }
  std::unique_lock lock(mutex_);
  live_ = false;
  if (over_bound_) {
    keys_.clear();
    bytes_ = 0;
    lock.unlock();
    log_(
        fmt::format("the job's keys under {} are over {} keys or {} MiB: the agent reads them "
                    "from etcd at each pass instead of following them",
                    prefix_, kMaxMirroredKeys, kMaxMirroredBytes >> 20));
  }
}

bool MirroredStore::caught_up(std::int64_t revision) {
  std::unique_lock lock(mutex_);
  if (!live_) return false;
  return changed_.wait_for(lock, catch_up_, [&] { return !live_ || revision_ >= revision; }) &&
         live_;
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
  const bool mirrored = std::all_of(reads.begin(), reads.end(), [this](const RangeRead& r) {
    return r.key.starts_with(prefix_);
  });
  if (mirrored && caught_up(needed_)) {
    std::lock_guard lock(mutex_);
    if (live_) {
      std::vector<std::vector<KeyValue>> out;
      for (const auto& r : reads) out.push_back(answer(r));
      read_at_ = revision_;
      ++mirrored_reads_;
      return out;
    }
  }
  ++direct_reads_;
  auto out = store_->read(reads);
  // A later read from the mirror shows these records or newer ones.
  for (const auto& result : out)
    for (const auto& kv : result)
      if (kv.key.starts_with(prefix_)) needed_ = std::max(needed_, kv.mod_revision);
  return out;
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
  std::uint64_t count = 0;
  (void)!::read(wake_fd_, &count, sizeof(count));
  wake_prefixes_ = prefixes;
  wake_after_ = read_at_;
  wake_armed_ = true;
  // Changes applied between the caller's read and now.
  if (recent_floor_ > wake_after_) {
    wake();
  } else {
    for (auto at = recent_.rbegin(); at != recent_.rend() && at->first > wake_after_; ++at)
      if (under_any(at->second, wake_prefixes_)) {
        wake();
        break;
      }
  }
  return wake_fd_;
}

void MirroredStore::wrote() {
  needed_ = std::max(needed_, store_->changed_at());
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
  wrote();
}

void MirroredStore::erase(const std::string& key) {
  store_->erase(key);
  wrote();
}

void MirroredStore::erase_prefix(const std::string& prefix) {
  store_->erase_prefix(prefix);
  wrote();
}

bool MirroredStore::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                     const std::string& value, std::int64_t lease) {
  const bool written = store_->compare_and_swap(key, expected_mod_revision, value, lease);
  wrote();
  return written;
}

std::string MirroredStore::describe() const {
  return store_->describe();
}

}  // namespace ductile::agent
