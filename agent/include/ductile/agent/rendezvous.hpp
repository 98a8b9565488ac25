// The rendezvous of a job's agents, as data and pure decisions, so that it
// can be tested without a store or processes.
//
// Layout in the store, under the job's prefix "/ductile/agent/<job-id>/":
//   nodes/<node-id>   one per live agent, on the agent's lease: {"id", "addr"};
//                     a key without a lease is not an agent's and is ignored
//   settings          the job's settings (policy, parameters, nproc-per-node)
//   round             the current round (RoundRecord as JSON), written by the
//                     leader with compare-and-swap
//   failure/<round>   the first worker failure of a round (FailureReport)
//   done/<round>/<id> a node whose workers all exited 0 in that round
// The leader is the live agent whose node key is oldest (lowest create
// revision); rounds take the oldest admitted nodes, so the leader is group
// rank 0 and publishes MASTER_ADDR and a MASTER_PORT free on its host.
//
// Threading: plain values and pure functions.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ductile/agent/records.hpp"

namespace ductile::agent {

// The largest node count k in [min_nodes, min(max_nodes, available)] whose
// world size k * nproc_per_node is in `valid_gpus` (sorted); 0 when none.
std::int64_t admitted_nodes(const std::vector<std::int64_t>& valid_gpus,
                            std::int64_t nproc_per_node, std::int64_t min_nodes,
                            std::int64_t max_nodes, std::int64_t available);

struct RendezvousSettings {
  std::vector<std::int64_t> valid_gpus;
  std::int64_t nproc_per_node = 1;
  std::int64_t min_nodes = 1;
  std::int64_t max_nodes = 1;
  std::int64_t max_restarts = 0;
  std::chrono::milliseconds min_time{0};       // no scale-up sooner after a (re)start
  std::chrono::milliseconds settle{0};         // quiet time before a first or larger round
  std::chrono::milliseconds failure_grace{0};  // wait for a lost node before counting a failure
  // > 0: before a planned re-form (scale-up, a drained node) the round's
  // workers are asked to checkpoint, and waited for this long at most.
  std::chrono::milliseconds checkpoint_timeout{0};
};

// What the leader sees on one pass.
struct Observation {
  std::chrono::milliseconds now{0};      // same clock as started_ms
  std::vector<NodeInfo> alive;           // sorted by create_revision
  std::optional<RoundRecord> round;      // current record, if any
  std::optional<FailureReport> failure;  // of the current round
  bool all_done = false;  // every member of the current round reported its workers done
  std::chrono::milliseconds failure_seen{0};            // when the failure was first seen
  std::chrono::milliseconds last_membership_change{0};  // when `alive` last changed
  // Nodes that drain (SIGTERM with checkpoints on): alive until they leave,
  // but not in the next round.
  std::vector<std::string> draining;
  std::optional<CheckpointRequest> checkpoint;  // asked of the current round
  std::vector<std::string> saved;               // members whose workers saved
};

enum class Action { keep, new_round, succeed, fail, request_checkpoint };

struct Decision {
  Action action = Action::keep;
  std::vector<NodeInfo> members;  // for new_round (empty: wait for more nodes)
  bool counts_as_restart = false;
  std::string reason;
};

// The leader's decision. Scale-down (a member gone) is immediate; a failure is
// counted against max_restarts only when every member is still alive
// failure_grace after it; scale-up waits for min_time since the round started
// and for `settle` without membership changes. A planned re-form (scale-up,
// a draining member) with checkpoint_timeout > 0 first asks for a checkpoint
// (request_checkpoint) and forms the next round once every member saved or
// the timeout passed.
Decision decide(const Observation& seen, const RendezvousSettings& settings);

}  // namespace ductile::agent
