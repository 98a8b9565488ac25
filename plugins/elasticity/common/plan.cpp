// The parts of an elastic plan every built-in policy shares: valid GPU
// counts, DeepSpeed's v0.1 search (v0.2 runs it per node, optimal starts from
// its candidates), the micro batch for a world size and the messages.
//
// Deliberate differences from DeepSpeed (all documented in the README):
// - Integer arithmetic throughout; DeepSpeed divides in floating point in
//   v0.2, which is identical for every value below 2^52.
// - Where DeepSpeed crashes (TypeError on a None list, ZeroDivisionError,
//   ValueError for a micro batch above the cap) we throw a typed error.
// - v0.2 with model_parallel_size > 1: world size is the total GPU count and
//   the data-parallel size is world size / model_parallel_size (DeepSpeed
//   divides by it twice and rejects every world size).
// - v0.2 fallback: reported (fallback = true and a warning), and candidates
//   whose batch would be 0 (micro batch x data-parallel size above the cap)
//   are skipped; when none is left the world size is rejected instead of
//   returning DeepSpeed's batch size of 0.
#include <algorithm>
#include <unordered_set>

#include <fmt/format.h>

#include "plan.hpp"

namespace ductile::elastic {

namespace {
// Reserved for the divisors of a batch at most (a batch below 2^32 has at
// most 1,344); past it the list grows as divisors are found.
constexpr u64 kDivisorReserveLimit = 4096;
}  // namespace

MicroBatches::MicroBatches(const std::vector<u64>& micro) : values(micro) {
  std::sort(values.begin(), values.end());
  values.erase(std::unique(values.begin(), values.end()), values.end());
  for (u64 m : values) factors.push_back(factorize(m));
}

std::vector<u64> valid_counts(u64 batch, const Factorization& batch_factors,
                              const MicroBatches& micro, u64 lo, u64 hi) {
  // d GPUs are valid when some micro batch m divides batch / d, that is when
  // d divides batch and m divides batch / d: the divisors of batch (each once)
  // filtered, rather than the divisors of every batch / m merged.
  std::vector<u64> out;
  // Every divisor at most: one allocation rather than a doubling series.
  out.reserve(std::min<u64>(divisor_count(batch_factors), kDivisorReserveLimit));
  divisors_in_range(batch_factors, lo, hi, out);
  // Only the micro batches dividing the batch can divide a share of it, and
  // none above the share: filtered once, ascending, so that each divisor
  // scans the few that can still match rather than the whole list.
  std::vector<u64> dividing;
  for (u64 m : micro.values)
    if (batch % m == 0) dividing.push_back(m);
  std::erase_if(out, [&](u64 d) {
    const u64 per_gpu = batch / d;
    for (u64 m : dividing) {
      if (m > per_gpu) return true;
      if (per_gpu % m == 0) return false;
    }
    return true;
  });
  std::sort(out.begin(), out.end());
  return out;
}

V01Outcome deepspeed_v01(const std::vector<u64>& micro_in_order, u64 cap, u64 min_gpus,
                         u64 max_gpus, bool prefer_larger, const std::string& cap_name) {
  MicroBatches micro(micro_in_order);
  if (min_gpus == 0) min_gpus = 1;
  if (max_gpus == 0) max_gpus = cap / micro.smallest();
  for (u64 m : micro_in_order)
    if (m > cap)
      config_error(
          fmt::format("micro batch size {} of micro_batch_sizes = {} is above {} = {}: "
                      "every micro batch must be <= {}",
                      m, format_list_short(micro_in_order), cap_name, cap, cap));

  // Bases: each micro batch and their LCM; DeepSpeed's final code skips a
  // base above the cap (only the LCM can be).
  std::vector<Factorization> base_factors = micro.factors;
  std::vector<u64> bases = micro.values;
  Factorization lcm_factors;
  for (const auto& f : micro.factors) lcm_factors = lcm(lcm_factors, f);
  if (auto l = value_of(lcm_factors, cap)) {
    bases.push_back(*l);
    base_factors.push_back(lcm_factors);
  }
  struct Candidate {
    u64 batch;
    Factorization factors;
  };
  std::vector<Candidate> candidates;
  std::unordered_set<u64> seen;  // linear in the bases, where a scan of candidates is quadratic
  for (std::size_t i = 0; i < bases.size(); ++i) {
    u64 scale = deepspeed_hcn_scale(cap / bases[i]);
    u64 batch = scale * bases[i];  // <= cap: scale <= cap / base
    if (!seen.insert(batch).second) continue;
    candidates.push_back({batch, multiply(factorize(scale), base_factors[i])});
  }

  // DeepSpeed's get_best_candidates: most valid counts, ties by preference,
  // starting from (0 counts, smallest micro batch, no list). The order of
  // candidates does not matter: the comparison is a strict order on
  // (count, batch) and the batches are distinct.
  V01Outcome best;
  best.batch = micro.smallest();
  std::size_t best_count = 0;
  for (const auto& c : candidates) {
    auto valid = valid_counts(c.batch, c.factors, micro, min_gpus, max_gpus);
    bool better_batch = prefer_larger ? c.batch > best.batch : c.batch < best.batch;
    if (valid.size() > best_count || (valid.size() == best_count && better_batch)) {
      best_count = valid.size();
      best.batch = c.batch;
      best.valid = std::move(valid);
      best.has_list = true;
    }
  }
  return best;
}

// A list for a one-line message: at most 12 values, then how many more.
std::string format_list_short(const std::vector<u64>& values) {
  constexpr std::size_t kShown = 12;
  if (values.size() <= kShown) return format_list(values);
  std::vector<u64> head(values.begin(), values.begin() + kShown);
  std::string text = format_list(head);
  text.insert(text.size() - 1,
              fmt::format(", ... {} more up to {}", values.size() - kShown, values.back()));
  return text;
}

// The largest distinct micro batch dividing batch / dp (DeepSpeed's choice
// for a world size), and the resulting gradient accumulation steps.
// DeepSpeed's compute_elastic_config(world_size=N): the largest micro batch
// dividing batch / N, whatever prefer_larger_batch says, for v0.1 and v0.2
// alike, fallback included (its v0.2 get_microbatch, first in list order
// unless preferring larger, is returned only when the world size comes from
// $WORLD_SIZE, which ductile does not read). The v0.2 fallback applies it to
// the batch it keeps after skipping DeepSpeed's batch-0 candidates.
void set_micro_batch(ElasticityResult& r, const std::vector<u64>& micro, u64 dp) {
  std::vector<u64> sorted = micro;
  std::sort(sorted.rbegin(), sorted.rend());
  const u64 per_rank = static_cast<u64>(r.final_batch_size) / dp;
  for (u64 m : sorted) {
    if (per_rank % m == 0) {
      r.micro_batch_size = static_cast<std::int64_t>(m);
      r.gradient_accumulation_steps = static_cast<std::int64_t>(per_rank / m);
      return;
    }
  }
  // Unreachable for a world size in the valid list (it divides batch / m
  // for some m); DeepSpeed asserts here.
  elasticity_error(ErrorKind::internal,
                   fmt::format("no micro batch of {} divides the per-rank batch {} (batch {}, "
                               "data-parallel size {})",
                               format_list(micro), per_rank, r.final_batch_size, dp));
}

void require_world_size_for_micro_batch(const ElasticityRequest& request, u64 world_size,
                                        const char* policy) {
  if (request.require_micro_batch && world_size == 0)
    elasticity_error(ErrorKind::invalid_argument,
                     fmt::format("elasticity ({}): a micro batch size was requested and no "
                                 "world size was given; give the world size (the total number "
                                 "of GPUs, >= 1) to get one",
                                 policy));
}

std::string no_valid_count_message(const char* policy, const Settings& s, u64 batch) {
  return fmt::format(
      "elasticity ({}): no GPU count between min_gpus = {} and max_gpus = {} is "
      "valid for any candidate batch size (best candidate {} with micro batches {} "
      "and max_train_batch_size = {}); widen [min_gpus, max_gpus], raise "
      "max_train_batch_size or add smaller micro batches",
      policy, s.min_gpus, s.max_gpus, batch, format_list_short(s.micro_batch_sizes),
      s.max_train_batch_size);
}

void check_world_size_in_list(const ElasticityResult& r, u64 world_size) {
  if (std::find(r.valid_gpus.begin(), r.valid_gpus.end(), static_cast<std::int64_t>(world_size)) ==
      r.valid_gpus.end()) {
    std::vector<u64> valid(r.valid_gpus.begin(), r.valid_gpus.end());
    incompatible_world_size(
        fmt::format("World size ({}) is not valid with the current list of "
                    "valid GPU counts: {}",
                    world_size, format_list(valid)));
  }
}

}  // namespace ductile::elastic
