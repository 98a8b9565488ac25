// The agent's etcd, read from a mirror of its job's keys kept by a watch.
// See store_mirror.hpp.
#include "store_mirror.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace ductile::agent {

namespace store_mirror_detail {

using std::chrono::milliseconds;

// How long a read waits for the mirror to hold what it must show before it
// asks etcd instead: the watch brings a change within milliseconds.
constexpr milliseconds kCatchUp{500};
// The first wait before the watch is tried again, and the longest.
constexpr milliseconds kFirstRetry{100};
constexpr milliseconds kLongestRetry{2000};

std::size_t bytes_of(const KeyValue& kv) {
  return kv.key.size() + kv.value.size() + 64;
}

}  // namespace store_mirror_detail

using namespace store_mirror_detail;

MirroredStore::MirroredStore(std::unique_ptr<EtcdStore> store, StoreFactory make_watch_store,
                             std::string prefix, std::function<void(const std::string&)> log)
    : store_(std::move(store)),
      watch_store_(make_watch_store()),
      prefix_(std::move(prefix)),
      log_(std::move(log)) {
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
  return changed_.wait_for(lock, kCatchUp, [&] { return !live_ || revision_ >= revision; }) &&
         live_;
}

std::vector<KeyValue> MirroredStore::answer(const RangeRead& read) const {
  std::vector<KeyValue> out;
  if (!read.prefix) {
    if (auto at = keys_.find(read.key); at != keys_.end()) out.push_back(at->second);
  } else {
    for (auto at = keys_.lower_bound(read.key);
         at != keys_.end() && at->first.starts_with(read.key); ++at)
      out.push_back(at->second);
  }
  if (read.oldest_first)
    std::stable_sort(out.begin(), out.end(), [](const KeyValue& a, const KeyValue& b) {
      return a.create_revision < b.create_revision;
    });
  if (read.limit > 0 && out.size() > static_cast<std::size_t>(read.limit))
    out.resize(static_cast<std::size_t>(read.limit));
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
