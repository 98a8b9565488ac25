// DeepSpeed's dynamic batching and its learning rate as [batching] and [lr]
// entries (deepspeed_config.hpp; DeepSpeedOptions::read_batching):
// data_efficiency.data_sampling.dynamic_batching onto the greedy sampler
// (DeepSpeed's batch_by_seqlens), lr_scaling_method onto an lr rule,
// optimizer.params.lr and WarmupDecayLR onto [lr]'s base schedule.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "deepspeed/mapping.hpp"

namespace ductile::pipeline::deepspeed_mapping {

namespace fs = std::filesystem;

std::optional<std::int64_t> Mapping::step_batch(const json& root) {
  if (!unset(child(root, "train_batch_size"))) return batch_key(root, "train_batch_size");
  std::int64_t micro = 1, steps = 1;
  if (!unset(child(root, "train_micro_batch_size_per_gpu"))) {
    auto read = batch_key(root, "train_micro_batch_size_per_gpu");
    if (!read) return std::nullopt;
    micro = *read;
  }
  if (!unset(child(root, "gradient_accumulation_steps"))) {
    auto read = batch_key(root, "gradient_accumulation_steps");
    if (!read) return std::nullopt;
    steps = *read;
  }
  // Each at most kMaxDeepSpeedBatchValue (2^31-1): the product fits.
  return micro * steps;
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
    rule = lowercase(v->get_ref<const std::string&>());
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

}  // namespace ductile::pipeline::deepspeed_mapping
