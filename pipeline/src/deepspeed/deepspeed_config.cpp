// The DeepSpeed JSON -> ductile sections mapping (see
// ductile/pipeline/deepspeed_config.hpp): elasticity, [zero] and its offload
// keys, and the public functions; mapping.hpp holds the shared state.
#include "ductile/pipeline/deepspeed_config.hpp"

#include <optional>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "deepspeed/mapping.hpp"
#include "ductile/core/logging.hpp"
#include "ductile/core/text.hpp"
#include "ductile/pipeline/json.hpp"
#include "elasticity/elasticity_internal.hpp"

namespace ductile::pipeline {
namespace deepspeed_mapping {
namespace {

// DeepSpeed's stage-3 keys and the [zero] keys they set.
constexpr std::pair<const char*, const char*> kStage3Keys[] = {
    {"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
    {"stage3_max_live_parameters", "max_live_parameters"},
    {"stage3_max_reuse_distance", "max_reuse_distance"},
    {"stage3_param_persistence_threshold", "param_persistence_threshold"},
};

// offload_optimizer keys that configure NVMe swapping, which ductile does
// not do for the optimizer state.
constexpr const char* kNvmeOptimizerKeys[] = {"nvme_path",     "buffer_count",   "fast_init",
                                              "pipeline_read", "pipeline_write", "pipeline"};

// zero_optimization keys that tune DeepSpeed's own buckets, overlap and
// memory management: ductile's coordinator plans these itself.
constexpr const char* kZeroTuningKeys[] = {"overlap_comm",
                                           "contiguous_gradients",
                                           "reduce_bucket_size",
                                           "reduce_scatter",
                                           "allgather_partitions",
                                           "allgather_bucket_size",
                                           "sub_group_size",
                                           "round_robin_gradients",
                                           "elastic_checkpoint",
                                           "load_from_fp32_weights",
                                           "ignore_unused_parameters",
                                           "legacy_stage1",
                                           "memory_efficient_linear",
                                           "cpu_offload",
                                           "cpu_offload_params",
                                           "cpu_offload_use_pin_memory",
                                           "prefetch_bucket_size",
                                           "param_persistence_threshold",
                                           "model_persistence_threshold",
                                           "max_live_parameters",
                                           "max_reuse_distance",
                                           "stage3_model_persistence_threshold",
                                           "zero_hpz_partition_size",
                                           "zero_quantized_weights",
                                           "zero_quantized_nontrainable_weights",
                                           "zero_quantized_gradients",
                                           "mics_shard_size",
                                           "mics_hierarchical_params_gather",
                                           "use_multi_rank_bucket_allreduce",
                                           "pipeline_loading_checkpoint",
                                           "override_module_apply",
                                           "log_trace_cache_warnings",
                                           "use_all_reduce_for_fetch_params"};

}  // namespace

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
  snapshot(root, stage3);
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
  for (auto it = zero->begin(); it != zero->end(); ++it) {
    const std::string& key = it.key();
    if (unset(&it.value())) continue;
    bool mapped = key == "stage" || key == "offload_param" || key == "offload_optimizer" ||
                  key == "stage3_gather_16bit_weights_on_model_save" ||
                  key == "gather_16bit_weights_on_model_save";
    for (const auto& [theirs, ours] : kStage3Keys) mapped = mapped || key == theirs;
    if (mapped) continue;
    bool tuning = false;
    for (const char* known : kZeroTuningKeys) tuning = tuning || key == known;
    warn("zero_optimization." + key, tuning
                                         ? "ductile's coordinator plans its own buckets and overlap"
                                         : "ductile does not know this key");
  }
  if (!options.accelerator_backend.empty())
    set_plugin("accelerator", "backend", options.accelerator_backend, "the accelerator in use");
}

void Mapping::snapshot(const json& root, bool sets_zero) {
  const json* section = object(root, "snapshot", "snapshot");
  if (!section) return;
  // "snapshot" key -> [zero] key
  constexpr std::pair<const char*, const char*> kKeys[] = {
      {"interval", "snapshot_interval"},
      {"replicas", "snapshot_replicas"},
  };
  for (auto it = section->begin(); it != section->end(); ++it) {
    const char* ours = nullptr;
    for (const auto& [theirs, mapped] : kKeys)
      if (it.key() == theirs) ours = mapped;
    const std::string user_key = "snapshot." + it.key();
    if (ours == nullptr)
      problem(user_key, "is not a key of snapshot; valid: interval, replicas");
    else if (sets_zero && !unset(&it.value()))
      set("zero", nullptr, ours, it.value(), user_key);
  }
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
    else if (path->is_string() && path->get_ref<const std::string&>().empty())
      // [zero] nvme_path = "" keeps the shards in device memory: not what
      // device "nvme" asks for.
      problem(where + ".nvme_path",
              "= \"\": device \"nvme\" needs the directory of its files; valid: a non-empty "
              "directory path (or device \"cpu\" or \"none\" to keep the shards in memory)");
    else
      set("zero", coordinator, "nvme_path", *path, where + ".nvme_path");
    if (const json* count = child(*offload, "buffer_count"); !unset(count))
      set("zero", coordinator, "nvme_buffer_count", *count, where + ".buffer_count");
  } else if (name == "cpu") {
    set("zero", nullptr, "offload_param", json("cpu"), where + ".device");
    if (const json* count = child(*offload, "buffer_count"); !unset(count))
      warn(where + ".buffer_count", "host shards are copied to the gather's own buffers");
  }
  if (name == "none") return;
  if (!unset(child(*offload, "pin_memory")))
    warn(where + ".pin_memory", "ductile always pins its host buffers on cuda");
  for (const char* key : {"buffer_size", "max_in_cpu"})
    if (!unset(child(*offload, key))) warn(where + "." + key, "ductile sizes its own buffers");
}

void Mapping::offload_optimizer(const json& zero) {
  const std::string where = "zero_optimization.offload_optimizer";
  if (const json* offload = object(zero, "offload_optimizer", where))
    offload_optimizer_object(*offload, where);
}

void Mapping::offload_optimizer_object(const json& offload_object, const std::string& where) {
  const json* offload = &offload_object;
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

}  // namespace deepspeed_mapping

namespace fs = std::filesystem;
using deepspeed_mapping::json;
using deepspeed_mapping::kZeroCoordinator;
using deepspeed_mapping::Mapping;

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
  // ductile's own sections given where a DeepSpeed config was expected (a
  // dict of sections passed to zero3.initialize): DeepSpeed has no such keys.
  for (const char* section : {"zero", "accelerator"})
    if (root.contains(section))
      mapping.problem(section, fmt::format("is a ductile section, not a DeepSpeed key (DeepSpeed's "
                                           "ZeRO is zero_optimization): give ductile's sections "
                                           "as TOML, or ductile.load_config(d, format=\"toml\")"));
  mapping.top_level_keys(root, options.read_training);
  mapping.elasticity(root, options);
  mapping.zero(root, options);
  if (options.read_training || options.check_training) {
    mapping.training(root, options.read_training);
    mapping.engine_keys(root);
  }
  if (options.read_batching || options.require_batching)
    mapping.batching(root, options.require_batching);
  return mapping.finish(base_dir);
}

