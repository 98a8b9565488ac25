// The DeepSpeed JSON -> ductile sections mapping; see
// ductile/pipeline/deepspeed_config.hpp.
#include "ductile/pipeline/deepspeed_config.hpp"

#include <optional>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ductile/core/logging.hpp"
#include "ductile/core/text.hpp"
#include "ductile/pipeline/json.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// DeepSpeed's stage-3 keys and the [zero] keys they set.
constexpr std::pair<const char*, const char*> kStage3Keys[] = {
    {"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
    {"stage3_max_live_parameters", "max_live_parameters"},
    {"stage3_max_reuse_distance", "max_reuse_distance"},
    {"stage3_param_persistence_threshold", "param_persistence_threshold"},
};

// The coordinator a DeepSpeed stage-3 config selects.
constexpr const char* kZeroCoordinator = "partitioned";

// offload_optimizer keys that configure NVMe swapping, which ductile does
// not do for the optimizer state.
constexpr const char* kNvmeOptimizerKeys[] = {"nvme_path",     "buffer_count",   "fast_init",
                                              "pipeline_read", "pipeline_write", "pipeline"};

// DeepSpeed's absent values: a key missing, null, or Hugging Face's "auto".
bool unset(const json* value) {
  return value == nullptr || value->is_null() || (value->is_string() && *value == "auto");
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
  // An offload object's device: "none", "cpu" or "nvme" (`absent` when not
  // given); nullopt after reporting any other value.
  std::optional<std::string> device_of(const json& offload, const std::string& where,
                                       const char* absent);

  DeepSpeedSections finish(const fs::path& base_dir) {
    if (!problems_.empty()) throw core::ConfigError(std::move(problems_));
    return {core::ConfigDocument::from_entries(std::move(entries_), origin_, base_dir),
            std::move(warnings_)};
  }

 private:
  std::string origin_;
  const core::PluginRegistry& registry_;
  std::vector<core::ConfigEntry> entries_;
  std::vector<core::Diagnostic> problems_;
  std::vector<std::string> warnings_;
};

void Mapping::elasticity(const json& root, const DeepSpeedOptions& options) {
  auto source = detail::elasticity_of_deepspeed(root, origin_, registry_);
  if (!source) {
    if (options.require_elasticity)
      detail::elasticity_config_error(
          fmt::format("{}: 'elasticity' is missing from config json, please add it if running "
                      "an elastic training job",
                      origin_));
    return;
  }
  const core::PluginInfo& info = registry_.find(PluginKind::elasticity, source->policy);
  // A policy named by "policy" may not know every DeepSpeed key: keep the
  // keys of its schema, say which others are dropped, and honour `enabled`.
  std::vector<std::string> dropped;
  Params kept = core::schema_params(info, source->params, &dropped);
  const bool takes_enabled = kept.has("enabled") || !source->params.has("enabled");
  if (!takes_enabled && !source->params.get_bool("enabled")) {
    if (options.require_elasticity)
      detail::elasticity_config_error(
          fmt::format("{}: elasticity is disabled, please enable it (\"enabled\": true) "
                      "if running an elastic training job",
                      origin_));
    return;
  }
  for (auto& w : source->warnings) warnings_.push_back(std::move(w));
  for (const auto& key : dropped)
    if (key != "enabled")
      warnings_.push_back(fmt::format("{}: policy '{}' has no parameter '{}'; ignored", origin_,
                                      source->policy, key));
  set_plugin("elasticity", "policy", source->policy, "elasticity.policy");
  for (const auto& [key, value] : kept.values())
    entries_.push_back({"elasticity", key, value, "elasticity." + key});
}

void Mapping::zero(const json& root, const DeepSpeedOptions& options) {
  const json* zero = object(root, "zero_optimization", "zero_optimization");
  std::string shown_stage = "0";
  bool stage3 = false;
  if (zero)
    if (const json* stage = child(*zero, "stage"); stage && !stage->is_null()) {
      shown_stage = json_excerpt(*stage);
      stage3 = stage->is_number_integer() && stage->get<std::int64_t>() == 3;
    }
  if (!stage3) {
    if (options.require_zero_stage3)
      problem("zero_optimization.stage",
              fmt::format("= {}; ductile's ZeRO coordinator is ZeRO stage 3: set it to 3",
                          shown_stage));
    return;
  }
  const core::PluginInfo& coordinator = registry_.find(PluginKind::zero, kZeroCoordinator);
  set_plugin("zero", "coordinator", kZeroCoordinator, "zero_optimization.stage");
  for (const auto& [theirs, ours] : kStage3Keys) {
    const json* value = child(*zero, theirs);
    if (!unset(value))
      set("zero", &coordinator, ours, *value, fmt::format("zero_optimization.{}", theirs));
  }
  offload_param(*zero, &coordinator);
  offload_optimizer(*zero);
  if (!options.accelerator_backend.empty())
    set_plugin("accelerator", "backend", options.accelerator_backend, "the accelerator in use");
}

std::optional<std::string> Mapping::device_of(const json& offload, const std::string& where,
                                              const char* absent) {
  const json* device = child(offload, "device");
  if (unset(device)) return absent;
  if (device->is_string()) {
    const auto& name = device->get_ref<const std::string&>();
    if (name == "none" || name == "cpu" || name == "nvme") return name;
  }
  problem(where + ".device",
          fmt::format("= {}; valid: \"cpu\", \"nvme\", \"none\"", json_excerpt(*device)));
  return std::nullopt;
}

void Mapping::offload_param(const json& zero, const core::PluginInfo* coordinator) {
  const std::string where = "zero_optimization.offload_param";
  const json* offload = object(zero, "offload_param", where);
  if (!offload) return;
  const auto device = device_of(*offload, where, "none");
  if (!device) return;
  const std::string& name = *device;
  if (name == "nvme") {
    const json* path = child(*offload, "nvme_path");
    if (unset(path))
      problem(where + ".nvme_path", "is missing: device \"nvme\" needs the directory of its files");
    else
      set("zero", coordinator, "nvme_path", *path, where + ".nvme_path");
    if (const json* count = child(*offload, "buffer_count"); !unset(count))
      set("zero", coordinator, "nvme_buffer_count", *count, where + ".buffer_count");
  } else if (name == "cpu") {
    warn(where + ".device",
         "\"cpu\" keeps the parameter shards on the device; max_device_memory offloads the "
         "optimizer state and master weights as far as needed, \"nvme\" keeps the shards in "
         "files");
  }
  if (name != "none")
    for (const char* key : {"pin_memory", "buffer_size", "max_in_cpu"})
      if (!unset(child(*offload, key))) warn(where + "." + key, "ductile sizes its own buffers");
}

void Mapping::offload_optimizer(const json& zero) {
  const std::string where = "zero_optimization.offload_optimizer";
  const json* offload = object(zero, "offload_optimizer", where);
  if (!offload) return;
  // DeepSpeed's default device of an offload_optimizer object is "cpu".
  const auto device = device_of(*offload, where, "cpu");
  if (!device || *device == "none") return;
  const std::string& name = *device;
  if (name == "nvme")
    warn(where + ".device",
         "\"nvme\" keeps the optimizer state in host memory (as \"cpu\"), not on NVMe");
  for (const char* key : kNvmeOptimizerKeys)
    if (!unset(child(*offload, key)))
      warn(where + "." + key,
           "it configures NVMe swapping, which ductile does not do for the optimizer state");
  set("zero", nullptr, "offload_optimizer", json("cpu"), where + ".device");
  if (const json* pin = child(*offload, "pin_memory"); !unset(pin))
    set("zero", nullptr, "offload_pin_memory", *pin, where + ".pin_memory");
  if (const json* ratio = child(*offload, "ratio"); !unset(ratio))
    set("zero", nullptr, "offload_ratio", *ratio, where + ".ratio");
  for (auto it = offload->begin(); it != offload->end(); ++it) {
    const std::string& key = it.key();
    bool known = key == "device" || key == "pin_memory" || key == "ratio";
    for (const char* nvme : kNvmeOptimizerKeys) known = known || key == nvme;
    if (!known) warn(where + "." + key, "ductile does not know this key");
  }
}

}  // namespace

