// What a stop signal (SIGTERM, SIGINT) does: the agent leaves at once, or,
// a member of a running round with checkpoints on, drains: it marks itself
// draining (draining/<id>, on its lease), asks the round to checkpoint and
// leaves once the round re-formed without it or the checkpoint timeout
// passed. Internal to libductile_agent; owned by Agent (agent_impl.hpp).
//
// Threading: the agent's thread only (the signal handler only sets the
// options' stop_signal).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>

#include "agent_common.hpp"
#include "connection.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "node_workers.hpp"

namespace ductile::agent {

class StopSignals {
 public:
  StopSignals(const AgentOptions& options, const RendezvousSettings& settings,
              const NodeIdentity& self, RendezvousConnection& conn, const NodeWorkers& workers)
      : o_(options), settings_(settings), self_(self), conn_(conn), workers_(workers) {}

  // Signal `sig` was received: the exit code once it is time to leave.
  std::optional<int> on_stop_signal(int sig);
  // After a new lease: draining, the mark again (it went with the old one).
  void renew_mark();

 private:
  // Writes draining/<id> (this node leaves after its round's checkpoint).
  void mark_draining();

  const AgentOptions& o_;
  const RendezvousSettings& settings_;
  const NodeIdentity& self_;
  RendezvousConnection& conn_;
  const NodeWorkers& workers_;
  struct Drain {
    std::int64_t round;
    std::chrono::steady_clock::time_point deadline;
  };
  std::optional<Drain> drain_;  // leaving after the round's checkpoint
};

// A stop signal while the agent's thread is in a stage that does not look at
// it: the start-up (the first lease, which waits up to the join timeout for
// a c10d or static rendezvous' host; this node's registration, which waits
// for a previous run's to expire) and the rendezvous host's wait for the
// others at the end. No worker runs in those stages: `leave` is called
// with the signal's number (it logs, removes what the agent made, and ends
// the process with 128 + the signal), from this object's thread.
//
// Threading: a thread of its own looks at the signal every 20 ms while
// armed, and sleeps until arm() while not (an agent at rest wakes for
// nothing); arm() and disarm() from the agent's thread. After disarm()
// returns, `leave` is not called (or the process is gone).
class StopWatch {
 public:
  StopWatch(const std::atomic<int>* stop_signal, std::function<void(int)> leave);
  ~StopWatch();
  StopWatch(const StopWatch&) = delete;
  StopWatch& operator=(const StopWatch&) = delete;
  void arm();
  void disarm();

 private:
  void watch();

  const std::atomic<int>* stop_signal_;
  std::function<void(int)> leave_;
  std::mutex mutex_;  // held while `leave_` runs: disarm() waits for it
  std::condition_variable armed_or_stopping_;
  bool armed_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace ductile::agent
