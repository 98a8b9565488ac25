// One posted operation of the MPI engine and the step that advances it:
// its local work, the matched probes of its receives, the test of its
// requests and its deadline. Called by the holder of the engine's progress
// lock only (every MPI call is made under it).
#pragma once

#include "mpi_api.hpp"

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "completion.hpp"
#include "mpi_engine.hpp"

namespace ductile::accel {

using MpiClock = std::chrono::steady_clock;

struct ActiveOp {
  int comm;
  std::string what;
  MpiPosting posting;
  std::vector<MPI_Status> statuses;  // one per request
  std::shared_ptr<Completion> done;
  MpiClock::time_point deadline;
};

// Sources (per communicator) that an earlier operation in this progress
// round still waits for: their next message belongs to that operation.
using BlockedSources = std::vector<std::pair<MPI_Comm, int>>;

struct OpStep {
  bool finished = false;  // completed, or failed when `failure` is set
  std::string failure;
  // The failure came from MPI or a timeout: a peer may have died.
  bool peer_may_be_lost = false;
};

// Advances `op` once: runs its local work (first step only), posts the
// receives whose messages have arrived with the expected size, tests its
// requests and checks its deadline. `where` ends error messages (" (rank r
// of n)"). Operations must be advanced in posting order within a round,
// with `blocked` cleared at the start of each round.
OpStep advance(ActiveOp& op, MpiClock::time_point now, BlockedSources& blocked,
               const std::string& where);

}  // namespace ductile::accel
