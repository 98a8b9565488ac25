// Elasticity settings from text: DeepSpeed JSON (a config or its elasticity
// block) and the TOML a scheduler may pass, typed by the selected policy's
// schema. See ductile/pipeline/elasticity.hpp.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "deepspeed/mapping.hpp"
#include "ductile/core/config.hpp"
#include "ductile/core/text.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::elasticity_config_error;

namespace detail {

void elasticity_config_error(const std::string& message) {
  throw Error(ErrorKind::config, message, kElasticityConfigError);
}

core::PluginRegistry default_registry() {
  return core::PluginRegistry(core::PluginRegistry::default_search_path(), nullptr);
}

bool looks_like_block(const json& object) {
  return object.contains("version") || object.contains("policy") || object.contains("enabled") ||
         object.contains("max_train_batch_size") || object.contains("micro_batch_sizes");
}

}  // namespace detail

namespace {

// DeepSpeed's latest elasticity version (deepspeed/elasticity/constants.py).
constexpr double kLatestVersion = 0.2;

// DeepSpeed's switch: not a policy parameter unless the policy's schema has it.
constexpr const char* kEnabledKey = "enabled";

const ParamSpec* find_spec(const core::PluginInfo& info, std::string_view key) {
  for (const auto& spec : info.params)
    if (key == spec.key) return &spec;
  return nullptr;
}

std::vector<std::string> schema_keys(const core::PluginInfo& info) {
  std::vector<std::string> keys;
  for (const auto& spec : info.params) keys.emplace_back(spec.key);
  return keys;
}

// The policy named by a block's `version` (DeepSpeed's default: the latest)
// and `policy` keys.
std::string policy_of_block(const json& block, std::string_view origin) {
  std::string by_version = "v0.2";
  if (auto it = block.find("version"); it != block.end()) {
    // A number as JSON writes it, or a string holding one.
    const bool number = it->is_number() && !it->is_boolean();
    if (!number && !it->is_string())
      elasticity_config_error(
          fmt::format("{}: elasticity version must be a number such as 0.1 or 0.2, got {}", origin,
                      json_excerpt(*it)));
    by_version = policy_for_elasticity_version(
        number ? it->dump() : it->get_ref<const std::string&>(), json_excerpt(*it), origin);
  }
  auto it = block.find("policy");
  if (it == block.end()) return by_version;
  if (!it->is_string() || it->get_ref<const std::string&>().empty())
    elasticity_config_error(
        fmt::format("{}: elasticity policy must be a policy name such as \"optimal\", got {}",
                    origin, json_excerpt(*it)));
  std::string policy = it->get<std::string>();
  if (block.contains("version") && policy.starts_with("v") && policy != by_version)
    elasticity_config_error(
        fmt::format("{}: elasticity version {} contradicts policy \"{}\"; give one of them", origin,
                    json_excerpt(block.at("version")), policy));
  return policy;
}

// The message for a value that is not of the parameter's type.
[[noreturn]] void wrong_type(std::string_view origin, const std::string& key, ParamType type,
                             const json& value) {
  // A whole number too wide for 64 bits is out of range, not of another type.
  const json* wide = &value;
  if (value.is_array())
    for (const auto& element : value)
      if (deepspeed_mapping::past_int64(element)) wide = &element;
  if (auto past = deepspeed_mapping::past_int64(*wide))
    elasticity_config_error(wide == &value ? fmt::format("{}: elasticity.{} = {} is {}", origin,
                                                         key, json_excerpt(value), *past)
                                           : fmt::format("{}: elasticity.{} contains {}, {}",
                                                         origin, key, json_excerpt(*wide), *past));
  if (type == ParamType::integer_list) {
    // DeepSpeed's wording for its micro_batch_sizes.
    const char* what =
        key == "micro_batch_sizes" ? "micro batches (positive integers)" : "positive integers";
    if (!value.is_array())
      elasticity_config_error(
          fmt::format("{}: elasticity expected the value of {} to be a list of {}, instead got: {}",
                      origin, key, what, json_excerpt(value)));
    for (const auto& element : value)
      if (!json_to_param(element, ParamType::integer) || !element.is_number_integer())
        elasticity_config_error(
            fmt::format("{}: elasticity expected {} to only contain positive integers, instead "
                        "contains: {} (element {})",
                        origin, key, json_excerpt(value), json_excerpt(element)));
  }
  elasticity_config_error(fmt::format("{}: elasticity {} must be {}, got {}", origin, key,
                                      param_type_expectation(type), json_excerpt(value)));
}

// A dropped key: the policy has no such parameter.
std::string unused_key_warning(std::string_view origin, const std::string& policy,
                               const std::string& key, const core::PluginInfo& info) {
  const auto keys = schema_keys(info);
  return fmt::format("{}: policy '{}' has no parameter '{}'{}; ignored (its parameters: {})",
                     origin, policy, key, core::did_you_mean(key, keys), core::join(keys));
}

}  // namespace

