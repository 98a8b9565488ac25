// The optimal policy over random configurations: never fewer valid GPU
// counts than v0.1, every listed count really valid, the list complete, and
// (for small caps) no batch size up to the cap with more valid counts, found
// by brute force. Prints how often and by how much it beats v0.1.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>

#include "policy_support.hpp"

using namespace ductile;
using test::ElasticConfig;

namespace {

ElasticConfig random_config(std::mt19937_64& rng, std::int64_t max_cap) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  ElasticConfig c;
  c.cap = pick(8, max_cap);
  c.micro.clear();
  const int count = static_cast<int>(pick(1, 4));
  for (int i = 0; i < count; ++i) c.micro.push_back(pick(1, std::min<std::int64_t>(64, c.cap)));
  c.min_gpus = pick(0, 3) == 0 ? pick(1, 64) : 1;
  c.max_gpus = pick(0, 2) == 0 ? pick(c.min_gpus, c.min_gpus + 500) : 10000;
  c.prefer_larger = pick(0, 1) == 1;
  return c;
}

// The most valid counts any batch size in [1, cap] has (brute force).
std::size_t brute_best_count(const ElasticConfig& c) {
  std::size_t best = 0;
  for (std::int64_t b = 1; b <= c.cap; ++b) {
    std::size_t n = 0;
    for (std::int64_t g = c.min_gpus; g <= std::min(c.max_gpus, b); ++g)
      n += test::count_is_valid(b, c.micro, g);
    best = std::max(best, n);
  }
  return best;
}

struct Stats {
  int compared = 0, better = 0, equal = 0;
  std::size_t total_gain = 0, max_gain = 0;
  double total_ratio = 0;
};

void compare(const ElasticConfig& c, Stats& stats, bool brute_force) {
  CAPTURE(c.cap);
  CAPTURE(c.min_gpus);
  CAPTURE(c.max_gpus);
  CAPTURE(c.prefer_larger);
  CAPTURE(c.micro.size());
  auto v01 = test::thrown_by([] {});
  ElasticityResult old_plan, new_plan;
  v01 = test::thrown_by([&] { old_plan = test::make_policy("v0.1", c)->compute({}); });
  auto opt = test::thrown_by([&] { new_plan = test::make_policy("optimal", c)->compute({}); });
  if (!opt.type.empty()) {
    // Optimal finds nothing only when no batch has a valid count; then
    // v0.1 cannot have one either.
    CHECK(opt.type == "ElasticityError");
    if (v01.type.empty()) CHECK(old_plan.valid_gpus.empty());
    if (brute_force) CHECK(brute_best_count(c) == 0);
    return;
  }
  CHECK(new_plan.final_batch_size <= c.cap);
  // Listed counts are exactly the valid ones of the chosen batch.
  if (c.max_gpus <= 20000)
    CHECK(new_plan.valid_gpus ==
          test::brute_valid_counts(new_plan.final_batch_size, c.micro, c.min_gpus, c.max_gpus));
  if (brute_force) CHECK(new_plan.valid_gpus.size() == brute_best_count(c));
  if (!v01.type.empty()) return;
  ++stats.compared;
  CHECK(new_plan.valid_gpus.size() >= old_plan.valid_gpus.size());
  if (new_plan.valid_gpus.size() > old_plan.valid_gpus.size()) {
    ++stats.better;
    std::size_t gain = new_plan.valid_gpus.size() - old_plan.valid_gpus.size();
    stats.total_gain += gain;
    stats.max_gain = std::max(stats.max_gain, gain);
    stats.total_ratio += old_plan.valid_gpus.empty()
                             ? 0.0
                             : static_cast<double>(new_plan.valid_gpus.size()) /
                                   static_cast<double>(old_plan.valid_gpus.size());
  } else {
    ++stats.equal;
  }
}

void report(const char* what, const Stats& s) {
  MESSAGE(std::string(what) << ": optimal beats v0.1 on " << s.better << " of " << s.compared
                            << " configs (equal on " << s.equal << "); mean gain "
                            << (s.better ? static_cast<double>(s.total_gain) / s.better : 0.0)
                            << " GPU counts (x" << (s.better ? s.total_ratio / s.better : 1.0)
                            << " on average), max gain " << s.max_gain);
}

}  // namespace

TEST_CASE("optimal >= v0.1 and truly optimal: small caps, checked by brute force") {
  std::mt19937_64 rng(20261122);
  Stats stats;
  for (int i = 0; i < 150; ++i) compare(random_config(rng, 600), stats, true);
  report("caps <= 600", stats);
  CHECK(stats.compared > 100);
}

TEST_CASE("optimal >= v0.1: caps up to 10^6 (exhaustive search)") {
  std::mt19937_64 rng(7);
  Stats stats;
  for (int i = 0; i < 60; ++i) compare(random_config(rng, 1000000), stats, false);
  report("caps <= 10^6", stats);
  CHECK(stats.compared > 40);
}

TEST_CASE("optimal >= v0.1: caps above 2^21 (candidate search)") {
  std::mt19937_64 rng(99);
  Stats stats;
  for (int i = 0; i < 10; ++i) {
    auto c = random_config(rng, std::int64_t{1} << (i < 5 ? 32 : 40));
    c.cap = std::max<std::int64_t>(c.cap, (std::int64_t{1} << 21) + 1);
    compare(c, stats, false);
  }
  report("caps in (2^21, 2^40]", stats);
  CHECK(stats.compared > 6);
}

TEST_CASE("optimal counts whole nodes when num_gpus_per_node > 1") {
  std::mt19937_64 rng(3);
  for (int i = 0; i < 40; ++i) {
    auto c = random_config(rng, 400);
    c.gpus_per_node = std::int64_t{1} << (i % 4);
    c.max_gpus = std::max(c.max_gpus, c.min_gpus + c.gpus_per_node);
    CAPTURE(c.gpus_per_node);
    ElasticityResult plan;
    auto e = test::thrown_by([&] { plan = test::make_policy("optimal", c)->compute({}); });
    if (!e.type.empty()) continue;
    // In node units: a node count k is valid when m * k * gpn | batch; the
    // same brute force as above on batch sizes that are multiples of gpn.
    std::size_t best = 0;
    for (std::int64_t b = 1; b <= c.cap; ++b) {
      std::size_t n = 0;
      for (std::int64_t g = c.gpus_per_node; g <= std::min(c.max_gpus, b); g += c.gpus_per_node)
        n += g >= c.min_gpus && test::count_is_valid(b, c.micro, g);
      best = std::max(best, n);
    }
    CHECK(plan.valid_gpus.size() == best);
    for (auto g : plan.valid_gpus) {
      CHECK(g % c.gpus_per_node == 0);
      CHECK(g >= c.min_gpus);
      CHECK(g <= c.max_gpus);
      CHECK(test::count_is_valid(plan.final_batch_size, c.micro, g));
    }
  }
}
