// The DeepSpeed JSON -> ductile sections mapping; see
// ductile/pipeline/deepspeed_config.hpp.
#include "ductile/pipeline/deepspeed_config.hpp"

#include <algorithm>
#include <cctype>
#include <optional>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
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
  void offload_optimizer_object(const json& offload, const std::string& where);
  void training(const json& root);
  void batching(const json& root, bool required);
  void lr_schedule(const json& root);
  // train_batch_size, else micro batch x gradient accumulation, else 1: the
  // micro-batches of one step (nullopt after reporting a problem).
  std::optional<std::int64_t> step_batch(const json& root);
  void fp16_scaling(const json& fp16);
  void optimizer(const json& section);
  // An offload object's device: "none", "cpu" or "nvme" (`absent` when not
  // given); nullopt after reporting any other value.
  std::optional<std::string> device_of(const json& offload, const std::string& where,
                                       const char* absent);

  DeepSpeedSections finish(const fs::path& base_dir) {
    if (!problems_.empty()) throw core::ConfigError(std::move(problems_));
    return {core::ConfigDocument::from_entries(std::move(entries_), origin_, base_dir),
            std::move(warnings_), std::move(training_), batching_enabled_};
  }

 private:
  // `value` if it is a number (not a boolean) that `in_range` accepts;
  // otherwise nullopt after a problem saying what is `valid`.
  template <typename InRange>
  std::optional<double> number(const json& value, const std::string& user_key, InRange in_range,
                               const char* valid) {
    if (value.is_number() && in_range(value.get<double>())) return value.get<double>();
    problem(user_key, fmt::format("= {}; valid: {}", json_excerpt(value), valid));
    return std::nullopt;
  }
  // The same for an integer.
  template <typename InRange>
  std::optional<std::int64_t> integer(const json& value, const std::string& user_key,
                                      InRange in_range, const char* valid) {
    if (value.is_number_integer() && in_range(value.get<std::int64_t>()))
      return value.get<std::int64_t>();
    problem(user_key, fmt::format("= {}; valid: {}", json_excerpt(value), valid));
    return std::nullopt;
  }
  // `section`.enabled: true, false, or absent (false).
  bool enabled(const json& root, const char* section);

  DeepSpeedTraining training_;
  bool batching_enabled_ = false;
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

bool Mapping::enabled(const json& root, const char* section) {
  const json* object_value = object(root, section, section);
  if (!object_value) return false;
  const json* on = child(*object_value, "enabled");
  if (unset(on)) return false;
  if (on->is_boolean()) return on->get<bool>();
  problem(fmt::format("{}.enabled", section),
          fmt::format("= {}; valid: true or false", json_excerpt(*on)));
  return false;
}

void Mapping::training(const json& root) {
  const bool bf16 = enabled(root, "bf16") || enabled(root, "bfloat16");
  const bool fp16 = enabled(root, "fp16");
  if (bf16 && fp16) {
    problem("bf16.enabled", "and fp16.enabled are both true; enable one of them");
  } else if (bf16) {
    training_.precision = "bf16";
  } else if (fp16) {
    training_.precision = "fp16";
    fp16_scaling(root.at("fp16"));
  }
  if (const json* clip = child(root, "gradient_clipping"); !unset(clip)) {
    const auto norm = number(
        *clip, "gradient_clipping", [](double v) { return v >= 0; },
        "a number >= 0 (0: no clipping)");
    if (norm && *norm > 0) training_.gradient_clipping = *norm;
  }
  if (const json* section = object(root, "optimizer", "optimizer")) optimizer(*section);
}

void Mapping::fp16_scaling(const json& fp16) {
  DeepSpeedTraining& t = training_;
  for (auto it = fp16.begin(); it != fp16.end(); ++it) {
    const std::string& key = it.key();
    const json& value = it.value();
    const std::string user_key = "fp16." + key;
    if (key == "enabled" || unset(&value)) continue;
    if (key == "loss_scale") {
      if (auto v = number(
              value, user_key, [](double x) { return x >= 0; },
              "0 (dynamic scaling) or a positive number"))
        t.loss_scale = *v;
    } else if (key == "initial_scale_power") {
      if (auto v = integer(
              value, user_key, [](std::int64_t x) { return x >= 0 && x <= 64; },
              "an integer in [0, 64]"))
        t.initial_scale_power = *v;
    } else if (key == "loss_scale_window" || key == "hysteresis") {
      if (auto v = integer(
              value, user_key, [](std::int64_t x) { return x >= 1; }, "an integer >= 1"))
        (key == "hysteresis" ? t.hysteresis : t.loss_scale_window) = *v;
    } else if (key == "min_loss_scale") {
      if (auto v = number(
              value, user_key, [](double x) { return x > 0; }, "a number > 0"))
        t.min_loss_scale = *v;
    } else {
      warn(user_key, "ductile does not act on this key");
    }
  }
}

