// Elasticity settings from text: DeepSpeed JSON (a config or its elasticity
// block) and the TOML a scheduler may pass, typed by the selected policy's
// schema. See ductile/pipeline/elasticity.hpp.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>
#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include "ductile/core/config.hpp"
#include "ductile/core/text.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "elasticity/elasticity_internal.hpp"
#include "json/bounded_json.hpp"

namespace ductile::pipeline {

namespace fs = std::filesystem;
using json = nlohmann::json;
using detail::elasticity_config_error;
using detail::json_excerpt;

namespace detail {

void elasticity_config_error(const std::string& message) {
  throw Error(ErrorKind::config, message, kElasticityConfigError);
}

core::PluginRegistry default_registry() {
  return core::PluginRegistry(core::PluginRegistry::default_search_path(), nullptr);
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

bool looks_like_block(const json& object) {
  return object.contains("version") || object.contains("policy") || object.contains(kEnabledKey) ||
         object.contains("max_train_batch_size") || object.contains("micro_batch_sizes");
}

// The policy named by a block's `version` (DeepSpeed's default: the latest)
// and `policy` keys.
std::string policy_of_block(const json& block, std::string_view origin) {
  std::string by_version;
  if (auto it = block.find("version"); it != block.end()) {
    double version;
    if (it->is_number() && !it->is_boolean()) {
      version = it->get<double>();
    } else if (it->is_string()) {
      const std::string& text = it->get_ref<const std::string&>();
      char* end = nullptr;
      version = std::strtod(text.c_str(), &end);
      if (text.empty() || *end != '\0')
        elasticity_config_error(
            fmt::format("{}: elasticity version must be a number such as 0.1 or 0.2, got {}",
                        origin, json_excerpt(*it)));
    } else {
      elasticity_config_error(
          fmt::format("{}: elasticity version must be a number such as 0.1 or 0.2, got {}", origin,
                      json_excerpt(*it)));
    }
    by_version = policy_for_elasticity_version(version, json_excerpt(*it), origin);
  } else {
    by_version = "v0.2";
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
  if (type == ParamType::integer_list) {
    // DeepSpeed's wording for its micro_batch_sizes.
    const char* what =
        key == "micro_batch_sizes" ? "micro batches (positive integers)" : "positive integers";
    if (!value.is_array())
      elasticity_config_error(
          fmt::format("{}: elasticity expected the value of {} to be a list of {}, instead got: {}",
                      origin, key, what, json_excerpt(value)));
    for (const auto& element : value)
      if (!detail::json_to_param(element, ParamType::integer) || !element.is_number_integer())
        elasticity_config_error(
            fmt::format("{}: elasticity expected {} to only contain positive integers, instead "
                        "contains: {} (element {})",
                        origin, key, json_excerpt(value), json_excerpt(element)));
  }
  elasticity_config_error(fmt::format("{}: elasticity {} must be {}, got {}", origin, key,
                                      detail::param_type_expectation(type), json_excerpt(value)));
}

// A dropped key: the policy has no such parameter.
std::string unused_key_warning(std::string_view origin, const std::string& policy,
                               const std::string& key, const core::PluginInfo& info) {
  const auto keys = schema_keys(info);
  return fmt::format("{}: policy '{}' has no parameter '{}'{}; ignored (its parameters: {})",
                     origin, policy, key, core::did_you_mean(key, keys), core::join(keys));
}

}  // namespace

std::string policy_for_elasticity_version(double version, std::string_view shown,
                                          std::string_view origin) {
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

bool is_json_config(const fs::path& file, std::string_view content) {
  std::string ext = file.extension().string();
  for (auto& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (ext == ".json") return true;
  if (ext == ".toml") return false;
  for (char c : content) {
    if (std::isspace(static_cast<unsigned char>(c))) continue;
    return c == '{';
  }
  return false;
}

ElasticitySource elasticity_from_deepspeed_json(std::string_view json_text,
                                                std::string_view origin) {
  return elasticity_from_deepspeed_json(json_text, origin, detail::default_registry());
}

ElasticitySource elasticity_from_deepspeed_json(std::string_view json_text, std::string_view origin,
                                                const core::PluginRegistry& registry) {
  const json root = detail::parse_bounded_json(json_text, origin, "invalid JSON", ErrorKind::config,
                                               kElasticityConfigError);
  if (!root.is_object())
    elasticity_config_error(fmt::format("{}: a DeepSpeed config must be a JSON object, got {}",
                                        origin, json_excerpt(root)));
  const json* block = nullptr;
  if (auto it = root.find("elasticity"); it != root.end()) {
    if (!it->is_object())
      elasticity_config_error(
          fmt::format("{}: 'elasticity' must be an object, got {}", origin, json_excerpt(*it)));
    block = &*it;
  } else if (looks_like_block(root)) {
    block = &root;
  } else {
    elasticity_config_error(
        fmt::format("{}: 'elasticity' is missing from config json, please add it if running an "
                    "elastic training job",
                    origin));
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
    auto value = detail::json_to_param(it.value(), type);
    // Counts are integers: true is not one, and neither are list elements
    // such as 2.0 (json_to_param accepts 2.0 for a single integer).
    if (!value) wrong_type(origin, key, type, it.value());
    source.params.set(key, std::move(*value));
  }
  return source;
}

namespace {

std::optional<ParamValue> toml_to_param(const toml::node& node, ParamType type) {
  auto list = [&](auto element) -> std::optional<ParamValue> {
    const auto* array = node.as_array();
    if (!array) return std::nullopt;
    std::vector<typename decltype(element)::value_type> out;
    for (const auto& e : *array) {
      auto v = e.value_exact<typename decltype(element)::value_type>();
      if (!v) return std::nullopt;
      out.push_back(*v);
    }
    return ParamValue(std::move(out));
  };
  switch (type) {
    case ParamType::boolean:
      if (auto v = node.value_exact<bool>()) return ParamValue(*v);
      return std::nullopt;
    case ParamType::integer:
      if (auto v = node.value_exact<std::int64_t>()) return ParamValue(*v);
      return std::nullopt;
    case ParamType::floating:
      if (auto v = node.value<double>(); v && !node.is_boolean()) return ParamValue(*v);
      return std::nullopt;
    case ParamType::string:
      if (auto v = node.value_exact<std::string>()) return ParamValue(*v);
      return std::nullopt;
    case ParamType::integer_list:
      return list(std::vector<std::int64_t>{});
    case ParamType::float_list:
      return list(std::vector<double>{});
    case ParamType::string_list:
      return list(std::vector<std::string>{});
  }
  return std::nullopt;
}

[[noreturn]] void bad_toml_value(std::string_view origin, const std::string& key,
                                 const char* what) {
  elasticity_config_error(fmt::format("{}: [elasticity] {} must be {}", origin, key, what));
}

}  // namespace

ElasticitySource elasticity_from_toml_text(std::string_view toml_text, std::string_view origin) {
  return elasticity_from_toml_text(toml_text, origin, detail::default_registry());
}

ElasticitySource elasticity_from_toml_text(std::string_view toml_text, std::string_view origin,
                                           const core::PluginRegistry& registry) {
  toml::table root;
  try {
    root = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    elasticity_config_error(fmt::format("{}:{}:{}: invalid TOML: {}", origin, e.source().begin.line,
                                        e.source().begin.column, e.description()));
  }
  const toml::table* table = &root;
  if (const auto* node = root.get("elasticity")) {
    table = node->as_table();
    if (!table) elasticity_config_error(fmt::format("{}: 'elasticity' must be a table", origin));
  }
  ElasticitySource source;
  source.origin = std::string(origin);
  std::string from_version;
  if (const auto* policy = table->get("policy")) {
    auto s = policy->value_exact<std::string>();
    if (!s) bad_toml_value(origin, "policy", "a string naming a policy");
    source.policy = *s;
  }
  if (const auto* version = table->get("version")) {
    std::string text;
    double v = 0;
    if (auto f = version->value_exact<double>())
      v = *f, text = fmt::format("{}", *f);
    else if (auto s = version->value_exact<std::string>())
      v = std::strtod(s->c_str(), nullptr), text = *s;
    else
      bad_toml_value(origin, "version", "a number such as 0.1 or 0.2");
    from_version = policy_for_elasticity_version(v, text, origin);
    if (source.policy.empty()) source.policy = from_version;
  }
  // As in DeepSpeed JSON: no version means the latest, 0.2.
  if (source.policy.empty()) source.policy = "v0.2";
  const core::PluginInfo& info = registry.find(PluginKind::elasticity, source.policy);
  for (auto&& [key_node, value] : *table) {
    const std::string key(key_node.str());
    if (key == "policy" || key == "version") continue;
    const ParamSpec* spec = find_spec(info, key);
    if (!spec) continue;  // not a parameter of the policy: not part of the contract
    auto converted = toml_to_param(value, spec->type);
    if (!converted) bad_toml_value(origin, key, detail::param_type_expectation(spec->type));
    source.params.set(key, std::move(*converted));
  }
  return source;
}

}  // namespace ductile::pipeline
