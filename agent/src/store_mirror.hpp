// The agent's etcd, read from a mirror of its job's keys. Internal to
// libductile_agent; made by RendezvousConnection (connection.hpp).
//
// Each pass of every agent reads the job's round, registrations and
// snapshot holdings. Read from etcd, that costs etcd a request per agent
// per pass and, with every node's records in each answer, bytes that grow
// as the square of the node count. Here the job's keys are kept in this
// process instead: one read of them all, then etcd's watch of the job's
// prefix from the revision read, each change applied as it comes. A
// steady job costs etcd nothing but the leases' keep-alives, and a change
// costs one message to each agent.
//
// Only the keys an agent acts on are followed (follow(): ranges of keys,
// each a watch on the one stream): an agent that does not lead follows the
// round, the job's settings and marks, and its own registration, so that a
// node's record written once costs one message to the few agents that
// lead, not one to every agent.
//
// Reads of keys in a followed range are answered from the mirror while its
// watch runs, once the mirror holds every change this object made or read
// in that range (so an agent always reads its own writes, and never reads
// an older state than it read before); else, and for every other key, from
// etcd. Writes and lease calls go to etcd. When the watch cannot resume
// from the last revision it holds (compacted away), or the ranges change,
// the mirror is read afresh; while the watch is down it is retried, and
// reads go to etcd, so an etcd outage shows to the agent as before
// (StoreUnavailable).
//
// Bounded: a mirror of more than kMaxMirroredKeys keys or
// kMaxMirroredBytes bytes stops (logged once) and every read goes to etcd.
//
// A caller waits for a change with changes_fd() (the pass sleeps until
// the round or another key it acts on changes, not a poll interval).
//
// Threading: the KeyValueStore calls and follow() from one thread at a
// time (as any store); the watch runs a thread of its own. Errors: as
// EtcdStore's.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ductile/agent/etcd_store.hpp"

namespace ductile::agent {

inline constexpr std::size_t kMaxMirroredKeys = 100000;
inline constexpr std::size_t kMaxMirroredBytes = std::size_t{64} << 20;

class MirroredStore final : public KeyValueStore {
 public:
  using StoreFactory = std::function<std::unique_ptr<EtcdStore>()>;
  // `store`: the requests' (this object's thread); `make_watch_store`: a
  // store for the watch's thread. `ranges`: the keys mirrored (disjoint).
  // `catch_up`: how long a read waits for the watch to bring what it must
  // show before it asks etcd instead (the request timeout: a loaded etcd
  // is slow to answer too, and a read of its own only adds to its load).
  // `log`: a line about the mirror (the watch's thread may call it).
  MirroredStore(std::unique_ptr<EtcdStore> store, StoreFactory make_watch_store,
                std::vector<KeyRange> ranges, std::chrono::milliseconds catch_up,
                std::function<void(const std::string&)> log);
  ~MirroredStore() override;
  MirroredStore(const MirroredStore&) = delete;
  MirroredStore& operator=(const MirroredStore&) = delete;

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
  // From etcd, in one request (never from the mirror).
  std::optional<std::vector<std::vector<KeyValue>>> compare_and_swap_then_read(
      const std::string& key, std::int64_t expected_mod_revision, const std::string& value,
      std::int64_t lease, const std::vector<RangeRead>& reads) override;
  std::string describe() const override;
  int changes_fd(const std::vector<std::string>& prefixes) override;

  // From now on the mirror holds `ranges` (disjoint) instead: the watch
  // reads them afresh and follows them; meanwhile reads go to etcd.
  void follow(std::vector<KeyRange> ranges);
  // The next compare_and_swap_then_read() that succeeds reads `ranges`
  // (disjoint) too, in its transaction, and the mirror holds them from
  // then on: the watch follows them from that revision without a read of
  // its own (an agent's registration carries the mirror's first read, one
  // request fewer for each agent that joins). Reads wait for the watch to
  // start then, up to `catch_up`. A follow() before it cancels it.
  void follow_with_next_swap(std::vector<KeyRange> ranges);
  const std::vector<KeyRange>& followed() const { return wanted_; }

