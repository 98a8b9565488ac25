#include "elastic_settings.hpp"

#include <fmt/format.h>

namespace ductile::elastic {

void config_error(const std::string& message) {
  throw Error(ErrorKind::config, message, kElasticityConfigError);
}

void config_error_at(const std::string& key, const std::string& message) {
  throw ParamError(ErrorKind::config, key, message, kElasticityConfigError);
}

void incompatible_world_size(const std::string& message) {
  throw Error(ErrorKind::incompatible, message, kElasticityIncompatibleWorldSize);
}

void elasticity_error(ErrorKind kind, const std::string& message) {
  throw Error(kind, message, kElasticityError);
}

std::string format_list(const std::vector<u64>& values) {
  return fmt::format("[{}]", fmt::join(values, ", "));
}

std::vector<std::int64_t> to_signed(const std::vector<u64>& values) {
  return std::vector<std::int64_t>(values.begin(), values.end());
}

namespace {

constexpr const char* kLimitText = "2^62 (4611686018427387904)";

// The one read of an integer setting: checked against [min, 2^62], then
// carried as the unsigned value the arithmetic uses.
u64 checked_value(const Params& params, std::string_view key, std::int64_t min,
                  std::string_view policy) {
  const std::int64_t value = params.get_int(key);
  if (value < min)
    config_error_at(
        std::string(key),
        fmt::format("elasticity ({}): {} = {} is invalid: must be >= {}", policy, key, value, min));
  if (static_cast<u64>(value) > kMaxValue)
    config_error_at(std::string(key),
                    fmt::format("elasticity ({}): {} = {} is too large: must be <= {}", policy, key,
                                value, kLimitText));
  return static_cast<u64>(value);
}

}  // namespace

Settings read_settings(const Params& params, std::string_view policy) {
  if (!params.get_bool("enabled"))
    config_error(
        fmt::format("elasticity ({}): enabled = false: elasticity is disabled; set "
                    "enabled = true to compute an elastic plan",
                    policy));
  if (!params.has("max_train_batch_size"))
    config_error(
        fmt::format("elasticity ({}): the configuration is missing max_train_batch_size "
                    "(the largest acceptable global batch size, an integer >= 1)",
                    policy));
  if (!params.has("micro_batch_sizes"))
    config_error(
        fmt::format("elasticity ({}): the configuration is missing micro_batch_sizes "
                    "(a list of positive integers such as [2, 4, 6])",
                    policy));
  const auto& micro = params.get_int_list("micro_batch_sizes");
  if (micro.empty())
    config_error_at("micro_batch_sizes",
                    fmt::format("elasticity ({}): micro_batch_sizes = [] is invalid: give at least "
                                "one positive integer",
                                policy));
  if (micro.size() > kMaxMicroBatchSizes)
    config_error_at("micro_batch_sizes",
                    fmt::format("elasticity ({}): micro_batch_sizes has {} entries, more than the "
                                "{} accepted: list at most {} micro batch sizes",
                                policy, micro.size(), kMaxMicroBatchSizes, kMaxMicroBatchSizes));
  for (std::size_t i = 0; i < micro.size(); ++i) {
    if (micro[i] <= 0)
      config_error_at(
          "micro_batch_sizes",
          fmt::format("elasticity ({}): micro_batch_sizes = [{}] is invalid: element {} "
                      "({}) is not a positive integer; every micro batch must be >= 1",
                      policy, fmt::join(micro, ", "), i, micro[i]));
    if (static_cast<u64>(micro[i]) > kMaxValue)
      config_error_at(
          "micro_batch_sizes",
          fmt::format("elasticity ({}): micro_batch_sizes element {} = {} is too large: "
                      "must be <= {}",
                      policy, i, micro[i], kLimitText));
  }
  const std::int64_t min_gpus = params.get_int("min_gpus");
  const std::int64_t max_gpus = params.get_int("max_gpus");
  if (min_gpus < 1 || max_gpus < 1)
    config_error_at(min_gpus < 1 ? "min_gpus" : "max_gpus",
                    fmt::format("elasticity ({}): min_gpus and max_gpus must be >= 1, given "
                                "min_gpus = {}, max_gpus = {}",
                                policy, min_gpus, max_gpus));
  if (max_gpus < min_gpus)
    config_error_at("min_gpus",
                    fmt::format("elasticity ({}): min_gpus = {} is greater than max_gpus = {}; "
                                "min_gpus must be <= max_gpus",
                                policy, min_gpus, max_gpus));
  // DeepSpeed's order of checks, hence locals before the Settings.
  const u64 checked_min_gpus = checked_value(params, "min_gpus", 1, policy);
  const u64 checked_max_gpus = checked_value(params, "max_gpus", 1, policy);
  const u64 model_parallel_size = checked_value(params, "model_parallel_size", 1, policy);
  const u64 num_gpus_per_node = checked_value(params, "num_gpus_per_node", 1, policy);
  const u64 min_time = checked_value(params, "min_time", 0, policy);
  return Settings{.max_train_batch_size = checked_value(params, "max_train_batch_size", 1, policy),
                  .micro_batch_sizes = std::vector<u64>(micro.begin(), micro.end()),
                  .min_gpus = checked_min_gpus,
                  .max_gpus = checked_max_gpus,
                  .num_gpus_per_node = num_gpus_per_node,
                  .model_parallel_size = model_parallel_size,
                  .min_time = min_time,
                  .prefer_larger_batch = params.get_bool("prefer_larger_batch")};
}

u64 request_world_size(const ElasticityRequest& request) {
  if (request.world_size < 0)
    elasticity_error(
        ErrorKind::invalid_argument,
        fmt::format("world size {} is invalid: give a positive GPU count (or 0 for none)",
                    request.world_size));
  if (static_cast<u64>(request.world_size) > kMaxValue)
    elasticity_error(
        ErrorKind::invalid_argument,
        fmt::format("world size {} is too large: must be <= {}", request.world_size, kLimitText));
  return static_cast<u64>(request.world_size);
}

}  // namespace ductile::elastic