void Mapping::optimizer(const json& section) {
  const json* type = child(section, "type");
  std::string lowered;
  if (type && type->is_string())
    for (char c : type->get_ref<const std::string&>())
      lowered += static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  if (lowered != "adam" && lowered != "adamw") {
    problem("optimizer.type", fmt::format("= {}; valid: \"Adam\", \"AdamW\"",
                                          type ? json_excerpt(*type) : std::string("(missing)")));
    return;
  }
  DeepSpeedTraining::Optimizer optimizer;
  optimizer.type = type->get<std::string>();
  bool adam_w_mode = true;
  if (const json* params = object(section, "params", "optimizer.params"))
    for (auto it = params->begin(); it != params->end(); ++it) {
      const std::string& key = it.key();
      const json& value = it.value();
      const std::string user_key = "optimizer.params." + key;
      if (unset(&value)) continue;
      if (key == "lr" || key == "eps" || key == "weight_decay") {
        auto v = number(
            value, user_key, [](double x) { return x >= 0; }, "a number >= 0");
        (key == "lr" ? optimizer.lr : key == "eps" ? optimizer.eps : optimizer.weight_decay) = v;
      } else if (key == "betas") {
        auto beta = [](const json& b) {
          return b.is_number() && b.get<double>() >= 0 && b.get<double>() < 1;
        };
        if (value.is_array() && value.size() == 2 && beta(value[0]) && beta(value[1]))
          optimizer.betas = std::array<double, 2>{value[0].get<double>(), value[1].get<double>()};
        else
          problem(user_key,
                  fmt::format("= {}; valid: [beta1, beta2], each in [0, 1)", json_excerpt(value)));
      } else if (key == "adam_w_mode") {
        if (value.is_boolean())
          adam_w_mode = value.get<bool>();
        else
          problem(user_key, fmt::format("= {}; valid: true or false", json_excerpt(value)));
      } else if (key != "torch_adam") {  // which implementation: the framework's own
        warn(user_key, "ductile's Adam and AdamW have no such setting");
      }
    }
  optimizer.decoupled_weight_decay = lowered == "adamw" || adam_w_mode;
  training_.optimizer = std::move(optimizer);
}

std::optional<std::int64_t> Mapping::step_batch(const json& root) {
  auto positive = [](std::int64_t v) { return v >= 1; };
  if (const json* total = child(root, "train_batch_size"); !unset(total))
    return integer(*total, "train_batch_size", positive, "an integer >= 1");
  std::int64_t micro = 1, steps = 1;
  if (const json* v = child(root, "train_micro_batch_size_per_gpu"); !unset(v)) {
    auto read = integer(*v, "train_micro_batch_size_per_gpu", positive, "an integer >= 1");
    if (!read) return std::nullopt;
    micro = *read;
  }
  if (const json* v = child(root, "gradient_accumulation_steps"); !unset(v)) {
    auto read = integer(*v, "gradient_accumulation_steps", positive, "an integer >= 1");
    if (!read) return std::nullopt;
    steps = *read;
  }
  std::int64_t product = 0;
  if (__builtin_mul_overflow(micro, steps, &product)) {
    problem("gradient_accumulation_steps",
            fmt::format("{} x train_micro_batch_size_per_gpu = {} exceeds 2^63 - 1 micro-batches "
                        "per step; give smaller values",
                        steps, micro));
    return std::nullopt;
  }
  return product;
}

