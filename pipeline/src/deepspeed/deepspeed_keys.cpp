// Every top-level key of a DeepSpeed config, and what ductile does with it:
// honoured (read by a part of the mapping or by the training engine),
// accepted with a warning naming it (it has no effect in ductile), or
// refused (ductile would train something else than DeepSpeed does). A key
// DeepSpeed does not have is warned about too: nothing is dropped silently.
// docs/deepspeed.md has the same table for users.
//
// Also the engine's own keys (the batch triple, steps_per_print,
// wall_clock_breakdown, log_level), read into DeepSpeedTraining when
// read_training.
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "deepspeed/mapping.hpp"

namespace ductile::pipeline::deepspeed_mapping {
namespace {

enum class KeyUse {
  honoured,  // read by the mapping or the training engine
  warned,    // accepted; has no effect in ductile (said when it is switched on)
  refused,   // would change what is trained: an error where ductile trains
};

// When a key of the warned or refused kind is switched on.
enum class OnWhen {
  present,      // any value but null / "auto"
  true_value,   // true
  not_one,      // a number other than 1
  enabled,      // an object whose "enabled" is true
  non_empty,    // an object with a key, or any other non-null value
  above_one,    // a number above 1, or an object whose autotp_size is above 1
  not_mean,     // a string other than "mean"
  false_value,  // false
};

struct TopLevelKey {
  const char* key;
  KeyUse use;
  OnWhen when;
  const char* why;  // for warned and refused keys: what ductile does instead
};

// DeepSpeed 0.19.7's top-level keys (deepspeed/runtime/config.py).
constexpr TopLevelKey kTopLevelKeys[] = {
    {"train_batch_size", KeyUse::honoured, OnWhen::present, ""},
    {"train_micro_batch_size_per_gpu", KeyUse::honoured, OnWhen::present, ""},
    {"gradient_accumulation_steps", KeyUse::honoured, OnWhen::present, ""},
    {"steps_per_print", KeyUse::honoured, OnWhen::present, ""},
    {"wall_clock_breakdown", KeyUse::honoured, OnWhen::present, ""},
    {"optimizer", KeyUse::honoured, OnWhen::present, ""},
    {"scheduler", KeyUse::honoured, OnWhen::present, ""},
    {"gradient_clipping", KeyUse::honoured, OnWhen::present, ""},
    {"fp16", KeyUse::honoured, OnWhen::present, ""},
    {"bf16", KeyUse::honoured, OnWhen::present, ""},
    {"bfloat16", KeyUse::honoured, OnWhen::present, ""},
    {"zero_optimization", KeyUse::honoured, OnWhen::present, ""},
    {"elasticity", KeyUse::honoured, OnWhen::present, ""},
    {"data_efficiency", KeyUse::honoured, OnWhen::present, ""},
    {"dataloader_drop_last", KeyUse::honoured, OnWhen::present, ""},
    {"log_level", KeyUse::honoured, OnWhen::present, ""},
    // ductile's own (DeepSpeed ignores it): in-memory snapshots under `ductile agent`.
    {"snapshot", KeyUse::honoured, OnWhen::present, ""},
    {"zero_allow_untested_optimizer", KeyUse::warned, OnWhen::true_value,
     "ductile's ZeRO-3 steps any torch optimizer the script passes; a config's optimizer must "
     "be Adam or AdamW"},
    {"zero_force_ds_cpu_optimizer", KeyUse::warned, OnWhen::false_value,
     "with offload_optimizer, ductile always steps Adam and AdamW with its own CPU Adam"},
    {"prescale_gradients", KeyUse::warned, OnWhen::true_value,
     "ductile divides the reduced gradient sum by the world size once"},
    {"gradient_predivide_factor", KeyUse::warned, OnWhen::not_one,
     "ductile divides the reduced gradient sum by the world size once"},
    {"sparse_gradients", KeyUse::warned, OnWhen::true_value,
     "ductile reduces every gradient densely"},
    {"communication_data_type", KeyUse::warned, OnWhen::present,
     "ductile reduces gradients in the master dtype (fp32 with mixed precision)"},
    {"seq_parallel_communication_data_type", KeyUse::warned, OnWhen::present,
     "ductile has no sequence parallelism"},
    {"disable_allgather", KeyUse::warned, OnWhen::true_value,
     "ductile's ZeRO-3 gathers parameters with its own collectives"},
    {"dump_state", KeyUse::warned, OnWhen::true_value,
     "ductile does not print the engine state; see engine.stats()"},
    {"memory_breakdown", KeyUse::warned, OnWhen::true_value,
     "ductile reports memory through engine.stats()"},
    {"eigenvalue", KeyUse::warned, OnWhen::enabled, "ductile computes no eigenvalues"},
    {"checkpoint", KeyUse::warned, OnWhen::non_empty,
     "ductile's checkpoints are always validated and load at any world size"},
    {"data_types", KeyUse::warned, OnWhen::non_empty,
     "ductile accumulates gradients in the master dtype (fp32 with mixed precision)"},
    {"aio", KeyUse::warned, OnWhen::non_empty, "ductile's NVMe reads size their own I/O"},
    {"flops_profiler", KeyUse::warned, OnWhen::enabled, "ductile has no FLOPs profiler"},
    {"tensorboard", KeyUse::warned, OnWhen::enabled,
     "ductile logs through Python's logging; the Trainer's report_to reaches TensorBoard"},
    {"wandb", KeyUse::warned, OnWhen::enabled,
     "ductile logs through Python's logging; the Trainer's report_to reaches W&B"},
    {"csv_monitor", KeyUse::warned, OnWhen::enabled, "ductile logs through Python's logging"},
    {"comet", KeyUse::warned, OnWhen::enabled, "ductile logs through Python's logging"},
    {"comms_logger", KeyUse::warned, OnWhen::enabled,
     "ductile counts its collectives in engine.stats()"},
    {"monitor_config", KeyUse::warned, OnWhen::non_empty, "ductile logs through Python's logging"},
    {"timers", KeyUse::warned, OnWhen::non_empty, "ductile times steps with wall_clock_breakdown"},
    {"activation_checkpointing", KeyUse::warned, OnWhen::non_empty,
     "it configures deepspeed.checkpointing; use torch.utils.checkpoint (non-reentrant) in the "
     "model"},
    {"pipeline", KeyUse::warned, OnWhen::non_empty, "ductile has no pipeline parallelism"},
    {"autotuning", KeyUse::warned, OnWhen::enabled, "ductile has no autotuner"},
    {"nebula", KeyUse::warned, OnWhen::enabled, "ductile writes its own checkpoints"},
    {"graph_harvesting", KeyUse::warned, OnWhen::true_value, "ductile does not capture graphs"},
    {"compile", KeyUse::warned, OnWhen::enabled, "call torch.compile on the model's blocks"},
    {"data_parallel_size", KeyUse::warned, OnWhen::present,
     "ductile's data-parallel size is the world size"},
    {"use_data_before_expert_parallelism", KeyUse::warned, OnWhen::true_value,
     "ductile has no expert parallelism"},
    {"amp", KeyUse::refused, OnWhen::enabled,
     "ductile has no NVIDIA Apex AMP; use \"bf16\" or \"fp16\" instead"},
    {"torch_autocast", KeyUse::refused, OnWhen::enabled,
     "ductile's mixed precision is \"bf16\" or \"fp16\" with fp32 masters"},
    {"managed_gradient_accumulation", KeyUse::refused, OnWhen::false_value,
     "ductile's engine counts micro-steps itself (gradient_accumulation_steps)"},
    {"gradient_allreduce_op", KeyUse::refused, OnWhen::not_mean,
     "ductile averages gradients over the ranks (\"mean\")"},
    {"progressive_layer_drop", KeyUse::refused, OnWhen::enabled, "ductile does not drop layers"},
    {"curriculum_learning", KeyUse::refused, OnWhen::enabled,
     "ductile has no curriculum sampler; data_efficiency.dynamic_batching is its sampler"},
    {"compression_training", KeyUse::refused, OnWhen::non_empty,
     "ductile does not compress models"},
    {"quantize_training", KeyUse::refused, OnWhen::enabled, "ductile does not quantize training"},
    {"weight_quantization", KeyUse::refused, OnWhen::non_empty,
     "ductile does not quantize weights"},
    {"sparse_attention", KeyUse::refused, OnWhen::non_empty,
     "ductile does not replace the model's attention"},
    {"hybrid_engine", KeyUse::refused, OnWhen::enabled, "ductile has no hybrid (RLHF) engine"},
    {"tensor_parallel", KeyUse::refused, OnWhen::above_one, "ductile has no tensor parallelism"},
    {"sequence_parallel_size", KeyUse::refused, OnWhen::above_one,
     "ductile has no sequence parallelism"},
    {"expert_parallel", KeyUse::refused, OnWhen::non_empty, "ductile has no expert parallelism"},
};

bool is_true(const json* value) {
  return value && value->is_boolean() && value->get<bool>();
}

bool switched_on(const json& value, OnWhen when) {
  if (unset(&value)) return false;
  switch (when) {
    case OnWhen::present:
      return true;
    case OnWhen::true_value:
      return !(value.is_boolean() && !value.get<bool>());
    case OnWhen::false_value:
      return value.is_boolean() && !value.get<bool>();
    case OnWhen::not_one:
      return !(value.is_number() && value.get<double>() == 1.0);
    case OnWhen::enabled: {
      if (!value.is_object()) return !(value.is_boolean() && !value.get<bool>());
      auto it = value.find("enabled");
      return it != value.end() && is_true(&*it);
    }
    case OnWhen::non_empty:
      return !(value.is_object() && value.empty()) && !(value.is_array() && value.empty());
    case OnWhen::above_one: {
      const json* number = &value;
      if (value.is_object()) {
        auto it = value.find("autotp_size");
        if (it == value.end()) return false;
        number = &*it;
      }
      return !(number->is_number() && number->get<double>() <= 1.0);
    }
    case OnWhen::not_mean:
      return !(value.is_string() && lowercase(value.get<std::string>()) == "mean");
  }
  return false;
}

}  // namespace

void Mapping::top_level_keys(const json& root, bool trains) {
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& key = it.key();
    const TopLevelKey* known = nullptr;
    for (const auto& entry : kTopLevelKeys)
      if (key == entry.key) known = &entry;
    if (known == nullptr) {
      // ductile's own sections are reported by deepspeed_sections.
      if (key != "zero" && key != "accelerator")
        warnings_.push_back(fmt::format("{}: {} is not a DeepSpeed key; ignored", origin_, key));
      continue;
    }
    if (known->use == KeyUse::honoured || !switched_on(it.value(), known->when)) continue;
    if (known->use == KeyUse::refused && trains)
      problem(key, fmt::format("= {} is not supported: {}", json_excerpt(it.value()), known->why));
    else if (known->use == KeyUse::refused)
      warnings_.push_back(fmt::format("{}: {} = {}: ductile's ZeRO-3 engine refuses it: {}",
                                      origin_, key, json_excerpt(it.value()), known->why));
    else
      warnings_.push_back(fmt::format("{}: {} is accepted, has no effect in ductile: {}", origin_,
                                      key, known->why));
  }
}