DeepSpeedSections deepspeed_sections(std::string_view json_text, std::string_view origin,
                                     const fs::path& base_dir, const core::PluginRegistry& registry,
                                     const DeepSpeedOptions& options) {
  // A caller that wants the elasticity block reports its JSON as DeepSpeed's
  // elasticity does (ElasticityConfigError).
  const std::string type = options.require_elasticity ? kElasticityConfigError : "";
  const json root = parse_bounded_json(json_text, origin, "invalid JSON", ErrorKind::config, type);
  if (!root.is_object())
    throw Error(ErrorKind::config,
                fmt::format("{}: a DeepSpeed config must be a JSON object, got {}", origin,
                            json_excerpt(root)),
                type);
  Mapping mapping(origin, registry);
  mapping.elasticity(root, options);
  mapping.zero(root, options);
  return mapping.finish(base_dir);
}

core::Runtime runtime_from_deepspeed(const core::Runtime& base, std::string_view json_text,
                                     std::string_view origin, const fs::path& base_dir,
                                     bool plugin_checks, const DeepSpeedOptions& options,
                                     std::vector<std::string>* warnings) {
  auto mapped = deepspeed_sections(json_text, origin, base_dir, base.registry(), options);
  auto runtime = base.with_config(mapped.document, plugin_checks);
  for (auto& w : mapped.warnings) {
    if (warnings)
      warnings->push_back(std::move(w));
    else if (runtime.logger())
      runtime.logger()->warn("{}", w);
  }
  return runtime;
}

core::Runtime runtime_from_deepspeed(std::string_view json_text, std::string_view origin,
                                     const fs::path& base_dir, core::RuntimeOptions runtime_options,
                                     const DeepSpeedOptions& options,
                                     std::vector<std::string>* warnings) {
  const bool plugin_checks = runtime_options.plugin_checks;
  const auto base = core::Runtime::from_document(core::ConfigDocument::from_string("", origin),
                                                 std::move(runtime_options));
  return runtime_from_deepspeed(base, json_text, origin, base_dir, plugin_checks, options,
                                warnings);
}

core::Runtime runtime_from_deepspeed_file(const fs::path& file, std::string_view json_text,
                                          core::RuntimeOptions runtime_options,
                                          const DeepSpeedOptions& options,
                                          std::vector<std::string>* warnings) {
  std::error_code ec;
  const fs::path base_dir =
      fs::absolute(file.has_parent_path() ? file.parent_path() : fs::path("."), ec);
  return runtime_from_deepspeed(json_text, file.string(), base_dir, std::move(runtime_options),
                                options, warnings);
}

}  // namespace ductile::pipeline
