// The rendezvous store in memory; see memory_store.hpp.
#include "ductile/agent/memory_store.hpp"

#include <algorithm>
#include <limits>
#include <random>

#include <fmt/format.h>

namespace ductile::agent {

namespace {

// Now + `ttl`, saturated: a TTL up to the maximum never wraps the clock
// (a lease born expired).
std::chrono::steady_clock::time_point deadline_after(std::chrono::seconds ttl) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  const auto room =
      std::chrono::duration_cast<std::chrono::seconds>(Clock::time_point::max() - now);
  return ttl >= room ? Clock::time_point::max() : now + ttl;
}

}  // namespace

MemoryStore::MemoryStore(std::string description) : MemoryStore(std::move(description), Limits{}) {}

MemoryStore::MemoryStore(std::string description, Limits limits)
    : description_(std::move(description)), limits_(limits) {
  // Lease ids unlike another store's (a lease id from an earlier host is
  // never taken for one of this one).
  std::random_device random;
  next_lease_ = (static_cast<std::int64_t>(random() & 0x3fffffff) << 24) + 1;
}

std::size_t MemoryStore::footprint(const std::string& key, const std::string& value) {
  return key.size() + value.size() + 64;
}

std::unique_lock<std::mutex> MemoryStore::locked() {
  std::unique_lock lock(mutex_);
  expire();
  return lock;
}

void MemoryStore::expire() {
  const auto now = Clock::now();
  bool removed = false;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    auto keys = std::move(it->second.keys);
    it = leases_.erase(it);
    for (const auto& key : keys) removed |= remove_locked(key);
  }
  if (removed) ++revision_;  // one change, as etcd deletes a lease's keys
}

bool MemoryStore::remove_locked(const std::string& key) {
  auto it = keys_.find(key);
  if (it == keys_.end()) return false;
  if (auto lease = leases_.find(it->second.lease); lease != leases_.end())
    lease->second.keys.erase(key);
  bytes_ -= footprint(it->first, it->second.value);
  keys_.erase(it);
  return true;
}

void MemoryStore::check_fits_locked(const std::string& key, const std::string& value) const {
  if (key.size() > limits_.max_key_bytes)
    throw StoreError(fmt::format("{}: refused to write a key of {} bytes: the maximum is {}",
                                 description_, key.size(), limits_.max_key_bytes));
  if (value.size() > limits_.max_value_bytes)
    throw StoreError(fmt::format(
        "{}: refused to write {}: its value of {} bytes is over the {} bytes a value may have",
        description_, key, value.size(), limits_.max_value_bytes));
  auto it = keys_.find(key);
  if (it == keys_.end() && keys_.size() >= limits_.max_keys)
    throw StoreError(fmt::format("{}: refused to write {}: the store holds {} keys, its maximum",
                                 description_, key, keys_.size()));
  const std::size_t replaced = it == keys_.end() ? 0 : footprint(it->first, it->second.value);
  const std::size_t after = bytes_ - replaced + footprint(key, value);
  if (after > limits_.max_bytes)
    throw StoreError(fmt::format(
        "{}: refused to write {}: the store would hold {} bytes, over its maximum of {}",
        description_, key, after, limits_.max_bytes));
}

void MemoryStore::put_locked(const std::string& key, const std::string& value, std::int64_t lease) {
  if (lease != 0 && !leases_.count(lease))
    throw StoreError(fmt::format("{}: requested lease {} not found", description_, lease));
  check_fits_locked(key, value);
  ++revision_;
  auto [it, created] = keys_.try_emplace(key);
  Entry& e = it->second;
  if (created) e.create_revision = revision_;
  bytes_ += footprint(key, value) - (created ? 0 : footprint(key, e.value));
  if (e.lease != lease)
    if (auto old = leases_.find(e.lease); old != leases_.end()) old->second.keys.erase(key);
  e.value = value;
  e.mod_revision = revision_;
  e.lease = lease;
  if (lease != 0) leases_.at(lease).keys.insert(key);
}

