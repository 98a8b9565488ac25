// The optimal policy's search (search.cpp).
#pragma once

#include <vector>

#include "plan.hpp"

namespace ductile::elastic {

// The optimal search in data-parallel units: the batch b <= cap with the most
// n in [lo, hi] such that m * n divides b for some micro batch m; ties by
// prefer_larger. Exhaustive over every b when cap <= kExhaustiveLimit;
// above, over every multiple of a micro batch (or an LCM of several) by a
// product of primorials, plus DeepSpeed's v0.1 candidates, so never worse
// than v0.1. `counts` empty means no b has any valid n.
inline constexpr u64 kExhaustiveLimit = u64{1} << 21;
struct SearchOutcome {
  u64 batch = 0;
  std::vector<u64> counts;
  bool exhaustive = false;
};
SearchOutcome optimal_search(const std::vector<u64>& micro, u64 cap, u64 lo, u64 hi,
                             bool prefer_larger);

}  // namespace ductile::elastic
