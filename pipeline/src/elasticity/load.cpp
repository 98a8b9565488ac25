// Loading an elasticity policy from a TOML or DeepSpeed JSON file, or from a
// runtime. See ductile/pipeline/elasticity.hpp.
#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "ductile/core/files.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {

namespace fs = std::filesystem;
using core::Runtime;
using core::RuntimeOptions;

ElasticityPolicySetup elasticity_policy_from_deepspeed_json(Runtime& runtime,
                                                            std::string_view json_text,
                                                            std::string_view origin) {
  ElasticitySource source = elasticity_from_deepspeed_json(json_text, origin, runtime.registry());
  const core::PluginInfo& info = runtime.registry().find(PluginKind::elasticity, source.policy);
  // A policy named by "policy" may not know every DeepSpeed key: keep the
  // keys of its schema, say which others are dropped, and honour `enabled`.
  std::vector<std::string> dropped;
  Params kept = core::schema_params(info, source.params, &dropped);
  const bool takes_enabled = kept.has("enabled") || !source.params.has("enabled");
  if (!takes_enabled && !source.params.get_bool("enabled"))
    detail::elasticity_config_error(
        fmt::format("{}: elasticity is disabled, please enable it (\"enabled\": true) "
                    "if running an elastic training job",
                    source.origin));
  for (const auto& key : dropped)
    if (key != "enabled")
      source.warnings.push_back(fmt::format("{}: policy '{}' has no parameter '{}'; ignored",
                                            source.origin, source.policy, key));
  source.params = std::move(kept);
  Params effective = core::complete_params(info, source.params);
  auto policy = runtime.create<ElasticityPolicy>(source.policy, source.params);
  return {std::move(policy), std::move(source), std::move(effective)};
}

ElasticityPolicySetup elasticity_policy_from_runtime(Runtime& runtime) {
  const core::PluginSection* section = runtime.config().section(PluginKind::elasticity);
  if (!section)
    detail::elasticity_config_error(
        fmt::format("{}: no [elasticity] section; add one with policy = \"v0.1\", "
                    "\"v0.2\" or \"optimal\"",
                    runtime.config().source_name()));
  ElasticitySource source;
  source.policy = section->plugin;
  source.params = section->params;
  source.origin = runtime.config().source_name();
  return {runtime.get<ElasticityPolicy>(), std::move(source), section->params};
}

LoadedElasticity elasticity_from_runtime(Runtime runtime) {
  auto setup = elasticity_policy_from_runtime(runtime);
  return LoadedElasticity{std::move(runtime), std::move(setup.policy), std::move(setup.source),
                          std::move(setup.effective_params)};
}

LoadedElasticity load_elasticity(const fs::path& file, RuntimeOptions options) {
  const std::string text = core::read_user_file(file, "configuration file");
  if (!is_json_config(file, text))
    return elasticity_from_runtime(Runtime::from_file(file, options));
  auto runtime = Runtime::from_string("", file.string(), std::move(options));
  auto setup = elasticity_policy_from_deepspeed_json(runtime, text, file.string());
  for (const auto& w : setup.source.warnings)
    if (runtime.logger()) runtime.logger()->warn("{}", w);
  return LoadedElasticity{std::move(runtime), std::move(setup.policy), std::move(setup.source),
                          std::move(setup.effective_params)};
}

}  // namespace ductile::pipeline
