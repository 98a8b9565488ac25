// The "optimal" elasticity policy: every batch size up to the cap searched
// (search.cpp) for the most valid GPU counts, in units of whole nodes of
// whole model replicas.
#include <algorithm>
#include <optional>

#include <fmt/format.h>

#include "plan.hpp"
#include "policy_plugin.hpp"
#include "search.hpp"

namespace ductile::elastic {

// The optimal search's unit: GPU counts are multiples of `unit` (whole nodes
// of whole model replicas), each with dp_per_unit data-parallel ranks, from
// lo to hi units.
struct OptimalUnits {
  u64 unit, dp_per_unit, lo, hi;
};

// The units of the settings; nullopt when lcm(num_gpus_per_node,
// model_parallel_size) exceeds 2^62.
std::optional<OptimalUnits> units_of(const Settings& s) {
  const u64 gpn = s.num_gpus_per_node, mp = s.model_parallel_size;
  // GPU counts are whole nodes made of whole model replicas: multiples of
  // lcm(gpn, mp) GPUs, each holding lcm / mp data-parallel ranks.
  auto unit_value = value_of(lcm(factorize(gpn), factorize(mp)));
  if (!unit_value) return std::nullopt;
  const u64 unit = *unit_value;
  return OptimalUnits{unit, unit / mp, (s.min_gpus + unit - 1) / unit, s.max_gpus / unit};
}

void check_optimal(const Settings& s) {
  const u64 gpn = s.num_gpus_per_node, mp = s.model_parallel_size;
  const auto units = units_of(s);
  if (!units)
    config_error(
        fmt::format("elasticity (optimal): lcm(num_gpus_per_node = {}, "
                    "model_parallel_size = {}) exceeds 2^62",
                    gpn, mp));
  if (units->lo > units->hi)
    config_error(
        fmt::format("elasticity (optimal): no GPU count between min_gpus = {} and "
                    "max_gpus = {} is a multiple of {} (whole nodes of num_gpus_per_node "
                    "= {} holding whole model replicas of model_parallel_size = {})",
                    s.min_gpus, s.max_gpus, units->unit, gpn, mp));
  for (u64 m : s.micro_batch_sizes)
    if (m > s.max_train_batch_size)
      config_error(
          fmt::format("micro batch size {} of micro_batch_sizes = {} is above "
                      "max_train_batch_size = {}: every micro batch must be <= {}",
                      m, format_list_short(s.micro_batch_sizes), s.max_train_batch_size,
                      s.max_train_batch_size));
}

ElasticityResult compute_optimal(const Settings& s, const ElasticityRequest& request) {
  const u64 world_size = request_world_size(request);
  require_world_size_for_micro_batch(request, world_size, "optimal");
  const u64 gpn = s.num_gpus_per_node, mp = s.model_parallel_size;
  // check_optimal ran in the validate hook, before the policy was created.
  const auto [unit, dp_per_unit, lo, hi] = *units_of(s);
  auto outcome = optimal_search(s.micro_batch_sizes, s.max_train_batch_size / dp_per_unit, lo, hi,
                                s.prefer_larger_batch);
  if (outcome.counts.empty())
    elasticity_error(ErrorKind::incompatible,
                     fmt::format("elasticity (optimal): no GPU count between min_gpus = {} and "
                                 "max_gpus = {} (in steps of {}) is valid for any batch size up to "
                                 "max_train_batch_size = {} with micro batches {}",
                                 s.min_gpus, s.max_gpus, unit, s.max_train_batch_size,
                                 format_list_short(s.micro_batch_sizes)));
  ElasticityResult r;
  r.model_parallel_size = static_cast<std::int64_t>(mp);
  r.num_gpus_per_node = static_cast<std::int64_t>(gpn);
  r.final_batch_size = static_cast<std::int64_t>(outcome.batch * dp_per_unit);
  for (u64 n : outcome.counts) {
    r.valid_gpus.push_back(static_cast<std::int64_t>(n * unit));  // n <= max_gpus / unit
    r.valid_dp_sizes.push_back(static_cast<std::int64_t>(n * dp_per_unit));
  }
  if (world_size) {
    check_world_size_in_list(r, world_size);
    const u64 dp = world_size / mp;
    r.world_size = static_cast<std::int64_t>(world_size);
    r.data_parallel_size = static_cast<std::int64_t>(dp);
    set_micro_batch(r, s.micro_batch_sizes, dp);
  }
  return r;
}

}  // namespace ductile::elastic

using OptimalPolicy = ductile::elastic::PolicyPlugin<&ductile::elastic::compute_optimal,
                                                     &ductile::elastic::check_optimal>;

DUCTILE_PLUGIN(OptimalPolicy, "optimal", "1.0.0",
               "Every batch size up to the cap: the most valid GPU counts, never fewer than v0.1",
               ductile::elastic::kElasticitySchema)