void Mapping::batching(const json& root, bool required) {
  const std::string base = "data_efficiency.data_sampling.dynamic_batching";
  const json* efficiency = object(root, "data_efficiency", "data_efficiency");
  const json* sampling =
      efficiency ? object(*efficiency, "data_sampling", "data_efficiency.data_sampling") : nullptr;
  const json* dynamic = sampling ? object(*sampling, "dynamic_batching", base) : nullptr;
  if (!dynamic) {
    if (required && problems_.empty())
      problem(base, "is missing: the config has no dynamic batching block");
    return;
  }
  // DeepSpeed's keys, and ductile's lr_scaling_params (the rule's parameters).
  static const char* const kKnown[] = {"enabled",           "max_tokens",
                                       "lr_scaling_method", "sequence_picking_order",
                                       "min_batch_size",    "max_batch_size",
                                       "metrics_path",      "verbose",
                                       "lr_scaling_params", "sentence_picking_order"};
  for (auto it = dynamic->begin(); it != dynamic->end(); ++it) {
    bool known = false;
    for (const char* k : kKnown) known = known || it.key() == k;
    if (!known)
      problem(base + "." + it.key(),
              "is an unknown key; valid: enabled, max_tokens, lr_scaling_method, "
              "sequence_picking_order, min_batch_size, max_batch_size, metrics_path, verbose, "
              "lr_scaling_params");
  }
  auto flag = [&](const char* key) {
    const json* value = child(*dynamic, key);
    if (unset(value)) return false;
    if (value->is_boolean()) return value->get<bool>();
    problem(base + "." + key, fmt::format("= {}; valid: true or false", json_excerpt(*value)));
    return false;
  };
  batching_enabled_ = flag("enabled");
  flag("verbose");  // DeepSpeed's log switch: checked, nothing to act on

  // [batching]: DeepSpeed's sampler is batch_by_seqlens, the greedy one.
  const core::PluginInfo& sampler = registry_.find(PluginKind::batching, "greedy");
  set_plugin("batching", "sampler", "greedy", base);
  if (const json* v = child(*dynamic, "max_tokens"); !unset(v))
    set("batching", &sampler, "max_tokens", *v, base + ".max_tokens");
  else
    problem(base + ".max_tokens", "is missing (the token budget is required)");
  for (const char* key : {"min_batch_size", "max_batch_size"})
    if (const json* v = child(*dynamic, key); !unset(v))
      set("batching", &sampler, key, *v, base + "." + key);
  for (const char* key : {"sequence_picking_order", "sentence_picking_order"})  // old name 2nd
    if (const json* v = child(*dynamic, key); !unset(v)) {
      set("batching", &sampler, "order", *v, base + "." + key);
      break;
    }
  if (const json* seed = child(*efficiency, "seed"); !unset(seed))
    set("batching", &sampler, "seed", *seed, "data_efficiency.seed");
  // The step's micro-batches: also the learning rate's base batch size, as
  // DeepSpeed's engine passes them.
  const auto steps = step_batch(root);
  if (steps) {
    entries_.push_back(
        {"batching", "effective_batch_size", ParamValue(*steps), "train_batch_size"});
    entries_.push_back(
        {"lr", "base_batch_size", ParamValue(static_cast<double>(*steps)), "train_batch_size"});
  }
  std::string metrics = "./curriculum_output/";
  if (const json* v = child(*dynamic, "metrics_path"); !unset(v)) {
    if (v->is_string())
      metrics = v->get<std::string>();
    else
      problem(base + ".metrics_path",
              fmt::format("= {}; valid: a directory (a string)", json_excerpt(*v)));
  }
  entries_.push_back(
      {"batching", "lengths",
       ParamValue((fs::path(metrics) / "seqlen" / "seqlen_sample_to_metric").string()),
       base + ".metrics_path"});
  entries_.push_back(
      {"batching", "format", ParamValue(std::string("mmidx")), base + ".metrics_path"});

  // [lr]: lr_scaling_method names any installed rule (case-insensitive;
  // null: "none"), lr_scaling_params its parameters.
  const std::string method_key = base + ".lr_scaling_method";
  std::string rule = "linear";
  if (const json* v = child(*dynamic, "lr_scaling_method"); v && !v->is_null()) {
    if (!v->is_string()) {
      problem(method_key, fmt::format("= {}; valid: a rule's name, or null", json_excerpt(*v)));
      return;
    }
    rule.clear();
    for (char c : v->get_ref<const std::string&>())
      rule += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const auto rules = registry_.names(PluginKind::lr);
    if (std::find(rules.begin(), rules.end(), rule) == rules.end()) {
      problem(method_key, fmt::format("'{}' is not valid; valid: {} (or null)",
                                      v->get_ref<const std::string&>(), fmt::join(rules, ", ")));
      return;
    }
  } else if (v) {
    rule = "none";
  }
  const core::PluginInfo& info = registry_.find(PluginKind::lr, rule);
  set_plugin("lr", "rule", rule, method_key);
  const std::string params_key = base + ".lr_scaling_params";
  if (const json* params = object(*dynamic, "lr_scaling_params", params_key))
    for (auto it = params->begin(); it != params->end(); ++it) {
      const bool known = std::any_of(info.params.begin(), info.params.end(),
                                     [&](const ParamSpec& p) { return it.key() == p.key; });
      if (known) {
        set("lr", &info, it.key(), it.value(), params_key + "." + it.key());
        continue;
      }
      std::vector<std::string> valid;
      for (const auto& p : info.params) valid.emplace_back(p.key);
      problem(params_key + "." + it.key(),
              fmt::format("is not a parameter of rule '{}'; valid: {}", rule,
                          valid.empty() ? "(none)" : fmt::format("{}", fmt::join(valid, ", "))));
    }
  lr_schedule(root);
}

