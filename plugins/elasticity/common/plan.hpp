// The parts of an elastic plan that every built-in policy shares (the
// algorithms themselves live in each policy's folder: v0.1/, v0.2/,
// optimal/). A static library linked into each policy plugin; it exports
// nothing.
//
// v0.1 and v0.2 reproduce DeepSpeed's final elasticity (commit edaa722)
// integer for integer; the places where they differ on purpose are listed in
// plugins/elasticity/README.md and in the comments of each policy.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ductile/elasticity_policy.hpp"
#include "elastic_math.hpp"
#include "elastic_settings.hpp"

namespace ductile::elastic {

// Distinct micro batch sizes (ascending) with their factorizations, computed
// once per call.
struct MicroBatches {
  explicit MicroBatches(const std::vector<u64>& micro);
  std::vector<u64> values;
  std::vector<Factorization> factors;
  u64 smallest() const { return values.front(); }
};

// DeepSpeed's get_valid_gpus: every n in [lo, hi] such that some micro batch
// m divides `batch` and n divides batch / m. Sorted, distinct.
std::vector<u64> valid_counts(u64 batch, const Factorization& batch_factors,
                              const MicroBatches& micro, u64 lo, u64 hi);

// DeepSpeed's _get_compatible_gpus_v01 with the final semantics (bases above
// the cap skipped): v0.1's search, which v0.2 runs per node and the optimal
// search starts from. min_gpus / max_gpus of 0 take DeepSpeed's `or`
// defaults (1 and cap / smallest micro batch). `has_list` is false where
// DeepSpeed returns None (no candidate had a valid GPU count and none beat
// the smallest micro batch in the tie-break).
struct V01Outcome {
  u64 batch = 0;
  bool has_list = false;
  std::vector<u64> valid;
};
V01Outcome deepspeed_v01(const std::vector<u64>& micro_in_order, u64 cap, u64 min_gpus,
                         u64 max_gpus, bool prefer_larger, const std::string& cap_name);

// A list for a one-line message: at most 12 values, then how many more.
std::string format_list_short(const std::vector<u64>& values);

// The largest distinct micro batch dividing batch / dp (DeepSpeed's choice
// for a world size) and the resulting gradient accumulation steps, set on `r`.
void set_micro_batch(ElasticityResult& r, const std::vector<u64>& micro, u64 dp);

// A micro batch was asked for without a world size: ElasticityError.
void require_world_size_for_micro_batch(const ElasticityRequest& request, u64 world_size,
                                        const char* policy);

// The message for a batch with no valid GPU count.
std::string no_valid_count_message(const char* policy, const Settings& s, u64 batch);

// The world size must be one of r.valid_gpus: ElasticityIncompatibleWorldSize.
void check_world_size_in_list(const ElasticityResult& r, u64 world_size);

}  // namespace ductile::elastic
