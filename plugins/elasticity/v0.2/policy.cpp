// The "v0.2" elasticity policy: DeepSpeed's elasticity v0.2, v0.1's search
// per node. Deliberate differences from DeepSpeed (all documented in the
// README):
// - Integer arithmetic throughout; DeepSpeed divides in floating point,
//   which is identical for every value below 2^52.
// - With model_parallel_size > 1: world size is the total GPU count and
//   the data-parallel size is world size / model_parallel_size (DeepSpeed
//   divides by it twice and rejects every world size).
// - Fallback: reported (fallback = true and a warning), and candidates
//   whose batch would be 0 (micro batch x data-parallel size above the cap)
//   are skipped; when none is left the world size is rejected instead of
//   returning DeepSpeed's batch size of 0.
#include <algorithm>

#include <fmt/format.h>

#include "plan.hpp"
#include "policy_plugin.hpp"

namespace ductile::elastic {

void check_v02(const Settings& s) {
  if (s.num_gpus_per_node % s.model_parallel_size != 0)
    elasticity_error(ErrorKind::config,
                     fmt::format("elasticity (v0.2): num_gpus_per_node = {} must be divisible by "
                                 "model_parallel_size = {} (a model replica may not span nodes)",
                                 s.num_gpus_per_node, s.model_parallel_size));
}

ElasticityResult compute_v02(const Settings& s, const ElasticityRequest& request) {
  const u64 world_size = request_world_size(request);
  if (world_size == 0)
    // Worded for every caller (the CLI, the agent, the Python API): each
    // front end names its own way of giving a world size.
    config_error(
        "elasticity (v0.2) computes its batch size for one world size (the total number of "
        "GPUs, >= 1), and no world size was given; give the world size, or use policy v0.1 or "
        "optimal for a plan valid at every GPU count");
  // check_v02 ran in the validate hook, before the policy was created.
  const u64 gpn = s.num_gpus_per_node, mp = s.model_parallel_size;
  const u64 dp_per_node = gpn / mp;
  const u64 node_cap = s.max_train_batch_size / dp_per_node;
  // DeepSpeed's node-level search: int(min_gpus / gpn) and int(max_gpus /
  // gpn), where a 0 falls back to v0.1's defaults (1 and cap / micro).
  auto outcome = deepspeed_v01(s.micro_batch_sizes, node_cap, s.min_gpus / gpn, s.max_gpus / gpn,
                               s.prefer_larger_batch,
                               fmt::format("max_train_batch_size = {} divided by the {} "
                                           "data-parallel ranks per node",
                                           s.max_train_batch_size, dp_per_node));
  if (!outcome.has_list)
    elasticity_error(ErrorKind::incompatible,
                     no_valid_count_message("v0.2", s, outcome.batch * dp_per_node));

  ElasticityResult r;
  r.model_parallel_size = static_cast<std::int64_t>(mp);
  r.num_gpus_per_node = static_cast<std::int64_t>(gpn);
  r.final_batch_size = static_cast<std::int64_t>(outcome.batch * dp_per_node);
  for (u64 nodes : outcome.valid) {
    auto gpus = checked_mul(nodes, gpn);
    if (!gpus)
      elasticity_error(ErrorKind::incompatible,
                       fmt::format("elasticity (v0.2): {} nodes of {} GPUs exceed 2^62 GPUs; "
                                   "set max_gpus",
                                   nodes, gpn));
    r.valid_gpus.push_back(static_cast<std::int64_t>(*gpus));
    r.valid_dp_sizes.push_back(static_cast<std::int64_t>(nodes * dp_per_node));
  }
  if (world_size % mp != 0)
    incompatible_world_size(
        fmt::format("World size ({}) is not a multiple of model_parallel_size "
                    "= {}: the GPUs cannot be split into whole model replicas",
                    world_size, mp));
  const u64 dp = world_size / mp;
  r.world_size = static_cast<std::int64_t>(world_size);
  r.data_parallel_size = static_cast<std::int64_t>(dp);
  if (std::find(r.valid_dp_sizes.begin(), r.valid_dp_sizes.end(), static_cast<std::int64_t>(dp)) ==
      r.valid_dp_sizes.end()) {
    // DeepSpeed's fallback: a batch valid for this data-parallel size only,
    // the largest (or smallest) multiple of micro batch x dp within the cap.
    std::vector<u64> feasible;
    for (u64 m : s.micro_batch_sizes) {
      auto unit = checked_mul(m, dp);
      if (!unit || *unit > s.max_train_batch_size) continue;  // DeepSpeed: batch 0
      feasible.push_back(s.max_train_batch_size / *unit * *unit);
    }
    std::vector<u64> valid(r.valid_gpus.begin(), r.valid_gpus.end());
    if (feasible.empty())
      incompatible_world_size(fmt::format(
          "World size ({}) is not valid with the current list of valid GPU counts: {}, and too "
          "large for a batch of its own: the smallest micro batch ({}) on {} data-parallel ranks "
          "exceeds max_train_batch_size = {}",
          world_size, format_list(valid),
          *std::min_element(s.micro_batch_sizes.begin(), s.micro_batch_sizes.end()), dp,
          s.max_train_batch_size));
    const u64 batch = s.prefer_larger_batch ? *std::max_element(feasible.begin(), feasible.end())
                                            : *std::min_element(feasible.begin(), feasible.end());
    r.warnings.push_back(fmt::format(
        "world size {} is not in the valid list {}: falling back to batch size {} (instead of "
        "{}), valid for this world size only; the global batch changes when the job is rescaled{}",
        world_size, format_list_short(valid), batch, r.final_batch_size,
        world_size < s.min_gpus || world_size > s.max_gpus
            ? fmt::format(" (and {} is outside [min_gpus, max_gpus] = [{}, {}])", world_size,
                          s.min_gpus, s.max_gpus)
            : std::string()));
    r.fallback = true;
    r.final_batch_size = static_cast<std::int64_t>(batch);
    r.valid_gpus = {static_cast<std::int64_t>(world_size)};
    r.valid_dp_sizes = {static_cast<std::int64_t>(dp)};
  } else if (r.valid_gpus.empty()) {
    r.warnings.push_back("no GPU count is valid for this configuration");
  }
  set_micro_batch(r, s.micro_batch_sizes, dp);
  return r;
}

}  // namespace ductile::elastic

using DeepSpeedV02Policy =
    ductile::elastic::PolicyPlugin<&ductile::elastic::compute_v02, &ductile::elastic::check_v02>;

DUCTILE_PLUGIN(DeepSpeedV02Policy, "v0.2", "1.0.0",
               "DeepSpeed elasticity v0.2: node-aware, model-parallel aware, reported fallback",
               ductile::elastic::kElasticitySchema)
