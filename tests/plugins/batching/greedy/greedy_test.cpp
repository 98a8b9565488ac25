// Behaviour of the greedy sampler beyond the reference vectors.
#include <doctest/doctest.h>

#include <numeric>

#include "sampler_support.hpp"

namespace {
ductile::Params params(std::int64_t max_tokens) {
  ductile::Params p;
  p.set("max_tokens", max_tokens);
  return p;
}
std::vector<std::vector<std::int64_t>> groups(const ductile::PackResult& r) {
  std::vector<std::vector<std::int64_t>> out;
  for (std::size_t m = 0; m < r.microbatch_count(); ++m) {
    auto mb = r.microbatch(m);
    out.emplace_back(mb.begin(), mb.end());
  }
  return out;
}
}  // namespace

TEST_CASE("the final group DeepSpeed drops is emitted after its groups") {
  // DeepSpeed emits [[0, 1]] for three samples that all fit and drops id 2.
  std::vector<std::int64_t> lengths{1, 1, 1};
  auto r = batching_test::sampler("greedy", params(100))->pack({lengths, std::nullopt});
  CHECK(groups(r) == std::vector<std::vector<std::int64_t>>{{0, 1}, {2}});
  CHECK(r.leftover_ids.empty());
}

TEST_CASE("samples over max_tokens are dropped and listed, the rest packed in order") {
  std::vector<std::int64_t> lengths{5, 50, 3, 4, 60, 2};
  auto sampler = batching_test::sampler("greedy", params(10));
  auto r = sampler->pack({lengths, std::nullopt});
  CHECK(r.dropped_ids == std::vector<std::int64_t>{1, 4});
  // DeepSpeed's scan never lets a group end at the last sample, hence {3}
  // then the final group {5}.
  CHECK(groups(r) == std::vector<std::vector<std::int64_t>>{{0, 2}, {3}, {5}});
  batching_test::check_packing(r, lengths, batching_test::iota_ids(lengths.size()),
                               sampler->options());
}

TEST_CASE("a subset packs only those ids, in the subset's order, repeats included") {
  std::vector<std::int64_t> lengths{4, 4, 4, 4, 4, 4};
  std::vector<std::int64_t> subset{5, 1, 3, 1};
  auto sampler = batching_test::sampler("greedy", params(8));
  auto r = sampler->pack({lengths, subset});
  CHECK(groups(r) == std::vector<std::vector<std::int64_t>>{{5, 1}, {3}, {1}});
  batching_test::check_packing(r, lengths, subset, sampler->options());
}

TEST_CASE("padded budget bounds samples x longest, not the sum") {
  std::vector<std::int64_t> lengths{2, 2, 9, 1, 1, 1, 1};
  auto p = params(10);
  p.set("budget", std::string("padded"));
  auto sampler = batching_test::sampler("greedy", p);
  auto r = sampler->pack({lengths, std::nullopt});
  // {2,2} then 9 alone (2 x 9 > 10), then the 1s (the last one as the final group).
  CHECK(groups(r) == std::vector<std::vector<std::int64_t>>{{0, 1}, {2}, {3, 4, 5}, {6}});
  batching_test::check_packing(r, lengths, batching_test::iota_ids(lengths.size()),
                               sampler->options());
}

TEST_CASE("seqlen order sorts by length then id, and random order is Python's shuffle") {
  std::vector<std::int64_t> lengths{3, 1, 3, 1, 2};
  auto p = params(100);
  p.set("order", std::string("seqlen"));
  p.set("max_batch_size", std::int64_t{2});
  auto r = batching_test::sampler("greedy", p)->pack({lengths, std::nullopt});
  CHECK(groups(r) == std::vector<std::vector<std::int64_t>>{{1, 3}, {4, 0}, {2}});
  // random.Random(1234).shuffle(list(range(10))) == [2, 8, 3, 5, 6, 4, 9, 0, 1, 7]
  std::vector<std::int64_t> ten(10, 1);
  auto q = params(100);
  q.set("order", std::string("random"));
  q.set("max_batch_size", std::int64_t{1});
  auto s = batching_test::sampler("greedy", q)->pack({ten, std::nullopt});
  std::vector<std::int64_t> order(s.sample_ids.begin(), s.sample_ids.end());
  CHECK(order == std::vector<std::int64_t>{2, 8, 3, 5, 6, 4, 9, 0, 1, 7});
}

