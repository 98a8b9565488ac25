// The lease keep-alive and the fence; see keep_alive.hpp.
#include "keep_alive.hpp"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>

#include <fmt/format.h>

namespace ductile::agent {

using std::chrono::milliseconds;

namespace {

// Through syscall(): glibc 2.36's <sys/pidfd.h> does not declare them for C++.
int open_pidfd(int pid) {
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
}
int signal_pidfd(int fd, int sig) {
  return static_cast<int>(syscall(SYS_pidfd_send_signal, fd, sig, nullptr, 0));
}

}  // namespace

KeepAlive::KeepAlive(StoreFactory make_store, std::int64_t lease, std::chrono::seconds ttl,
                     Clock::time_point granted_at, std::function<void(const std::string&)> log)
    : make_store_(std::move(make_store)),
      ttl_(ttl),
      period_(std::max(milliseconds(ttl) / 3, milliseconds(200))),
      fence_after_(milliseconds(ttl) * 3 / 4),
      log_(std::move(log)),
      lease_(lease),
      last_renewal_sent_(granted_at) {
  renewer_ = std::thread([this] { renew(); });
  watcher_ = std::thread([this] { watch(); });
}

KeepAlive::~KeepAlive() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  renewer_.join();
  watcher_.join();
  std::lock_guard lock(mutex_);
  close_guards();
}

void KeepAlive::set_lease(std::int64_t lease, Clock::time_point granted_at) {
  std::lock_guard lock(mutex_);
  lease_ = lease;
  lost_ = false;
  last_renewal_sent_ = granted_at;
  wake_.notify_all();
}

bool KeepAlive::lost() {
  std::lock_guard lock(mutex_);
  return lost_;
}

void KeepAlive::renew_now() {
  std::lock_guard lock(mutex_);
  renew_now_ = true;
  wake_.notify_all();
}

void KeepAlive::confirm_within(milliseconds within, const std::string& why) {
  std::lock_guard lock(mutex_);
  // The judge revokes this lease a quarter heartbeat and 0.1 s after
  // `within` has passed, at most (node_links.cpp): renewals every `within`
  // for 8 of them find that out.
  fast_until_ = Clock::now() + 8 * within;
  if (!confirming_) {
    confirming_ = true;
    confirm_by_ = Clock::now() + within;
    confirm_within_ = within;
    confirm_why_ = why;
  }
  renew_now_ = true;
  wake_.notify_all();
}

void KeepAlive::judge_heard() {
  std::lock_guard lock(mutex_);
  confirming_ = false;
  fast_until_ = {};
}

bool KeepAlive::fenced() {
  std::lock_guard lock(mutex_);
  return fenced_;
}

void KeepAlive::close_guards() {
  if (guards_are_pidfds_)
    for (int fd : guards_) close(fd);
  guards_.clear();
}

void KeepAlive::fence_workers(const std::vector<int>& guard_pids) {
  std::lock_guard lock(mutex_);
  close_guards();
  fenced_ = false;
  // The guards are the caller's unreaped children: their pids are theirs
  // while pidfd_open runs.
  for (int pid : guard_pids) {
    int fd = guards_are_pidfds_ ? open_pidfd(pid) : -1;
    if (fd < 0 && guards_are_pidfds_ && errno == ENOSYS) {
      close_guards();
      guards_are_pidfds_ = false;
    }
    if (guards_are_pidfds_ && fd >= 0) guards_.push_back(fd);
  }
  if (!guards_are_pidfds_) guards_ = guard_pids;
  wake_.notify_all();
}

void KeepAlive::fence(const std::string& why) {
  if (guards_.empty()) return;
  int signalled = 0;  // guards that had not exited yet
  for (int guard : guards_) {
    int rc = guards_are_pidfds_ ? signal_pidfd(guard, SIGUSR1) : kill(guard, SIGUSR1);
    signalled += rc == 0;
  }
  close_guards();
  fenced_ = signalled > 0;
  if (fenced_) log_(fmt::format("fenced: {}; killed this node's workers", why));
}