void Mapping::lr_schedule(const json& root) {
  const json* scheduler = object(root, "scheduler", "scheduler");
  const json* scheduler_params =
      scheduler ? object(*scheduler, "params", "scheduler.params") : nullptr;
  // The peak: WarmupDecayLR's warmup_max_lr, else the optimizer's lr.
  const bool peak_given = scheduler_params && !unset(child(*scheduler_params, "warmup_max_lr"));
  if (const json* optimizer = object(root, "optimizer", "optimizer"))
    if (const json* params = object(*optimizer, "params", "optimizer.params"))
      if (const json* lr = child(*params, "lr"); !unset(lr) && !peak_given)
        set("lr", nullptr, "base_lr", *lr, "optimizer.params.lr");
  if (!scheduler) return;
  const json* type = child(*scheduler, "type");
  const std::string name = type && type->is_string() ? type->get<std::string>() : "";
  if (name != "WarmupDecayLR")
    throw Error(ErrorKind::unsupported,
                fmt::format("{}: scheduler.type: '{}' has no equivalent here; supported: "
                            "WarmupDecayLR with warmup_type \"linear\" (or no scheduler); "
                            "otherwise describe the schedule in the [lr] section of a TOML "
                            "config",
                            origin_, type && !type->is_string() ? json_excerpt(*type) : name));
  static const json empty = json::object();
  const json* params = scheduler_params ? scheduler_params : &empty;
  const json* warmup_type = child(*params, "warmup_type");
  const std::string warmup = unset(warmup_type)
                                 ? "log"
                                 : (warmup_type->is_string() ? warmup_type->get<std::string>()
                                                             : json_excerpt(*warmup_type));
  if (warmup != "linear")  // DeepSpeed's default is "log"
    throw Error(ErrorKind::unsupported,
                fmt::format("{}: scheduler.params.warmup_type: '{}' is not supported; only "
                            "\"linear\" warm-up maps to a ductile schedule",
                            origin_, warmup));
  entries_.push_back(
      {"lr", "schedule", ParamValue(std::string("warmup_linear")), "scheduler.type"});
  // DeepSpeed's default warm-up, where [lr]'s is none.
  if (unset(child(*params, "warmup_num_steps")))
    entries_.push_back({"lr", "warmup_steps", ParamValue(std::int64_t{1000}),
                        "scheduler.params.warmup_num_steps"});
  const std::pair<const char*, const char*> keys[] = {{"warmup_min_lr", "min_lr"},
                                                      {"warmup_max_lr", "base_lr"},
                                                      {"warmup_num_steps", "warmup_steps"},
                                                      {"total_num_steps", "total_steps"}};
  for (const auto& [theirs, ours] : keys)
    if (const json* v = child(*params, theirs); !unset(v))
      set("lr", nullptr, ours, *v, fmt::format("scheduler.params.{}", theirs));
  if (unset(child(*params, "total_num_steps")))
    problem("scheduler.params.total_num_steps", "is missing (WarmupDecayLR needs it)");
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
  // ductile's own sections given where a DeepSpeed config was expected (a
  // dict of sections passed to zero3.initialize): DeepSpeed has no such keys.
  for (const char* section : {"zero", "accelerator"})
    if (root.contains(section))
      mapping.problem(section, fmt::format("is a ductile section, not a DeepSpeed key (DeepSpeed's "
                                           "ZeRO is zero_optimization): give ductile's sections "
                                           "as TOML, or ductile.load_config(d, format=\"toml\")"));
  mapping.elasticity(root, options);
  mapping.zero(root, options);
  if (options.read_training) mapping.training(root);
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
