// Shared by the batching plugin tests: loading the real plugins and checking
// every invariant of a packing against the request it came from.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

#include <doctest/doctest.h>

#include "ductile/batch_sampler.hpp"
#include "ductile/core/runtime.hpp"

namespace batching_test {

inline ductile::core::Runtime& runtime() {
  static ductile::core::Runtime rt = [] {
    ductile::core::RuntimeOptions options;
    options.extra_plugin_dirs.emplace_back(DUCTILE_PLUGIN_DIR);
    return ductile::core::Runtime::from_string("", "batching test", options);
  }();
  return rt;
}

inline std::shared_ptr<ductile::BatchSampler> sampler(const std::string& name,
                                                      const ductile::Params& params) {
  return runtime().create<ductile::BatchSampler>(name, params);
}

// Checks what every sampler guarantees; returns the packed token count.
inline std::int64_t check_packing(const ductile::PackResult& r,
                                  std::span<const std::int64_t> lengths,
                                  const std::vector<std::int64_t>& requested,
                                  const ductile::PackOptions& o) {
  const auto per_step = static_cast<std::size_t>(o.effective_batch_size);
  REQUIRE(r.microbatch_offsets.size() == r.microbatch_count() + 1);
  REQUIRE(r.microbatch_offsets.back() == r.sample_ids.size());
  REQUIRE(r.microbatch_count() % per_step == 0);
  REQUIRE(r.step_count() * per_step == r.microbatch_count());
  REQUIRE(r.batch_max_seqlens.size() == r.step_count());
  std::int64_t tokens = 0;
  for (std::size_t s = 0; s < r.step_count(); ++s) {
    std::int64_t samples = 0, longest = 0;
    std::size_t size0 = r.microbatch(s * per_step).size();
    for (std::size_t m = s * per_step; m < (s + 1) * per_step; ++m) {
      CHECK(r.microbatch_steps[m] == static_cast<std::int64_t>(s));
      auto mb = r.microbatch(m);
      REQUIRE(!mb.empty());
      std::int64_t sum = 0, mb_longest = 0;
      for (auto id : mb) {
        sum += lengths[static_cast<std::size_t>(id)];
        mb_longest = std::max(mb_longest, lengths[static_cast<std::size_t>(id)]);
      }
      if (o.budget == ductile::TokenBudget::sum)
        CHECK(sum <= o.max_tokens);
      else
        CHECK(mb_longest * static_cast<std::int64_t>(mb.size()) <= o.max_tokens);
      if (o.min_batch_size > 0) CHECK(static_cast<std::int64_t>(mb.size()) >= o.min_batch_size);
      if (o.max_batch_size > 0) CHECK(static_cast<std::int64_t>(mb.size()) <= o.max_batch_size);
      if (o.same_size_microbatches) CHECK(mb.size() == size0);
      samples += static_cast<std::int64_t>(mb.size());
      longest = std::max(longest, mb_longest);
      tokens += sum;
    }
    CHECK(r.batch_sizes[s] == samples);
    CHECK(r.batch_max_seqlens[s] == longest);
  }
  // Every requested sample is accounted for exactly as often as requested.
  std::map<std::int64_t, std::int64_t> want, got;
  for (auto id : requested) ++want[id];
  for (auto id : r.sample_ids) ++got[id];
  for (auto id : r.leftover_ids) ++got[id];
  for (auto id : r.dropped_ids) {
    CHECK(lengths[static_cast<std::size_t>(id)] > o.max_tokens);
    ++got[id];
  }
  CHECK(want == got);
  for (auto id : r.sample_ids) CHECK(lengths[static_cast<std::size_t>(id)] <= o.max_tokens);
  CHECK(std::is_sorted(r.dropped_ids.begin(), r.dropped_ids.end()));
  CHECK(std::is_sorted(r.leftover_ids.begin(), r.leftover_ids.end()));
  return tokens;
}

inline std::vector<std::int64_t> iota_ids(std::size_t n) {
  std::vector<std::int64_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::int64_t>(i);
  return v;
}

}  // namespace batching_test
