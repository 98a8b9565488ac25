// What a DeepSpeed config sets for the training framework rather than for a
// plugin (DeepSpeedTraining, deepspeed_config.hpp): precision and fp16 loss
// scaling, gradient clipping, the optimizer, the learning-rate scheduler.
// Read in the mapping's one pass when DeepSpeedOptions::read_training asks.
#include <array>
#include <string>

#include <fmt/format.h>

#include "deepspeed/mapping.hpp"

namespace ductile::pipeline::deepspeed_mapping {

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

void Mapping::training(const json& root, bool trains) {
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
  if (const json* section = object(root, "optimizer", "optimizer")) optimizer(*section, trains);
  if (const json* section = object(root, "scheduler", "scheduler")) scheduler(*section);
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

void Mapping::optimizer(const json& section, bool trains) {
  const json* type = child(section, "type");
  const std::string lowered =
      type && type->is_string() ? lowercase(type->get_ref<const std::string&>()) : "";
  if (lowered != "adam" && lowered != "adamw") {
    const std::string shown = type ? json_excerpt(*type) : std::string("(missing)");
    // DeepSpeed itself steps its other optimizers: only ductile's engine
    // cannot, so a config it may train is not wrong for having one.
    if (trains)
      problem("optimizer.type", fmt::format("= {}; valid: \"Adam\", \"AdamW\"", shown));
    else
      warnings_.push_back(fmt::format(
          "{}: optimizer.type = {}: ductile's ZeRO-3 engine refuses it: it steps \"Adam\" and "
          "\"AdamW\"",
          origin_, shown));
    return;
  }
  DeepSpeedTraining::Optimizer optimizer;
  optimizer.type = type->get<std::string>();
  bool adam_w_mode = true, torch_adam = false;
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
      } else if (key == "torch_adam") {  // which implementation: the framework's own
        torch_adam = value.is_boolean() && value.get<bool>();
      } else {
        warn(user_key, "ductile's Adam and AdamW have no such setting");
      }
    }
  // DeepSpeed's own Adam (FusedAdam, DeepSpeedCPUAdam) decays no weight
  // unless told; with torch_adam it is torch's, whose AdamW decays 0.01.
  if (!optimizer.weight_decay && !torch_adam) optimizer.weight_decay = 0.0;
  optimizer.decoupled_weight_decay = lowered == "adamw" || adam_w_mode;
  training_.optimizer = std::move(optimizer);
}

void Mapping::scheduler(const json& section) {
  const json* params = child(section, "params");
  if (!unset(params) && !params->is_object()) {
    problem("scheduler.params", fmt::format("must be an object, got {}", json_excerpt(*params)));
    return;
  }
  const json* type = child(section, "type");
  static const json kMissing;
  ScheduleReport report{
      [this](const std::string& key, const std::string& what) { problem(key, what); },
      [this](const std::string& key, const std::string& why) { warn(key, why); }};
  auto spec =
      read_deepspeed_schedule(unset(type) ? kMissing : *type, unset(params) ? nullptr : params,
                              "scheduler.type", "scheduler.params.", report);
  for (auto it = section.begin(); it != section.end(); ++it)
    if (it.key() != "type" && it.key() != "params")
      warn("scheduler." + it.key(), "a scheduler block has only \"type\" and \"params\"");
  if (spec) training_.scheduler = std::move(*spec);
}

}  // namespace ductile::pipeline::deepspeed_mapping
