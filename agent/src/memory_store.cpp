// The rendezvous store in memory; see memory_store.hpp.
#include "ductile/agent/memory_store.hpp"

#include <algorithm>
#include <random>

#include <fmt/format.h>

namespace ductile::agent {

MemoryStore::MemoryStore(std::string description) : description_(std::move(description)) {
  // Lease ids unlike another store's (a lease id from an earlier host is
  // never taken for one of this one).
  std::random_device random;
  next_lease_ = (static_cast<std::int64_t>(random() & 0x3fffffff) << 24) + 1;
}

void MemoryStore::expire() {
  const auto now = Clock::now();
  bool removed = false;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    for (const auto& key : it->second.keys) removed |= keys_.erase(key) > 0;
    it = leases_.erase(it);
  }
  if (removed) ++revision_;  // one change, as etcd deletes a lease's keys
}

bool MemoryStore::remove_locked(const std::string& key) {
  auto it = keys_.find(key);
  if (it == keys_.end()) return false;
  if (auto lease = leases_.find(it->second.lease); lease != leases_.end())
    lease->second.keys.erase(key);
  keys_.erase(it);
  return true;
}

void MemoryStore::put_locked(const std::string& key, const std::string& value, std::int64_t lease) {
  if (lease != 0 && !leases_.count(lease))
    throw StoreError(fmt::format("{}: requested lease {} not found", description_, lease));
  ++revision_;
  auto [it, created] = keys_.try_emplace(key);
  Entry& e = it->second;
  if (created) e.create_revision = revision_;
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
  for (auto it = keys_.lower_bound(r.key); it != keys_.end() && it->first.starts_with(r.key); ++it)
    out.push_back(to_kv(it->first, it->second));
  if (r.oldest_first)
    std::sort(out.begin(), out.end(), [](const KeyValue& a, const KeyValue& b) {
      return a.create_revision < b.create_revision;
    });
  if (r.limit > 0 && out.size() > static_cast<std::size_t>(r.limit))
    out.resize(static_cast<std::size_t>(r.limit));
  return out;
}

std::int64_t MemoryStore::grant_lease(std::int64_t ttl_seconds) {
  std::lock_guard lock(mutex_);
  expire();
  const std::int64_t id = next_lease_++;
  const std::chrono::seconds ttl(std::max<std::int64_t>(ttl_seconds, 1));
  leases_[id] = Lease{ttl, Clock::now() + ttl, {}};
  return id;
}

bool MemoryStore::keep_alive(std::int64_t lease) {
  std::lock_guard lock(mutex_);
  expire();
  auto it = leases_.find(lease);
  if (it == leases_.end()) return false;
  it->second.deadline = Clock::now() + it->second.ttl;
  return true;
}

void MemoryStore::revoke_lease(std::int64_t lease) {
  std::lock_guard lock(mutex_);
  expire();
  auto it = leases_.find(lease);
  if (it == leases_.end()) return;
  bool removed = false;
  for (const auto& key : it->second.keys) removed |= keys_.erase(key) > 0;
  leases_.erase(it);
  if (removed) ++revision_;
}

std::int64_t MemoryStore::lease_remaining(std::int64_t lease) {
  std::lock_guard lock(mutex_);
  expire();
  auto it = leases_.find(lease);
  if (it == leases_.end()) return -1;
  // Whole seconds, cut as etcd cuts them.
  return std::chrono::duration_cast<std::chrono::seconds>(it->second.deadline - Clock::now())
      .count();
}

void MemoryStore::put(const std::string& key, const std::string& value, std::int64_t lease) {
  std::lock_guard lock(mutex_);
  expire();
  put_locked(key, value, lease);
}

std::optional<KeyValue> MemoryStore::get(const std::string& key) {
  std::lock_guard lock(mutex_);
  expire();
  auto found = range_locked(RangeRead{key});
  if (found.empty()) return std::nullopt;
  return found.front();
}

std::vector<KeyValue> MemoryStore::get_prefix(const std::string& prefix) {
  std::lock_guard lock(mutex_);
  expire();
  return range_locked(RangeRead{prefix, true});
}

std::vector<std::vector<KeyValue>> MemoryStore::read(const std::vector<RangeRead>& reads) {
  std::lock_guard lock(mutex_);
  expire();
  std::vector<std::vector<KeyValue>> out;
  for (const auto& r : reads) out.push_back(range_locked(r));
  return out;
}

void MemoryStore::erase(const std::string& key) {
  std::lock_guard lock(mutex_);
  expire();
  if (remove_locked(key)) ++revision_;
}

void MemoryStore::erase_prefix(const std::string& prefix) {
  std::lock_guard lock(mutex_);
  expire();
  std::vector<std::string> doomed;
  for (auto it = keys_.lower_bound(prefix); it != keys_.end() && it->first.starts_with(prefix);
       ++it)
    doomed.push_back(it->first);
  for (const auto& key : doomed) remove_locked(key);
  if (!doomed.empty()) ++revision_;
}

bool MemoryStore::compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                                   const std::string& value, std::int64_t lease) {
  std::lock_guard lock(mutex_);
  expire();
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