TEST_CASE("steps are trimmed to whole steps and the cut samples reported") {
  std::vector<std::int64_t> lengths(7, 5);
  auto p = params(10);
  p.set("effective_batch_size", std::int64_t{3});
  auto sampler = batching_test::sampler("greedy", p);
  auto r = sampler->pack({lengths, std::nullopt});
  // Four micro-batches {0,1} {2,3} {4,5} {6}: one step of three, {6} cut.
  CHECK(r.step_count() == 1);
  CHECK(r.batch_sizes == std::vector<std::int64_t>{6});
  CHECK(r.leftover_ids == std::vector<std::int64_t>{6});
  batching_test::check_packing(r, lengths, batching_test::iota_ids(lengths.size()),
                               sampler->options());
}

TEST_CASE("equal-size micro-batches interleave samples across a step") {
  std::vector<std::int64_t> lengths{1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto p = params(12);
  p.set("effective_batch_size", std::int64_t{2});
  p.set("same_size_microbatches", true);
  auto sampler = batching_test::sampler("greedy", p);
  auto r = sampler->pack({lengths, std::nullopt});
  // DeepSpeed's interleaving: micro-batch b of a step takes samples b, b+2, ...
  auto g = groups(r);
  REQUIRE(g.size() >= 2);
  CHECK(g[0] == std::vector<std::int64_t>{0, 2, 4});
  CHECK(g[1] == std::vector<std::int64_t>{1, 3, 5});
  batching_test::check_packing(r, lengths, batching_test::iota_ids(lengths.size()),
                               sampler->options());
}

TEST_CASE("bad requests fail with errors naming the position and value") {
  auto sampler = batching_test::sampler("greedy", params(10));
  std::vector<std::int64_t> zero{3, 0, 2};
  try {
    (void)sampler->pack({zero, std::nullopt});
    FAIL("a zero length was accepted");
  } catch (const ductile::Error& e) {
    CHECK(e.kind() == ductile::ErrorKind::invalid_argument);
    CHECK(std::string(e.what()).find("sample 1 has length 0") != std::string::npos);
  }
  std::vector<std::int64_t> lengths{3, 3};
  std::vector<std::int64_t> bad_subset{0, 7};
  CHECK_THROWS_WITH_AS((void)sampler->pack({lengths, bad_subset}),
                       doctest::Contains("subset entry 1 is sample id 7"), ductile::Error);
  std::vector<std::int64_t> empty;
  CHECK_THROWS_AS((void)sampler->pack({empty, std::nullopt}), ductile::Error);
  std::vector<std::int64_t> all_long{20, 30};
  try {
    (void)sampler->pack({all_long, std::nullopt});
    FAIL("nothing to pack was accepted");
  } catch (const ductile::Error& e) {
    CHECK(e.type() == "NotEnoughSamples");
  }
}

TEST_CASE("inconsistent batch size bounds are refused when the sampler is created") {
  auto p = params(10);
  p.set("min_batch_size", std::int64_t{4});
  p.set("max_batch_size", std::int64_t{2});
  CHECK_THROWS_WITH_AS(batching_test::sampler("greedy", p),
                       doctest::Contains("min_batch_size = 4 is larger than max_batch_size = 2"),
                       ductile::Error);
}

TEST_CASE(
    "an effective batch size beyond the samples is NotEnoughSamples, with no table that big") {
  // same_size_microbatches sizes a table by effective_batch_size: up to
  // 2^63 - 1 by the schema, so it must not be made before the sizes agree.
  std::vector<std::int64_t> lengths{1, 2, 3, 4, 5};
  for (bool same_size : {true, false}) {
    for (std::int64_t steps : {std::int64_t{6}, std::int64_t{1} << 40, INT64_MAX}) {
      auto p = params(10);
      p.set("effective_batch_size", steps);
      p.set("same_size_microbatches", same_size);
      auto sampler = batching_test::sampler("greedy", p);
      try {
        (void)sampler->pack({lengths, std::nullopt});
        FAIL("packed " << steps << " micro-batches per step from 5 samples");
      } catch (const ductile::Error& e) {
        CHECK(e.type() == "NotEnoughSamples");
      }
    }
  }
}
