// What a stop signal (SIGTERM, SIGINT) does: the agent leaves at once, or,
// a member of a running round with checkpoints on, drains: it marks itself
// draining (draining/<id>, on its lease), asks the round to checkpoint and
// leaves once the round re-formed without it or the checkpoint timeout
// passed. Internal to libductile_agent; owned by Agent (agent_impl.hpp).
//
// Threading: the agent's thread only (the signal handler only sets the
// options' stop_signal).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>

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

}  // namespace ductile::agent
