#include "ductile/pipeline/deepspeed_batching.hpp"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/json.hpp"

namespace ductile::pipeline {
namespace {

using nlohmann::json;

struct Reader {
  std::string source;
  Error fail(const std::string& key, const std::string& what) const {
    return Error(ErrorKind::config, fmt::format("{}: {}: {}", source, key, what));
  }
  const json* child(const json& parent, const char* key, const std::string& path) const {
    if (!parent.contains(key)) return nullptr;
    const json& v = parent.at(key);
    if (v.is_null()) return nullptr;
    (void)path;
    return &v;
  }
  std::int64_t integer(const json& v, const std::string& key, std::int64_t min) const {
    if (!v.is_number_integer() &&
        !(v.is_number_float() &&
          v.get<double>() == static_cast<double>(static_cast<std::int64_t>(v.get<double>()))))
      throw fail(key, fmt::format("{} is not an integer", json_excerpt(v)));
    const auto i =
        v.is_number_integer() ? v.get<std::int64_t>() : static_cast<std::int64_t>(v.get<double>());
    if (i < min) throw fail(key, fmt::format("{} is out of range; must be >= {}", i, min));
    return i;
  }
  double number(const json& v, const std::string& key) const {
    if (!v.is_number()) throw fail(key, fmt::format("{} is not a number", json_excerpt(v)));
    return v.get<double>();
  }
  std::string string(const json& v, const std::string& key) const {
    if (!v.is_string()) throw fail(key, fmt::format("{} is not a string", json_excerpt(v)));
    return v.get<std::string>();
  }
  bool boolean(const json& v, const std::string& key) const {
    if (!v.is_boolean()) throw fail(key, fmt::format("{} is not true or false", json_excerpt(v)));
    return v.get<bool>();
  }
};

}  // namespace

DeepSpeedBatching parse_deepspeed_batching(std::string_view text, std::string_view source,
                                           const std::filesystem::path& base_dir) {
  const core::PluginRegistry registry(core::PluginRegistry::default_search_path(), nullptr);
  return parse_deepspeed_batching(text, source, base_dir, registry);
}

DeepSpeedBatching parse_deepspeed_batching(std::string_view text, std::string_view source,
                                           const std::filesystem::path& base_dir,
                                           const core::PluginRegistry& registry) {
  Reader r{std::string(source)};
  const json root = parse_bounded_json(text, source, "not valid JSON", ErrorKind::config);
  if (!root.is_object()) throw r.fail("(top level)", "a DeepSpeed config must be a JSON object");
  DeepSpeedBatching out;
  const json* efficiency = r.child(root, "data_efficiency", "data_efficiency");
  const json* sampling = efficiency ? r.child(*efficiency, "data_sampling", "") : nullptr;
  const json* dyn = sampling ? r.child(*sampling, "dynamic_batching", "") : nullptr;
  const std::string base = "data_efficiency.data_sampling.dynamic_batching";
  if (!dyn || !dyn->is_object())
    throw r.fail(base, "missing: the config has no dynamic batching block");

  static const char* const kKnown[] = {"enabled",
                                       "max_tokens",
                                       "lr_scaling_method",
                                       "sequence_picking_order",
                                       "sentence_picking_order",
                                       "min_batch_size",
                                       "max_batch_size",
                                       "metrics_path",
                                       "verbose",
                                       "lr_scaling_params"};
  for (const auto& [key, value] : dyn->items()) {
    bool known = false;
    for (const char* k : kKnown) known = known || key == k;
    if (!known)
      throw r.fail(base + "." + key,
                   "unknown key; valid: enabled, max_tokens, lr_scaling_method, "
                   "sequence_picking_order, min_batch_size, max_batch_size, metrics_path, verbose, "
                   "lr_scaling_params");
  }
  if (const json* v = r.child(*dyn, "enabled", "")) out.enabled = r.boolean(*v, base + ".enabled");
  const json* max_tokens = r.child(*dyn, "max_tokens", "");
  if (!max_tokens) throw r.fail(base + ".max_tokens", "missing (the token budget is required)");
  out.sampler_params.set("max_tokens", r.integer(*max_tokens, base + ".max_tokens", 1));
  std::int64_t min_batch = 1, max_batch = 0;
  if (const json* v = r.child(*dyn, "min_batch_size", ""))
    min_batch = r.integer(*v, base + ".min_batch_size", 0);
  if (const json* v = r.child(*dyn, "max_batch_size", ""))
    max_batch = r.integer(*v, base + ".max_batch_size", 0);
  out.sampler_params.set("min_batch_size", min_batch);
  out.sampler_params.set("max_batch_size", max_batch);
  std::string order = "dataloader";
  const json* order_value = r.child(*dyn, "sequence_picking_order", "");
  std::string order_key = base + ".sequence_picking_order";
  if (!order_value) {
    order_value = r.child(*dyn, "sentence_picking_order", "");
    order_key = base + ".sentence_picking_order";
  }
  if (order_value) order = r.string(*order_value, order_key);
  // The valid orders are the sampler's schema's.
  const auto orders =
      core::schema_allowed_values(registry.find(PluginKind::batching, out.sampler), "order");
  if (!orders.empty() && std::find(orders.begin(), orders.end(), order) == orders.end())
    throw r.fail(order_key,
                 fmt::format("'{}' is not valid; valid: {}", order, fmt::join(orders, ", ")));
  out.sampler_params.set("order", order);
  std::int64_t seed = 1234;
  if (const json* v = r.child(*efficiency, "seed", ""))
    seed = r.integer(*v, "data_efficiency.seed", INT64_MIN);
  out.sampler_params.set("seed", seed);

  std::int64_t steps_batch = 1;
  if (const json* v = r.child(root, "train_batch_size", "")) {
    steps_batch = r.integer(*v, "train_batch_size", 1);
  } else {
    const json* micro = r.child(root, "train_micro_batch_size_per_gpu", "");
    const json* gas = r.child(root, "gradient_accumulation_steps", "");
    if (micro) steps_batch = r.integer(*micro, "train_micro_batch_size_per_gpu", 1);
    if (gas) {
      const std::int64_t steps = r.integer(*gas, "gradient_accumulation_steps", 1);
      std::int64_t product = 0;
      if (__builtin_mul_overflow(steps_batch, steps, &product))
        throw r.fail("gradient_accumulation_steps",
                     fmt::format("{} x train_micro_batch_size_per_gpu = {} exceeds 2^63 - 1 "
                                 "micro-batches per step; give smaller values",
                                 steps, steps_batch));
      steps_batch = product;
    }
  }
  out.sampler_params.set("effective_batch_size", steps_batch);
  out.base_batch_size = static_cast<double>(steps_batch);

  std::string method = "linear";
  if (dyn->contains("lr_scaling_method")) {
    const json& v = dyn->at("lr_scaling_method");
    method = v.is_null() ? "none" : r.string(v, base + ".lr_scaling_method");
  }
  // Any installed rule: DeepSpeed's linear/sqrt/none or an out-of-tree one.
  std::string lowered;
  for (char c : method) lowered += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const auto rules = registry.names(PluginKind::lr);
  if (std::find(rules.begin(), rules.end(), lowered) == rules.end())
    throw r.fail(base + ".lr_scaling_method", fmt::format("'{}' is not valid; valid: {} (or null)",
                                                          method, fmt::join(rules, ", ")));
  out.lr_rule = lowered;
  if (const json* v = r.child(*dyn, "lr_scaling_params", "")) {
    const std::string key = base + ".lr_scaling_params";
    if (!v->is_object())
      throw r.fail(key,
                   fmt::format("{} is not an object of the rule's parameters", json_excerpt(*v)));
    const core::PluginInfo& rule = registry.find(PluginKind::lr, out.lr_rule);
    for (const auto& item : v->items()) {
      const std::string& name = item.key();
      const auto& value = item.value();
      const auto spec = std::find_if(rule.params.begin(), rule.params.end(),
                                     [&](const ParamSpec& p) { return name == p.key; });
      if (spec == rule.params.end()) {
        std::vector<std::string> valid;
        for (const auto& p : rule.params) valid.emplace_back(p.key);
        throw r.fail(
            key + "." + name,
            fmt::format("rule '{}' has no such parameter; valid: {}", out.lr_rule,
                        valid.empty() ? "(none)" : fmt::format("{}", fmt::join(valid, ", "))));
      }
      auto converted = json_to_param(value, spec->type);
      if (!converted)
        throw r.fail(key + "." + name, fmt::format("{} is not {}", json_excerpt(value),
                                                   param_type_expectation(spec->type)));
      out.lr_params.set(name, std::move(*converted));
    }
    // Ranges and the rule's own checks: the same ones as a TOML [lr] section.
    try {
      core::complete_params(rule, out.lr_params);
    } catch (const Error& e) {
      throw r.fail(key, e.what());
    }
  }

  std::filesystem::path metrics = "./curriculum_output/";
  if (const json* v = r.child(*dyn, "metrics_path", ""))
    metrics = r.string(*v, base + ".metrics_path");
  if (metrics.is_relative() && !base_dir.empty()) metrics = base_dir / metrics;
  out.lengths_prefix = metrics / "seqlen" / "seqlen_sample_to_metric";

  if (const json* opt = r.child(root, "optimizer", "")) {
    if (const json* params = r.child(*opt, "params", ""))
      if (const json* lr = r.child(*params, "lr", ""))
        out.schedule.base_lr = r.number(*lr, "optimizer.params.lr");
  }
  if (const json* sched = r.child(root, "scheduler", "")) {
    const json* type = r.child(*sched, "type", "");
    const std::string name = type ? r.string(*type, "scheduler.type") : "";
    const json empty = json::object();
    const json* params = r.child(*sched, "params", "");
    if (!params) params = &empty;
    if (name != "WarmupDecayLR")
      throw Error(ErrorKind::unsupported,
                  fmt::format("{}: scheduler.type: '{}' has no equivalent here; supported: "
                              "WarmupDecayLR with warmup_type \"linear\" (or no scheduler); "
                              "otherwise describe the schedule in the [lr] section of a TOML "
                              "config",
                              source, name));
    std::string warmup_type = "log";  // DeepSpeed's default
    if (const json* v = r.child(*params, "warmup_type", ""))
      warmup_type = r.string(*v, "scheduler.params.warmup_type");
    if (warmup_type != "linear")
      throw Error(ErrorKind::unsupported,
                  fmt::format("{}: scheduler.params.warmup_type: '{}' is not supported; only "
                              "\"linear\" warm-up maps to a ductile schedule",
                              source, warmup_type));
    out.schedule.kind = LrScheduleKind::warmup_linear;
    if (const json* v = r.child(*params, "warmup_min_lr", ""))
      out.schedule.min_lr = r.number(*v, "scheduler.params.warmup_min_lr");
    if (const json* v = r.child(*params, "warmup_max_lr", ""))
      out.schedule.base_lr = r.number(*v, "scheduler.params.warmup_max_lr");
    out.schedule.warmup_steps = 1000;  // DeepSpeed's default warmup_num_steps
    if (const json* v = r.child(*params, "warmup_num_steps", ""))
      out.schedule.warmup_steps = r.integer(*v, "scheduler.params.warmup_num_steps", 0);
    const json* total = r.child(*params, "total_num_steps", "");
    if (!total)
      throw r.fail("scheduler.params.total_num_steps", "missing (WarmupDecayLR needs it)");
    out.schedule.total_steps = r.integer(*total, "scheduler.params.total_num_steps", 1);
    try {
      check_lr_schedule(out.schedule);
    } catch (const Error& e) {
      throw Error(ErrorKind::config, fmt::format("{}: scheduler: {}", source, e.what()));
    }
  }
  return out;
}

}  // namespace ductile::pipeline