std::string policy_for_elasticity_version(std::string_view written, std::string_view shown,
                                          std::string_view origin) {
  // The one parse of a version, whatever wrote it: the whole text is a
  // number, or it is refused.
  // (strtod, not std::from_chars: the latter pulls libm into the program
  // that links the static runtime.)
  const std::string text(written);
  char* end = nullptr;
  const double version = std::strtod(text.c_str(), &end);
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front())) ||
      end != text.c_str() + text.size())
    elasticity_config_error(fmt::format(
        "{}: elasticity version must be a number such as 0.1 or 0.2, got {}", origin, shown));
  if (std::isnan(version))
    elasticity_config_error(
        fmt::format("{}: elasticity version {} is not a number", origin, shown));
  if (version > kLatestVersion)
    elasticity_config_error(
        fmt::format("{}: attempting to run elasticity version {} but ductile supports up to {} "
                    "(valid: 0.1, 0.2)",
                    origin, shown, kLatestVersion));
  // The one mapping of versions to policies, for JSON and TOML alike (TOML's
  // `version` key reaches it through config_sections.cpp).
  if (version == 0.1) return "v0.1";
  if (version == 0.2) return "v0.2";
  elasticity_config_error(
      fmt::format("{}: unknown elasticity version {}; valid versions: 0.1, 0.2", origin, shown));
}

ElasticitySource elasticity_from_deepspeed_json(std::string_view json_text,
                                                std::string_view origin) {
  return elasticity_from_deepspeed_json(json_text, origin, detail::default_registry());
}

ElasticitySource elasticity_from_deepspeed_json(std::string_view json_text, std::string_view origin,
                                                const core::PluginRegistry& registry) {
  const json root = parse_bounded_json(json_text, origin, "invalid JSON", ErrorKind::config,
                                       kElasticityConfigError);
  if (!root.is_object())
    elasticity_config_error(fmt::format("{}: a DeepSpeed config must be a JSON object, got {}",
                                        origin, json_excerpt(root)));
  auto source = detail::elasticity_of_deepspeed(root, origin, registry);
  if (!source)
    elasticity_config_error(
        fmt::format("{}: 'elasticity' is missing from config json, please add it if running an "
                    "elastic training job",
                    origin));
  return std::move(*source);
}

namespace detail {

std::optional<ElasticitySource> elasticity_of_deepspeed(const json& root, std::string_view origin,
                                                        const core::PluginRegistry& registry) {
  const json* block = nullptr;
  if (auto it = root.find("elasticity"); it != root.end()) {
    if (!it->is_object())
      elasticity_config_error(
          fmt::format("{}: 'elasticity' must be an object, got {}", origin, json_excerpt(*it)));
    block = &*it;
  } else if (detail::looks_like_block(root)) {
    block = &root;
  } else {
    return std::nullopt;
  }

  ElasticitySource source;
  source.origin = std::string(origin);
  source.deepspeed_json = true;
  source.policy = policy_of_block(*block, origin);
  const core::PluginInfo& info = registry.find(PluginKind::elasticity, source.policy);
  // DeepSpeed's default: an elasticity block is disabled unless it says so.
  source.params.set(kEnabledKey, false);
  for (auto it = block->begin(); it != block->end(); ++it) {
    const std::string& key = it.key();
    if (key == "version" || key == "policy") continue;
    const ParamSpec* spec = find_spec(info, key);
    const ParamType type = spec ? spec->type : ParamType::boolean;
    if (!spec && key != kEnabledKey) {
      source.warnings.push_back(unused_key_warning(origin, source.policy, key, info));
      continue;
    }
    auto value = json_to_param(it.value(), type);
    // Counts are integers: true is not one, and neither are list elements
    // such as 2.0 (json_to_param accepts 2.0 for a single integer).
    if (!value) wrong_type(origin, key, type, it.value());
    source.params.set(key, std::move(*value));
  }
  return source;
}

}  // namespace detail

ElasticitySource elasticity_from_toml_text(std::string_view toml_text, std::string_view origin) {
  return elasticity_from_toml_text(toml_text, origin, detail::default_registry());
}

ElasticitySource elasticity_from_toml_text(std::string_view toml_text, std::string_view origin,
                                           const core::PluginRegistry& registry) {
  // The core's reader and checks, as for a job's own file: the [elasticity]
  // table, or top-level keys standing for it.
  try {
    // As in DeepSpeed JSON: no version means the latest, 0.2.
    const auto document =
        core::ConfigDocument::from_string(toml_text, origin)
            .section_document(
                "elasticity", /*top_level_keys=*/true,
                core::ConfigEntry{"elasticity", "version", ParamValue(std::string("0.2")),
                                  "[elasticity] version (absent: 0.2)"});
    const core::Config config = core::Config::validate(document, registry);
    const core::PluginSection* section = config.section(PluginKind::elasticity);
    ElasticitySource source;
    source.origin = std::string(origin);
    source.policy = section->plugin;
    source.params = section->params;
    return source;
  } catch (const core::ConfigError& e) {
    elasticity_config_error(e.what());
  }
}

}  // namespace ductile::pipeline
