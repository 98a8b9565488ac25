// A KeyValueStore in this process's memory, with etcd's semantics: a
// store-wide revision counted up by every change, create and mod revisions
// per key, leases that expire and take their keys with them, and
// compare-and-swap on a key's mod revision. It is the rendezvous of an agent
// that runs alone (`--standalone`) and of the agent that hosts a c10d or
// static rendezvous (store_server.hpp serves it to the other agents).
//
// Ownership: shared (std::shared_ptr) between the threads of the agent that
// holds it and its server.
// Threading: every call may come from any thread (one mutex); a lease's
// expiry is applied by the next call after its deadline.
// Bounds: the store is reachable by any client of the agents' protocol, so
// what it holds is bounded (Limits): a write past a bound and a lease TTL
// over the maximum are refused with a StoreError that names the bound, and
// the store stays as it was. Everything the store holds fits in one answer
// of the agents' protocol (max_bytes is under its frame limit), so no
// write can make a read answer too large for the other agents.
// Errors: put and compare_and_swap with a lease that does not exist throw
// StoreError, as etcd answers, and so do writes and grants past a bound;
// nothing else throws.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "ductile/agent/kv_store.hpp"

namespace ductile::agent {

class MemoryStore final : public KeyValueStore {
 public:
  struct Limits {
    // A rendezvous holds a few keys per node (registration, done marks) and
    // a few per job: 10,000 keys is thousands of nodes.
    std::size_t max_keys = 10000;
    // One key: the agents' keys are under 200 bytes (logged whole when
    // a record is ignored).
    std::size_t max_key_bytes = 4096;
    // One value: a node's registration is under 1 KiB, a round record of
    // thousands of nodes some 100 KiB.
    std::size_t max_value_bytes = 1u << 20;
    // Every key and value, with 64 bytes counted per key for its revisions
    // and lease as a read answer carries them: under the agents' 8 MiB
    // frame, so any read of the store fits in one answer.
    std::size_t max_bytes = 6u << 20;
    // etcd's maximum lease TTL (its MaxLeaseTTL): a longer one is refused
    // as etcd refuses it.
    std::int64_t max_lease_ttl_seconds = 9'000'000'000;
  };
  // `description`: where the store is, for messages ("the c10d rendezvous
  // at host:29400 (hosted by this agent)").
  explicit MemoryStore(std::string description);
  MemoryStore(std::string description, Limits limits);

  std::int64_t grant_lease(std::int64_t ttl_seconds) override;
  bool keep_alive(std::int64_t lease) override;
  void revoke_lease(std::int64_t lease) override;
  std::int64_t lease_remaining(std::int64_t lease) override;
  void put(const std::string& key, const std::string& value, std::int64_t lease = 0) override;
  std::vector<std::vector<KeyValue>> read(const std::vector<RangeRead>& reads) override;
  void erase(const std::string& key) override;
  void erase_prefix(const std::string& prefix) override;
  bool compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                        const std::string& value, std::int64_t lease = 0) override;
  std::string describe() const override;

 private:
  using Clock = std::chrono::steady_clock;
  struct Entry {
    std::string value;
    std::int64_t create_revision = 0;
    std::int64_t mod_revision = 0;
    std::int64_t lease = 0;
  };
  struct Lease {
    std::chrono::seconds ttl;
    Clock::time_point deadline;
    std::set<std::string> keys;
  };
  // Bytes a key and its value count for in max_bytes.
  static std::size_t footprint(const std::string& key, const std::string& value);
  // mutex_ held, the leases past their deadline expired.
  std::unique_lock<std::mutex> locked();
  // With mutex_ held.
  void expire();
  // Throws StoreError when writing `value` at `key` would pass a bound.
  void check_fits_locked(const std::string& key, const std::string& value) const;
  void put_locked(const std::string& key, const std::string& value, std::int64_t lease);
  // Removes `key` (no revision counted); false when absent.
  bool remove_locked(const std::string& key);
  std::vector<KeyValue> range_locked(const RangeRead& read) const;

  const std::string description_;
  const Limits limits_;
  mutable std::mutex mutex_;
  std::size_t bytes_ = 0;  // footprint() of every key held
  std::map<std::string, Entry> keys_;
  std::map<std::int64_t, Lease> leases_;
  std::int64_t revision_ = 1;  // etcd's revision of an empty store
  std::int64_t next_lease_;
};

}  // namespace ductile::agent
