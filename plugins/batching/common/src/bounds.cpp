// Lower bounds on the number of bins, to judge how close a packing is to
// optimal (Martello and Toth, "Lower bounds and reduction procedures for the
// bin packing problem", 1990).
#include <algorithm>
#include <vector>

#include "ductile_batching/packing.hpp"

namespace ductile::batching {

std::int64_t l2_lower_bound(std::span<const std::int64_t> count_by_length, std::int64_t capacity,
                            std::int64_t* l1) {
  const auto cap = static_cast<std::size_t>(capacity);
  const std::size_t top = std::min(count_by_length.size(), cap + 1);
  // Prefix counts and token sums over lengths 0..top-1.
  std::vector<std::int64_t> n(top + 1, 0), tokens(top + 1, 0);
  for (std::size_t len = 0; len < top; ++len) {
    n[len + 1] = n[len] + count_by_length[len];
    tokens[len + 1] = tokens[len] + count_by_length[len] * static_cast<std::int64_t>(len);
  }
  auto count_in = [&](std::size_t lo, std::size_t hi) {  // lengths in [lo, hi]
    if (lo > hi || lo >= top) return std::int64_t{0};
    return n[std::min(hi, top - 1) + 1] - n[lo];
  };
  auto sum_in = [&](std::size_t lo, std::size_t hi) {
    if (lo > hi || lo >= top) return std::int64_t{0};
    return tokens[std::min(hi, top - 1) + 1] - tokens[lo];
  };
  const std::int64_t total = sum_in(0, cap);
  const std::int64_t lower1 = (total + capacity - 1) / capacity;
  if (l1) *l1 = lower1;
  std::int64_t best = lower1;
  // For each alpha in [0, C/2]: J1 = (C - alpha, C], J2 = (C/2, C - alpha],
  // J3 = [alpha, C/2]. Items of J1 and J2 each need their own bin; J3 items
  // can only use what J2 bins leave free.
  for (std::size_t alpha = 0; alpha <= cap / 2; ++alpha) {
    const std::size_t half = cap / 2;  // lengths <= half are "small"
    const std::int64_t j1 = count_in(cap - alpha + 1, cap);
    const std::int64_t j2 = count_in(half + 1, cap - alpha);
    const std::int64_t j2_sum = sum_in(half + 1, cap - alpha);
    const std::int64_t j3_sum = sum_in(std::max<std::size_t>(alpha, 1), half);
    const std::int64_t spill = j3_sum - (j2 * capacity - j2_sum);
    const std::int64_t extra = spill > 0 ? (spill + capacity - 1) / capacity : 0;
    best = std::max(best, j1 + j2 + extra);
  }
  return best;
}

}  // namespace ductile::batching