std::optional<std::int64_t> Mapping::batch_key(const json& root, const char* key) {
  if (auto read = batch_keys_.find(key); read != batch_keys_.end()) return read->second;
  // steps_per_print sets the engine's log_interval, whose bound it shares.
  const std::int64_t most =
      std::string_view(key) == "steps_per_print" ? kMaxLogInterval : kMaxDeepSpeedBatchValue;
  // An integer, never a boolean, a fraction or a string.
  auto value = integer(
      *child(root, key), key, [most](std::int64_t v) { return v >= 1 && v <= most; },
      fmt::format("an integer from 1 to {}", most));
  batch_keys_.emplace(key, value);
  return value;
}

void Mapping::engine_keys(const json& root) {
  DeepSpeedTraining& t = training_;
  for (auto [key, out] :
       {std::pair{"train_batch_size", &t.train_batch_size},
        std::pair{"train_micro_batch_size_per_gpu", &t.train_micro_batch_size_per_gpu},
        std::pair{"gradient_accumulation_steps", &t.gradient_accumulation_steps},
        std::pair{"steps_per_print", &t.steps_per_print}})
    if (!unset(child(root, key))) *out = batch_key(root, key);
  auto flag = [&](const char* key, bool& out) {
    const json* value = child(root, key);
    if (unset(value)) return;
    if (value->is_boolean())
      out = value->get<bool>();
    else
      problem(key, fmt::format("= {}; valid: true or false", json_excerpt(*value)));
  };
  flag("wall_clock_breakdown", t.wall_clock_breakdown);
  flag("dataloader_drop_last", t.dataloader_drop_last);
  if (const json* value = child(root, "log_level"); !unset(value)) {
    const std::string level = value->is_string() ? lowercase(value->get<std::string>()) : "";
    if (level == "debug" || level == "info" || level == "warning" || level == "error" ||
        level == "critical")
      t.log_level = level;
    else
      problem("log_level", fmt::format("= {}; valid: \"debug\", \"info\", \"warning\", "
                                       "\"error\", \"critical\"",
                                       json_excerpt(*value)));
  }
}

}  // namespace ductile::pipeline::deepspeed_mapping
