// The Martello-Toth L2 bound used to judge packings, on cases small enough
// to know the optimum by hand, and the rank assignment of the SDK.
#include <doctest/doctest.h>

#include <vector>

#include "ductile/batch_sampler.hpp"
#include "ductile_batching/packing.hpp"

using ductile::batching::l2_lower_bound;

namespace {
std::vector<std::int64_t> hist(std::int64_t capacity,
                               std::initializer_list<std::pair<std::int64_t, std::int64_t>> items) {
  std::vector<std::int64_t> h(static_cast<std::size_t>(capacity) + 1, 0);
  for (auto [len, n] : items) h[static_cast<std::size_t>(len)] += n;
  return h;
}
}  // namespace

TEST_CASE("L2 counts items over half the capacity one bin each, where L1 does not") {
  std::int64_t l1 = 0;
  // Three items of 6 in bins of 10: 18 tokens (L1 = 2) but no two share a bin.
  CHECK(l2_lower_bound(hist(10, {{6, 3}}), 10, &l1) == 3);
  CHECK(l1 == 2);
  // 6 + 4 pairs fill bins exactly: the optimum is 3 bins and L2 says 3.
  CHECK(l2_lower_bound(hist(10, {{6, 3}, {4, 3}}), 10, &l1) == 3);
  // Small items beyond the space the large ones leave need more bins:
  // 2 x 7 leave 6 free; 4 x 3 = 12 needs one more bin: 3.
  CHECK(l2_lower_bound(hist(10, {{7, 2}, {3, 4}}), 10, &l1) == 3);
  CHECK(l1 == 3);
  // Items of exactly the capacity and half the capacity.
  CHECK(l2_lower_bound(hist(8, {{8, 2}, {4, 3}}), 8, &l1) == 4);
}

TEST_CASE("ranks take micro-batches round robin after padding from the start") {
  // 5 micro-batches on 2 ranks: padded to 6 by repeating micro-batch 0.
  CHECK(ductile::microbatches_of_rank(5, 0, 2) == std::vector<std::size_t>{0, 2, 4});
  CHECK(ductile::microbatches_of_rank(5, 1, 2) == std::vector<std::size_t>{1, 3, 0});
  // Fewer micro-batches than ranks: repeated as often as needed.
  CHECK(ductile::microbatches_of_rank(2, 3, 5) == std::vector<std::size_t>{1});
  CHECK(ductile::microbatches_of_rank(6, 2, 3) == std::vector<std::size_t>{2, 5});
  CHECK_THROWS_AS(ductile::microbatches_of_rank(6, 3, 3), ductile::Error);
  CHECK_THROWS_AS(ductile::microbatches_of_rank(6, 0, 0), ductile::Error);
}
