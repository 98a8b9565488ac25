// The parameters shared by the built-in elasticity policies (DeepSpeed's
// `elasticity` keys and defaults) and DeepSpeed's configuration checks.
//
// The schema bounds are deliberately loose (types only): every range check
// is done here, by read_settings, because a schema's errors are the core's
// ConfigError while DeepSpeed's API promises ElasticityConfigError for every
// elasticity setting; TOML, DeepSpeed JSON and the embedding API all report
// it naming the key, the value and what is valid. read_settings is run by
// the policy's validate hook, which the core runs before it creates the
// policy and for `ductile config check`, and once more when the policy is
// created: it computes every plan from that copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/elasticity_policy.hpp"
#include "ductile/params.hpp"
#include "elastic_math.hpp"

namespace ductile::elastic {

inline constexpr ParamSpec kElasticitySchema[] = {
    {.key = "enabled",
     .type = ParamType::boolean,
     .flags = param_local,
     .default_value = "true",
     .doc = "Elasticity on. A TOML section that selects a policy opts in; DeepSpeed JSON keeps "
            "DeepSpeed's default (false)"},
    {.key = "max_train_batch_size",
     .type = ParamType::integer,
     .doc = "Largest acceptable global train batch size, 1 to 2^62; required (both checked by the "
            "policy, as ElasticityConfigError)"},
    {.key = "micro_batch_sizes",
     .type = ParamType::integer_list,
     .doc = "Acceptable micro batch sizes per GPU, positive integers; required (both checked by "
            "the policy, as ElasticityConfigError)"},
    {.key = "min_gpus",
     .type = ParamType::integer,
     .default_value = "1",
     .doc = "Fewest GPUs to plan for (>= 1)"},
    {.key = "max_gpus",
     .type = ParamType::integer,
     .default_value = "10000",
     .doc = "Most GPUs to plan for (>= min_gpus)"},
    {.key = "min_time",
     .type = ParamType::integer,
     .flags = param_local,
     .default_value = "0",
     .doc = "Minutes a scheduler should run the job before rescaling it (>= 0; 0 = unknown)"},
    {.key = "prefer_larger_batch",
     .type = ParamType::boolean,
     .default_value = "true",
     .doc = "Break ties between equally elastic batch sizes towards the larger one"},
    {.key = "num_gpus_per_node",
     .type = ParamType::integer,
     .default_value = "1",
     .doc = "GPUs per node (v0.2, optimal: plan whole nodes)"},
    {.key = "model_parallel_size",
     .type = ParamType::integer,
     .default_value = "1",
     .doc = "GPUs per model replica (v0.2, optimal); data-parallel size = GPUs / this"},
    {.key = "ignore_non_elastic_batch_info",
     .type = ParamType::boolean,
     .flags = param_local,
     .default_value = "false",
     .doc = "Accepted for DeepSpeed compatibility: batch settings outside the elastic block are "
            "ignored"},
};

// The most entries micro_batch_sizes may hold. DeepSpeed configurations list
// a handful of per-GPU micro batches (its own examples give 2 to 8); 1024
// leaves room for any sweep a user would write while bounding the work that
// grows with the list (each entry is a candidate batch whose divisors are
// tested against the entries): v0.1 and v0.2 plan 1024 entries in well
// under a second with the default max_gpus. The count is checked before
// any element is read, so a long list is refused at once by `config
// check`, `ductile elastic` and every other caller alike.
inline constexpr std::size_t kMaxMicroBatchSizes = 1024;

// Throws ductile::Error typed ElasticityConfigError (ErrorKind::config).
[[noreturn]] void config_error(const std::string& message);
// Same, as a ParamError naming `key` (config check points at it).
[[noreturn]] void config_error_at(const std::string& key, const std::string& message);
// Throws ductile::Error typed ElasticityIncompatibleWorldSize (ErrorKind::incompatible).
[[noreturn]] void incompatible_world_size(const std::string& message);
// Throws ductile::Error typed ElasticityError with the given kind.
[[noreturn]] void elasticity_error(ErrorKind kind, const std::string& message);

// The checked settings, all values in [1, 2^62] unless said otherwise. No
// member has a default: every value comes from the parameters, whose only
// defaults are kElasticitySchema's.
struct Settings {
  u64 max_train_batch_size;
  std::vector<u64> micro_batch_sizes;  // as given: order kept, duplicates allowed
  u64 min_gpus;
  u64 max_gpus;
  u64 num_gpus_per_node;
  u64 model_parallel_size;
  u64 min_time;  // may be 0
  bool prefer_larger_batch;
};

// The parameters as Settings, the one read of every value: DeepSpeed's checks
// in DeepSpeed's order (enabled, required keys present, micro batches
// positive, min/max GPUs, model parallel size, GPUs per node, min_time,
// max_train_batch_size) plus ours (the list is not empty, holds at most
// kMaxMicroBatchSizes entries and no value exceeds 2^62), each value then
// converted once from the parameter's int64 to the unsigned type the
// arithmetic uses. `policy` names the policy in messages. Throws
// ElasticityConfigError (a ParamError naming the key where there is one).
Settings read_settings(const Params& params, std::string_view policy);

// The world size of a request, validated (0 = not given).
u64 request_world_size(const ElasticityRequest& request);

// Formats a list as DeepSpeed prints it: [1, 2, 3].
std::string format_list(const std::vector<u64>& values);

// Copies unsigned values into the SDK's signed result lists.
std::vector<std::int64_t> to_signed(const std::vector<u64>& values);

}  // namespace ductile::elastic
