// The DeepSpeed JSON -> ductile sections mapping's state and steps, shared
// by its source files (deepspeed_config.cpp: elasticity, [zero], offload and
// the public functions; deepspeed_training.cpp: what configures the training
// framework; deepspeed_batching_sections.cpp: [batching] and [lr]).
// Internal to the pipeline; ductile/pipeline/deepspeed_config.hpp is the API.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/pipeline/deepspeed_config.hpp"
#include "ductile/pipeline/json.hpp"

namespace ductile::pipeline::deepspeed_mapping {

using nlohmann::json;

// The coordinator a DeepSpeed stage-3 config selects.
inline constexpr const char* kZeroCoordinator = "partitioned";

// DeepSpeed's absent values: a key missing, null, or Hugging Face's "auto".
inline bool unset(const json* value) {
  return value == nullptr || value->is_null() || (value->is_string() && *value == "auto");
}

// `text` in ASCII lower case: DeepSpeed's names are case-insensitive
// ("AdamW", "SQRT").
inline std::string lowercase(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

// For a value that should be an integer: a whole JSON number outside 64
// bits ("past the largest integer (2^63-1); valid: ..."), which JSON parsers read as an
// unsigned or a floating-point number and would otherwise call "not an
// integer"; nullopt for anything else.
inline std::optional<std::string> past_int64(const json& value) {
  const char* side = nullptr;
  if (value.is_number_unsigned()) {
    if (value.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) side = "largest";
  } else if (value.is_number_float()) {
    const double v = value.get<double>();
    // 2^63 is exact as a double, and every finite double at or past it is
    // whole (past 2^53 doubles are integers): no floor() needed, and none
    // called (libm stays out of the program, sdk/static_runtime).
    if (std::isfinite(v) && (v >= 0x1p63 || v < -0x1p63)) side = v > 0 ? "largest" : "smallest";
  }
  if (!side) return std::nullopt;
  return fmt::format(
      "past the {} integer ({}); valid: an integer from -9223372036854775808 (-2^63) to "
      "9223372036854775807 (2^63-1)",
      side, side[0] == 'l' ? "2^63-1" : "-2^63");
}

class Mapping {
 public:
  Mapping(std::string_view origin, const core::PluginRegistry& registry)
      : origin_(origin), registry_(registry) {}

  const json* child(const json& parent, const char* key) const {
    auto it = parent.find(key);
    return it == parent.end() ? nullptr : &*it;
  }

  // An object-valued key (absent or null: nullptr); anything else is a
  // problem naming it.
  const json* object(const json& parent, const char* key, const std::string& path) {
    const json* value = child(parent, key);
    if (unset(value)) return nullptr;
    if (!value->is_object()) {
      problem(path, fmt::format("must be an object, got {}", json_excerpt(*value)));
      return nullptr;
    }
    return value;
  }

  void problem(const std::string& user_key, const std::string& what) {
    core::Diagnostic diagnostic;
    diagnostic.where.file = origin_;
    diagnostic.message = fmt::format("{} {}", user_key, what);
    problems_.push_back(std::move(diagnostic));
  }
  void warn(const std::string& user_key, const std::string& why) {
    warnings_.push_back(fmt::format("{}: {} is accepted but ignored: {}", origin_, user_key, why));
  }

  // The value typed by the schema of the plugin that takes `key`: the one
  // conversion of a JSON value (bounds and the rest are checked by
  // Config::validate).
  void set(const std::string& section, const core::PluginInfo* info, const std::string& key,
           const json& value, const std::string& user_key) {
    const ParamSpec* spec = nullptr;
    if (info)
      for (const auto& s : info->params)
        if (key == s.key) spec = &s;
    // The section's host keys (a copy of the section table, kept while used).
    const std::optional<core::SectionSpec> host = core::find_section_spec(section);
    if (!spec && host)
      for (const auto& s : host->host_keys)
        if (key == s.key) spec = &s;
    if (!spec) throw Error(ErrorKind::internal, fmt::format("[{}] has no key {}", section, key));
    auto typed = json_to_param(value, spec->type);
    if (!typed) {
      if (spec->type == ParamType::integer || spec->type == ParamType::integer_list) {
        // An integer too wide for 64 bits is a range problem, not a type one.
        const json* wide = &value;
        if (value.is_array())
          for (const auto& element : value)
            if (past_int64(element)) wide = &element;
        if (auto past = past_int64(*wide)) {
          problem(user_key, wide == &value
                                ? fmt::format("= {} is {}", json_excerpt(value), *past)
                                : fmt::format("contains {}, {}", json_excerpt(*wide), *past));
          return;
        }
      }
      problem(user_key, fmt::format("must be {}, got {}", param_type_expectation(spec->type),
                                    json_excerpt(value)));
      return;
    }
    entries_.push_back({section, key, std::move(*typed), user_key});
  }
  void set_plugin(const std::string& section, const std::string& selector, std::string plugin,
                  const std::string& user_key) {
    entries_.push_back({section, selector, ParamValue(std::move(plugin)), user_key});
  }

  void elasticity(const json& root, const DeepSpeedOptions& options);
  void zero(const json& root, const DeepSpeedOptions& options);
  void offload_param(const json& zero, core::PluginInfo const* coordinator);
  void offload_optimizer(const json& zero);
  void offload_optimizer_object(const json& offload, const std::string& where);
  // ductile's own top-level "snapshot" object (interval, replicas) onto
  // [zero] snapshot_interval / snapshot_replicas; its keys are checked
  // always, set only where `sets_zero` (a stage-3 config has a [zero]).
  void snapshot(const json& root, bool sets_zero);
  // The training framework's keys into DeepSpeedTraining; where `trains`
  // is false, what only ductile's engine refuses is a warning instead.
  void training(const json& root, bool trains);
  // Warns about (or, where `trains`, refuses) every top-level key ductile
  // does not act on, naming it (deepspeed_keys.cpp).
  void top_level_keys(const json& root, bool trains);
  // The engine's own keys into DeepSpeedTraining (deepspeed_keys.cpp).
  void engine_keys(const json& root);
  void batching(const json& root, bool required);
  void lr_schedule(const json& root);
  // train_batch_size, else micro batch x gradient accumulation, else 1: the
  // micro-batches of one step (nullopt after reporting a problem).
  std::optional<std::int64_t> step_batch(const json& root);
  // A key of the batch triple (train_batch_size,
  // train_micro_batch_size_per_gpu, gradient_accumulation_steps) or
  // steps_per_print, given: an integer from 1 to its bound, read once however
  // many parts of the mapping ask (nullopt after reporting a problem).
  std::optional<std::int64_t> batch_key(const json& root, const char* key);
  void fp16_scaling(const json& fp16);
  void optimizer(const json& section, bool trains);
  void scheduler(const json& section);
  // An offload object's device: "none", "cpu" or "nvme" (`absent` when not
  // given); nullopt after reporting any other value.
  std::optional<std::string> device_of(const json& offload, const std::string& where,
                                       const char* absent);

  DeepSpeedSections finish(const std::filesystem::path& base_dir) {
    if (!problems_.empty()) throw core::ConfigError(std::move(problems_));
    return {core::ConfigDocument::from_entries(std::move(entries_), origin_, base_dir),
            std::move(warnings_), std::move(training_), batching_enabled_};
  }

 private:
  // `value` if it is a number (not a boolean) that `in_range` accepts;
  // otherwise nullopt after a problem saying what is `valid`.
  template <typename InRange>
  std::optional<double> number(const json& value, const std::string& user_key, InRange in_range,
                               std::string_view valid) {
    if (value.is_number() && in_range(value.get<double>())) return value.get<double>();
    problem(user_key, fmt::format("= {}; valid: {}", json_excerpt(value), valid));
    return std::nullopt;
  }
  // The same for an integer.
  template <typename InRange>
  std::optional<std::int64_t> integer(const json& value, const std::string& user_key,
                                      InRange in_range, std::string_view valid) {
    if (value.is_number_integer() && in_range(value.get<std::int64_t>()))
      return value.get<std::int64_t>();
    problem(user_key, fmt::format("= {}; valid: {}", json_excerpt(value), valid));
    return std::nullopt;
  }
  // `section`.enabled: true, false, or absent (false).
  bool enabled(const json& root, const char* section);

  DeepSpeedTraining training_;
  std::map<std::string, std::optional<std::int64_t>, std::less<>> batch_keys_;
  bool batching_enabled_ = false;
  std::string origin_;
  const core::PluginRegistry& registry_;
  std::vector<core::ConfigEntry> entries_;
  std::vector<core::Diagnostic> problems_;
  std::vector<std::string> warnings_;
};

}  // namespace ductile::pipeline::deepspeed_mapping