  // Reads answered from the mirror and from etcd so far (for tests and
  // benchmarks).
  std::uint64_t mirrored_reads() const { return mirrored_reads_; }
  std::uint64_t direct_reads() const { return direct_reads_; }
  // Reads of the followed ranges the watch made (a start, a resync).
  std::uint64_t range_reads() const { return range_reads_; }

 private:
  // One followed range and where the mirror stands in it.
  struct Followed {
    KeyRange range;
    std::int64_t revision = 0;  // every change of the range up to it applied
    std::int64_t needed = 0;    // what the next read must see (the caller's)
    std::int64_t read_at = 0;   // `revision` at the caller's last read
  };
  void run();  // the watch's thread
  // Holds `keys` (`bytes` in all) as every key of `ranges` at `revision`,
  // the watch to follow them from there (mutex_ held).
  void hold(const std::vector<KeyRange>& ranges, std::map<std::string, KeyValue> keys,
            std::size_t bytes, std::int64_t revision);
  // The index in followed_ of the range holding `read`, or -1 (mutex_ held).
  int range_of(const RangeRead& read) const;
  int range_of(const std::string& key) const;
  // True when the mirror runs and holds what `reads` must see, waited for a
  // moment (mutex_ held by `lock`).
  bool caught_up(std::unique_lock<std::mutex>& lock, const std::vector<int>& ranges);
  std::vector<KeyValue> answer(const RangeRead& read) const;  // mutex_ held
  // After a write of `key` (with `prefix`, of the keys under it): the
  // mirror must hold it before the next read of its range.
  void wrote(const std::string& key, bool prefix = false);
  // Wakes changes_fd()'s caller (mutex_ held).
  void wake();

  // After a read from etcd: the mirror holds what it found (each record's
  // revision or a newer one) before the next read of its range.
  void read_directly(const std::vector<std::vector<KeyValue>>& out);
  // After a compare_and_swap of `key` that failed: the mirror shows the
  // change it failed against (or a newer one) before `key` is read again.
  void swap_lost(const std::string& key);

  std::unique_ptr<EtcdStore> store_;
  std::unique_ptr<EtcdStore> watch_store_;  // the watch's thread's (interrupt_watch() aside)
  std::vector<KeyRange> wanted_;            // what follow() asked (the caller's)
  std::vector<KeyRange> with_next_swap_;    // follow_with_next_swap()'s (the caller's)
  const std::chrono::milliseconds catch_up_;
  std::function<void(const std::string&)> log_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, KeyValue> keys_;
  std::size_t bytes_ = 0;
  std::vector<Followed> followed_;  // the ranges the watch follows
  std::uint64_t generation_ = 0;    // followed_ replaced so many times
  std::vector<KeyRange> pending_;   // follow()'s ranges, until the watch reads them
  bool repending_ = false;          // pending_ is set
  bool pending_held_ = false;       // pending_ held already (hold()): no read
  // Held from a swap's transaction; the watch not yet started: reads wait.
  bool starting_ = false;
  bool live_ = false;        // the watch runs from followed_'s revisions
  bool over_bound_ = false;  // stopped for good: every read goes to etcd
  // changes_fd(): its eventfd, what it waits for (a change after the
  // caller's last read of its range), and the changes applied lately (their
  // revision and key), kRecentChanges at most; recent_floor_ is the newest
  // revision dropped from them.
  int wake_fd_ = -1;
  bool wake_armed_ = false;
  std::vector<std::string> wake_prefixes_;
  std::deque<std::pair<std::int64_t, std::string>> recent_;
  std::int64_t recent_floor_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> leave_watch_{false};  // stop_, or new ranges to follow
  std::atomic<std::uint64_t> mirrored_reads_{0}, direct_reads_{0}, range_reads_{0};
  std::thread thread_;
};

}  // namespace ductile::agent
