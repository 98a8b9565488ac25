// The "v0.1" elasticity policy: DeepSpeed's elasticity v0.1 (the search
// itself, deepspeed_v01, is in common/plan.cpp: v0.2 and optimal run it too).
// Where DeepSpeed crashes (TypeError on a None list, ZeroDivisionError,
// ValueError for a micro batch above the cap) a typed error is thrown.
#include <algorithm>

#include <fmt/format.h>

#include "plan.hpp"
#include "policy_plugin.hpp"

namespace ductile::elastic {

void check_v01(const Settings& s) {
  if (s.model_parallel_size > 1)
    config_error(
        fmt::format("elasticity (v0.1) does not support model-parallel training: given "
                    "model_parallel_size = {}; use policy v0.2 (version = 0.2) or "
                    "optimal, or set model_parallel_size = 1",
                    s.model_parallel_size));
}

// check_v01 ran in the validate hook, before the policy was created.
ElasticityResult compute_v01(const Settings& s, const ElasticityRequest& request) {
  const u64 world_size = request_world_size(request);
  require_world_size_for_micro_batch(request, world_size, "v0.1");
  auto outcome = deepspeed_v01(s.micro_batch_sizes, s.max_train_batch_size, s.min_gpus, s.max_gpus,
                               s.prefer_larger_batch, "max_train_batch_size");
  if (!outcome.has_list)
    elasticity_error(ErrorKind::incompatible, no_valid_count_message("v0.1", s, outcome.batch));
  ElasticityResult r;
  r.final_batch_size = static_cast<std::int64_t>(outcome.batch);
  r.valid_gpus = to_signed(outcome.valid);
  r.valid_dp_sizes = r.valid_gpus;
  r.num_gpus_per_node = static_cast<std::int64_t>(s.num_gpus_per_node);
  if (outcome.valid.empty())
    r.warnings.push_back(fmt::format(
        "no GPU count between min_gpus = {} and max_gpus = {} is valid for batch size {}: the job "
        "cannot run at any size with this configuration",
        s.min_gpus, s.max_gpus, outcome.batch));
  if (world_size) {
    check_world_size_in_list(r, world_size);
    r.world_size = r.data_parallel_size = static_cast<std::int64_t>(world_size);
    set_micro_batch(r, s.micro_batch_sizes, world_size);
  }
  return r;
}

}  // namespace ductile::elastic

using DeepSpeedV01Policy =
    ductile::elastic::PolicyPlugin<&ductile::elastic::compute_v01, &ductile::elastic::check_v01>;

DUCTILE_PLUGIN(DeepSpeedV01Policy, "v0.1", "1.0.0",
               "DeepSpeed elasticity v0.1: HCN-scaled candidates, most valid GPU counts",
               ductile::elastic::kElasticitySchema)
