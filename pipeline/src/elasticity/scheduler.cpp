// The scheduler contract: the settings that change an elastic plan, compared
// between the resource scheduler's copy of the configuration (environment)
// and the runtime's. See ductile/pipeline/elasticity.hpp.
#include <cctype>
#include <cstdlib>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ductile/core/config.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {

ElasticityFingerprint fingerprint_of(const std::string& policy, const Params& params) {
  return {policy, params};
}

namespace {

std::string shown(const Params& params, const std::string& key) {
  const auto& values = params.values();
  auto it = values.find(key);
  return it == values.end() ? "(not set)" : core::format_param_value(it->second);
}

// Every key of the policy's schema that changes its plan (the keys it marks
// param_local aside), compared: the policy's schema says what they are, so a
// new policy needs no word here.
std::vector<std::string> differences(const core::PluginInfo& info,
                                     const ElasticityFingerprint& scheduler,
                                     const ElasticityFingerprint& runtime) {
  std::vector<std::string> out;
  auto differ = [&](const std::string& field, const std::string& a, const std::string& b) {
    out.push_back(
        fmt::format("'{}={}' seen by the resource scheduler does not match '{}={}' "
                    "passed to the runtime",
                    field, a, field, b));
  };
  if (scheduler.policy != runtime.policy) differ("policy", scheduler.policy, runtime.policy);
  for (const auto& spec : info.params) {
    if (spec.flags & param_local) continue;
    const std::string a = shown(scheduler.params, spec.key), b = shown(runtime.params, spec.key);
    if (a != b) differ(spec.key, a, b);
  }
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
    // Both sides complete: the schema's defaults stand for absent keys.
    const core::PluginInfo& info = registry.find(PluginKind::elasticity, scheduler.policy);
    auto complete = [&](const ElasticityFingerprint& f) {
      // Each side by its own policy's schema, where the registry has it.
      const core::PluginInfo* own = &info;
      if (f.policy != scheduler.policy) {
        try {
          own = &registry.find(PluginKind::elasticity, f.policy);
        } catch (const Error&) {
          return f;  // not installed here: compared as given
        }
      }
      return ElasticityFingerprint{
          f.policy, core::complete_params(*own, core::schema_params(*own, f.params))};
    };
    for (auto& d : differences(info, complete(fingerprint_of(scheduler.policy, scheduler.params)),
                               complete(runtime)))
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