std::vector<KeyValue> MemoryStore::range_locked(const RangeRead& r) const {
  std::vector<KeyValue> out;
  auto to_kv = [](const std::string& key, const Entry& e) {
    return KeyValue{key, e.value, e.create_revision, e.mod_revision, e.lease};
  };
  if (!r.prefix) {
    if (auto it = keys_.find(r.key); it != keys_.end()) out.push_back(to_kv(it->first, it->second));
    return out;
  }
  // Entries are ordered (and cut to the limit) before any is copied: the
  // oldest few of many keys cost a partial sort, not a copy of each.
  const std::size_t limit =
      r.limit > 0 ? static_cast<std::size_t>(r.limit) : std::numeric_limits<std::size_t>::max();
  std::vector<const std::pair<const std::string, Entry>*> found;
  for (auto it = keys_.lower_bound(r.key); it != keys_.end() && it->first.starts_with(r.key);
       ++it) {
    if (!r.oldest_first && found.size() == limit) break;
    found.push_back(&*it);
  }
  if (r.oldest_first) {
    auto by_age = [](const auto* a, const auto* b) {
      return a->second.create_revision < b->second.create_revision;
    };
    const auto end = found.begin() + static_cast<std::ptrdiff_t>(std::min(limit, found.size()));
    std::partial_sort(found.begin(), end, found.end(), by_age);
    found.erase(end, found.end());
  }
  out.reserve(found.size());
  for (const auto* entry : found) out.push_back(to_kv(entry->first, entry->second));
  return out;
}

std::int64_t MemoryStore::grant_lease(std::int64_t ttl_seconds) {
  auto lock = locked();
  if (ttl_seconds > limits_.max_lease_ttl_seconds)
    throw StoreError(fmt::format("{}: refused a lease of TTL {} s: the maximum is {} s",
                                 description_, ttl_seconds, limits_.max_lease_ttl_seconds));
  const std::int64_t id = next_lease_++;
  const std::chrono::seconds ttl(std::max<std::int64_t>(ttl_seconds, 1));
  leases_[id] = Lease{ttl, deadline_after(ttl), {}};
  return id;
}

bool MemoryStore::keep_alive(std::int64_t lease) {
  auto lock = locked();
  auto it = leases_.find(lease);
  if (it == leases_.end()) return false;
  it->second.deadline = deadline_after(it->second.ttl);
  return true;
}

void MemoryStore::revoke_lease(std::int64_t lease) {
  auto lock = locked();
  auto it = leases_.find(lease);
  if (it == leases_.end()) return;
  auto keys = std::move(it->second.keys);
  leases_.erase(it);
  bool removed = false;
  for (const auto& key : keys) removed |= remove_locked(key);
  if (removed) ++revision_;
}

std::int64_t MemoryStore::lease_remaining(std::int64_t lease) {
  auto lock = locked();
  auto it = leases_.find(lease);
  if (it == leases_.end()) return -1;
  // Whole seconds, cut as etcd cuts them.
  return std::chrono::duration_cast<std::chrono::seconds>(it->second.deadline - Clock::now())
      .count();
}

void MemoryStore::put(const std::string& key, const std::string& value, std::int64_t lease) {
  auto lock = locked();
  put_locked(key, value, lease);
}

std::vector<std::vector<KeyValue>> MemoryStore::read(const std::vector<RangeRead>& reads) {
  auto lock = locked();
  std::vector<std::vector<KeyValue>> out;
  for (const auto& r : reads) out.push_back(range_locked(r));
  return out;
}

void MemoryStore::erase(const std::string& key) {
  auto lock = locked();
  if (remove_locked(key)) ++revision_;
}

void MemoryStore::erase_prefix(const std::string& prefix) {
  auto lock = locked();
  std::vector<std::string> doomed;
  for (auto it = keys_.lower_bound(prefix); it != keys_.end() && it->first.starts_with(prefix);
       ++it)
    doomed.push_back(it->first);
  for (const auto& key : doomed) remove_locked(key);
  if (!doomed.empty()) ++revision_;
}

bool MemoryStore::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                   const std::string& value, std::int64_t lease) {
  auto lock = locked();
  auto it = keys_.find(key);
  const std::int64_t current = it == keys_.end() ? 0 : it->second.mod_revision;
  if (current != expected_mod_revision) return false;
  put_locked(key, value, lease);
  return true;
}

std::string MemoryStore::describe() const {
  return description_;
}

}  // namespace ductile::agent
