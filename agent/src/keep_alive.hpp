// The agent's lease keep-alive and its fence. Internal to libductile_agent.
//
// The keep-alive renews the lease every TTL/3 (as etcd's own client does)
// from a helper thread on its own connection to the store (etcd: one
// stream, each renewal a message on it), so that a slow step of the main
// loop (stopping workers, a request to an unreachable etcd) never lets the
// lease expire. A renewal
// that failed is tried again after 100 ms, then twice as long each time up
// to TTL/3: an etcd that stalls for less than the fence's budget is ridden
// out.
//
// The fence: a second helper thread kills this node's workers (SIGUSR1 to
// their guards, which SIGKILL each worker's process group) once no renewal
// has succeeded for 3/4 of the TTL, counted from when the last successful
// renewal was sent. By then the lease may expire within TTL/4 and the other
// agents re-form without this node, so its workers must not train on: a
// node cut off from etcd stops its workers before a new group can start.
// A lease the store says is gone (revoked by the leader, or by the next
// oldest agent, because this node's link closed or fell silent; or
// expired) fences at once: the others re-form without this node. So does
// a node whose judge's link fell silent and which cannot renew within a
// quarter heartbeat (confirm_within): it may be the one cut off, and the
// judge revokes its lease well before 3/4 of the TTL.
// Guards are held as pidfds: a guard the main thread has reaped is never
// confused with a process that reuses its pid.
//
// Threading: every public member may be called from the main thread while
// the helpers run; they synchronise on one mutex.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ductile/agent/kv_store.hpp"

namespace ductile::agent {

class KeepAlive {
 public:
  using Clock = std::chrono::steady_clock;
  // A store of the renewing thread's own, whose requests give up after
  // `timeout` in all (a store of several servers splits it between them).
  using StoreFactory =
      std::function<std::unique_ptr<KeyValueStore>(std::chrono::milliseconds timeout)>;
  // `granted_at`: when the request that granted `lease` was sent. `log`
  // receives the fence's message (from the fence thread).
  KeepAlive(StoreFactory make_store, std::int64_t lease, std::chrono::seconds ttl,
            Clock::time_point granted_at, std::function<void(const std::string&)> log);
  ~KeepAlive();
  KeepAlive(const KeepAlive&) = delete;
  KeepAlive& operator=(const KeepAlive&) = delete;

  // A new lease (after the old one was lost or revoked).
  void set_lease(std::int64_t lease, Clock::time_point granted_at);
  // etcd said the lease no longer exists (the caller registers again).
  bool lost();
  // Renews now rather than at the next period (another part has reason
  // to think the lease is gone: it is then found lost at once).
  void renew_now();
  // This node's judge (the agent that revokes its lease when its link
  // falls silent: the leader, or the leader's next oldest) fell silent
  // (`why`, "the link to the leader, node a, fell silent"): unless a
  // renewal succeeds within `within`, the fence kills the workers then,
  // because the judge, which may be the one that hears nothing, revokes
  // this node's lease soon after, counting on it (node_links.cpp).
  // Renews at once, and every `within` for a while after (until
  // judge_heard()): a lease the judge revoked fences within that long.
  void confirm_within(std::chrono::milliseconds within, const std::string& why);
  // The judge was heard again: no confirmation is needed.
  void judge_heard();
  // The guards of the workers to kill at the fence (empty: none running).
  void fence_workers(const std::vector<int>& guard_pids);
  // True when the fence killed workers since the last fence_workers().
  bool fenced();

 private:
  void renew();
  void watch();
  void close_guards();  // with mutex_ held
  // Kills the workers (SIGUSR1 to their guards), saying `why`; with
  // mutex_ held.
  void fence(const std::string& why);

  StoreFactory make_store_;
  std::chrono::milliseconds ttl_, period_, fence_after_;
  std::function<void(const std::string&)> log_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::int64_t lease_;
  Clock::time_point last_renewal_sent_;
  // Renewals that failed (no answer) since the last that succeeded, and
  // the last one's error: what the fence says.
  int failed_renewals_ = 0;
  std::string last_failure_;
  bool stopping_ = false;
  bool lost_ = false;
  bool fenced_ = false;
  bool renew_now_ = false;
  // confirm_within(): a renewal must succeed by confirm_by_ (while
  // confirming_), or the fence acts, saying confirm_why_.
  bool confirming_ = false;
  Clock::time_point fast_until_{};  // renewals every confirm_within_ until then
  Clock::time_point confirm_by_{};
  std::chrono::milliseconds confirm_within_{0};
  std::string confirm_why_;
  std::vector<int> guards_;  // pidfds (or pids where pidfds are not available)
  bool guards_are_pidfds_ = true;
  std::thread renewer_, watcher_;
};

}  // namespace ductile::agent
