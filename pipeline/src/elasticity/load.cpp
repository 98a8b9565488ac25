// Loading an elasticity policy from a TOML or DeepSpeed JSON file, or from a
// runtime. See ductile/pipeline/elasticity.hpp.

#include <fmt/format.h>

#include "ductile/core/files.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {

namespace fs = std::filesystem;
using core::Runtime;
using core::RuntimeOptions;

namespace {

const DeepSpeedOptions kElasticityWanted{.require_elasticity = true};

// The policy of a runtime of a DeepSpeed config, said to come from one.
ElasticityPolicySetup deepspeed_setup(Runtime& runtime, std::vector<std::string> warnings) {
  auto setup = elasticity_policy_from_runtime(runtime);
  setup.source.deepspeed_json = true;
  setup.source.warnings = std::move(warnings);
  return setup;
}

}  // namespace

ElasticityPolicySetup elasticity_policy_from_deepspeed_json(Runtime& runtime,
                                                            std::string_view json_text,
                                                            std::string_view origin) {
  std::vector<std::string> warnings;
  auto mapped =
      runtime_from_deepspeed(runtime, json_text, origin, {}, false, kElasticityWanted, &warnings);
  return deepspeed_setup(mapped, std::move(warnings));
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
  return load_elasticity(file, core::read_user_file(file, "configuration file"),
                         std::move(options));
}

LoadedElasticity load_elasticity(const fs::path& file, std::string_view text,
                                 RuntimeOptions options) {
  if (!is_json_config(file, text))
    return elasticity_from_runtime(
        Runtime::from_document(core::ConfigDocument::from_file_text(file, text), options));
  std::vector<std::string> warnings;
  auto runtime =
      runtime_from_deepspeed_file(file, text, std::move(options), kElasticityWanted, &warnings);
  for (const auto& w : warnings)
    if (runtime.logger()) runtime.logger()->warn("{}", w);
  auto setup = deepspeed_setup(runtime, std::move(warnings));
  return LoadedElasticity{std::move(runtime), std::move(setup.policy), std::move(setup.source),
                          std::move(setup.effective_params)};
}

}  // namespace ductile::pipeline
