// The clock of the coordinator's wait counters (the stats' *_wait_ns): how
// long the calling thread was blocked on a gather, a copy or an NVMe read.
// Internal to the partitioned coordinator.
#pragma once

#include <chrono>
#include <cstdint>

namespace ductile::zero {

using WaitClock = std::chrono::steady_clock;

/// Nanoseconds from `since` to now. Thread-safe; never throws.
inline std::uint64_t elapsed_ns(WaitClock::time_point since) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(WaitClock::now() - since).count());
}

}  // namespace ductile::zero
