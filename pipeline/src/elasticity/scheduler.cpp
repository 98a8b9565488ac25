// The scheduler contract: the settings that change an elastic plan, compared
// between the resource scheduler's copy of the configuration (environment)
// and the runtime's. See ductile/pipeline/elasticity.hpp.
#include <cctype>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ductile/pipeline/elasticity.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {

ElasticityFingerprint fingerprint_of(const std::string& policy, const Params& params) {
  ElasticityFingerprint f;
  f.policy = policy;
  auto get_int = [&](const char* key, std::int64_t fallback) {
    const auto& values = params.values();
    auto it = values.find(key);
    if (it != values.end())
      if (auto* i = std::get_if<std::int64_t>(&it->second)) return *i;
    return fallback;
  };
  const auto& values = params.values();
  if (auto it = values.find("max_train_batch_size"); it != values.end())
    if (auto* i = std::get_if<std::int64_t>(&it->second)) f.max_train_batch_size = *i;
  if (auto it = values.find("micro_batch_sizes"); it != values.end())
    if (auto* l = std::get_if<std::vector<std::int64_t>>(&it->second)) f.micro_batch_sizes = *l;
  f.min_gpus = get_int("min_gpus", 1);
  f.max_gpus = get_int("max_gpus", 10000);
  f.num_gpus_per_node = get_int("num_gpus_per_node", 1);
  f.model_parallel_size = get_int("model_parallel_size", 1);
  if (auto it = values.find("prefer_larger_batch"); it != values.end())
    if (auto* b = std::get_if<bool>(&it->second)) f.prefer_larger_batch = *b;
  return f;
}

namespace {

template <class T>
std::string show_value(const std::optional<T>& v) {
  if (!v) return "(not set)";
  if constexpr (std::is_same_v<T, std::vector<std::int64_t>>)
    return fmt::format("[{}]", fmt::join(*v, ", "));
  else
    return fmt::format("{}", *v);
}

std::vector<std::string> differences(const ElasticityFingerprint& scheduler,
                                     const ElasticityFingerprint& runtime) {
  std::vector<std::string> out;
  auto compare = [&](const char* field, auto a, auto b) {
    if (a != b)
      out.push_back(
          fmt::format("'{}={}' seen by the resource scheduler does not match '{}={}' "
                      "passed to the runtime",
                      field, show_value(std::optional(a)), field, show_value(std::optional(b))));
  };
  auto compare_opt = [&](const char* field, const auto& a, const auto& b) {
    if (a != b)
      out.push_back(
          fmt::format("'{}={}' seen by the resource scheduler does not match '{}={}' "
                      "passed to the runtime",
                      field, show_value(a), field, show_value(b)));
  };
  compare("policy", scheduler.policy, runtime.policy);
  compare_opt("max_train_batch_size", scheduler.max_train_batch_size, runtime.max_train_batch_size);
  compare_opt("micro_batch_sizes", scheduler.micro_batch_sizes, runtime.micro_batch_sizes);
  compare("min_gpus", scheduler.min_gpus, runtime.min_gpus);
  compare("max_gpus", scheduler.max_gpus, runtime.max_gpus);
  compare("num_gpus_per_node", scheduler.num_gpus_per_node, runtime.num_gpus_per_node);
  compare("model_parallel_size", scheduler.model_parallel_size, runtime.model_parallel_size);
  compare("prefer_larger_batch", scheduler.prefer_larger_batch, runtime.prefer_larger_batch);
  return out;
}

bool scheduler_config_set() {
  for (const char* name : {kDeepSpeedElasticityConfigEnv, kDuctileElasticityConfigEnv}) {
    const char* value = std::getenv(name);
    if (value && *value) return true;
  }
  return false;
}

}  // namespace

bool check_scheduler_elasticity(const ElasticityFingerprint& runtime,
                                const std::shared_ptr<spdlog::logger>& logger) {
  // Plugins are looked up only when the scheduler passed a configuration.
  if (!scheduler_config_set())
    return check_scheduler_elasticity(runtime, logger, core::PluginRegistry({}, nullptr));
  return check_scheduler_elasticity(runtime, logger, detail::default_registry());
}

bool check_scheduler_elasticity(const ElasticityFingerprint& runtime,
                                const std::shared_ptr<spdlog::logger>& logger,
                                const core::PluginRegistry& registry) {
  bool checked = false;
  std::vector<std::string> problems;
  for (const char* name : {kDeepSpeedElasticityConfigEnv, kDuctileElasticityConfigEnv}) {
    const char* value = std::getenv(name);
    if (!value || !*value) continue;  // empty counts as unset
    checked = true;
    std::string_view text(value);
    ElasticitySource scheduler;
    if (std::string_view(name) == kDeepSpeedElasticityConfigEnv || is_json_config({}, text))
      scheduler = elasticity_from_deepspeed_json(text, name, registry);
    else
      scheduler = elasticity_from_toml_text(text, name, registry);
    for (auto& d : differences(fingerprint_of(scheduler.policy, scheduler.params), runtime))
      problems.push_back(fmt::format("{}: {}", name, d));
  }
  if (!problems.empty())
    detail::elasticity_config_error(
        fmt::format("the elastic configuration differs from the one the resource "
                    "scheduler used to size this job:\n  {}",
                    fmt::join(problems, "\n  ")));
  if (!checked && logger)
    logger->warn(
        "neither {} nor {} is set: cannot verify that the resource scheduler scales this "
        "job to GPU counts valid for its elastic configuration",
        kDeepSpeedElasticityConfigEnv, kDuctileElasticityConfigEnv);
  return checked;
}

}  // namespace ductile::pipeline