void KeepAlive::renew() {
  // A renewal sent a period after the last has until the fence acts to be
  // answered. A loaded etcd that answers late still averts it, where a
  // shorter timeout gave up on each renewal of an etcd slower than it
  // (which renewed the lease all the same) and every node fenced at once.
  auto store = make_store_(std::max(fence_after_ - period_, milliseconds(100)));
  // After a renewal that failed, the next is tried soon (then less and less
  // often, up to the period): an etcd stalled for a moment answers it as
  // soon as it resumes, well inside the fence's budget, where waiting a
  // whole period could let the fence act on a stall shorter than it.
  milliseconds retry{100};
  std::unique_lock lock(mutex_);
  // The grant counts as the first renewal: the next is due a period after
  // it (a job's agents start together, and each saves etcd a request).
  wake_.wait_until(lock, last_renewal_sent_ + period_, [this] { return stopping_ || renew_now_; });
  renew_now_ = false;
  while (!stopping_) {
    std::int64_t lease = lease_;
    lock.unlock();
    auto sent = Clock::now();
    std::optional<bool> alive;
    std::string failure;
    try {
      alive = store->keep_alive(lease);
    } catch (const StoreError& e) {
      // Unreachable: the main loop notices and reports it; the fence acts
      // (and says why the renewals failed).
      failure = e.what();
    }
    lock.lock();
    if (!alive) {
      ++failed_renewals_;
      last_failure_ = std::move(failure);
    }
    if (alive && lease == lease_) {
      if (*alive) {
        last_renewal_sent_ = std::max(last_renewal_sent_, sent);
        failed_renewals_ = 0;
        confirming_ = false;  // etcd answers: this node is not the one cut off
      } else if (!lost_) {
        lost_ = true;
        // Gone: the others re-form (or have) without this node, whose
        // workers must not train on until it joins again.
        fence(
            fmt::format("this node's lease {:x} is gone (revoked by another agent: this node's "
                        "link closed or fell silent; or expired)",
                        lease));
      }
    }
    // Soon after the judge fell silent it may revoke this lease: renewed
    // every confirm_within_ then, so that a revocation fences within that
    // long.
    const milliseconds next =
        Clock::now() < fast_until_ ? std::min(period_, confirm_within_) : period_;
    wake_.wait_for(lock, alive ? next : retry, [this] { return stopping_ || renew_now_; });
    renew_now_ = false;
    retry = alive ? milliseconds(100) : std::min(retry * 2, period_);
  }
}

void KeepAlive::watch() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    auto deadline = last_renewal_sent_ + fence_after_;
    auto now = Clock::now();
    if (now >= deadline && !guards_.empty())
      fence(fmt::format(
          "no lease renewal for {} ms (lease TTL {} s{}), so the lease may expire and the "
          "others re-form without this node",
          std::chrono::duration_cast<milliseconds>(now - last_renewal_sent_).count(),
          std::chrono::duration_cast<std::chrono::seconds>(ttl_).count(),
          failed_renewals_ == 0 ? std::string()
                                : fmt::format("; {} renewal(s) since failed, the last: {}",
                                              failed_renewals_, last_failure_)));
    if (confirming_ && now >= confirm_by_) {
      confirming_ = false;
      if (!guards_.empty())
        fence(fmt::format(
            "{} and no lease renewal succeeded within {} ms, so this node may be the one cut "
            "off, and its lease is revoked soon",
            confirm_why_, confirm_within_.count()));
    }
    if (confirming_) deadline = std::min(deadline, confirm_by_);
    if (guards_.empty())
      wake_.wait(lock);
    else
      wake_.wait_until(lock, std::max(deadline, now + milliseconds(10)));
  }
}

}  // namespace ductile::agent