Params deepspeed_offload_optimizer(std::string_view json_object, std::string_view origin,
                                   const core::PluginRegistry& registry,
                                   std::vector<std::string>* warnings) {
  const json value = parse_bounded_json(json_object, origin, "invalid JSON", ErrorKind::config, "");
  const std::string where = "offload_optimizer";
  Mapping mapping(origin, registry);
  if (value.is_object())
    mapping.offload_optimizer_object(value, where);
  else
    mapping.problem(where, fmt::format("must be an object, got {}", json_excerpt(value)));
  // The keys are the section's own: any coordinator takes them.
  mapping.set_plugin("zero", "coordinator", kZeroCoordinator, where);
  auto mapped = mapping.finish({});
  const auto config = core::Config::validate(mapped.document, registry);
  for (auto& w : mapped.warnings)
    if (warnings) warnings->push_back(std::move(w));
  const core::PluginSection* zero = config.section(PluginKind::zero);
  return zero ? zero->host_params : Params{};
}

core::Runtime runtime_from_deepspeed(const core::Runtime& base, std::string_view json_text,
                                     std::string_view origin, const fs::path& base_dir,
                                     bool plugin_checks, const DeepSpeedOptions& options,
                                     std::vector<std::string>* warnings,
                                     DeepSpeedTraining* training) {
  auto mapped = deepspeed_sections(json_text, origin, base_dir, base.registry(), options);
  if (training) *training = std::move(mapped.training);
  // Every translated key is checked by its plugin's validate hook here,
  // where the problem can still be named by the file and the user's own
  // DeepSpeed key; a check left to the plugin's creation would name only
  // the ductile key the user never wrote. The elasticity loaders (which ask
  // for the block) keep the policy's typed errors, raised by compute().
  const bool checks = plugin_checks || !options.require_elasticity;
  auto runtime = base.with_config(mapped.document, checks);
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
