#include "ductile/pipeline/lr_schedule.hpp"

#include <cmath>
#include <limits>
#include <numbers>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ductile/pipeline/json.hpp"

namespace ductile::pipeline {
namespace {

Error bad(const std::string& what) {
  return Error(ErrorKind::invalid_argument, what);
}

}  // namespace

LrScheduleKind parse_lr_schedule_kind(std::string_view text) {
  std::vector<std::string> names;
  for (int k = 0; kLrScheduleNames[k]; ++k) {
    if (text == kLrScheduleNames[k]) return static_cast<LrScheduleKind>(k);
    names.emplace_back(kLrScheduleNames[k]);
  }
  throw bad(fmt::format("learning-rate schedule '{}' is unknown; valid: {}", text,
                        fmt::join(names, ", ")));
}

const char* to_string(LrScheduleKind kind) {
  return kLrScheduleNames[static_cast<int>(kind)];
}

void check_lr_schedule(const LrScheduleSpec& s) {
  if (!std::isfinite(s.base_lr) || s.base_lr < 0)
    throw bad(fmt::format("lr schedule: base_lr = {} must be a finite number >= 0", s.base_lr));
  if (!std::isfinite(s.min_lr) || s.min_lr < 0)
    throw bad(fmt::format("lr schedule: min_lr = {} must be a finite number >= 0", s.min_lr));
  if (s.warmup_steps < 0)
    throw bad(fmt::format("lr schedule: warmup_steps = {} must be >= 0", s.warmup_steps));
  if (s.kind != LrScheduleKind::constant && s.total_steps <= s.warmup_steps)
    throw bad(
        fmt::format("lr schedule '{}': total_steps = {} must be larger than warmup_steps = {}",
                    to_string(s.kind), s.total_steps, s.warmup_steps));
}

double base_schedule_lr(const LrScheduleSpec& s, std::int64_t step) {
  if (step < 0) step = 0;
  if (s.kind == LrScheduleKind::constant && s.warmup_steps == 0) return s.base_lr;
  if (step < s.warmup_steps)
    return s.min_lr +
           (s.base_lr - s.min_lr) * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  if (s.kind == LrScheduleKind::constant) return s.base_lr;
  double progress = static_cast<double>(step - s.warmup_steps) /
                    static_cast<double>(s.total_steps - s.warmup_steps);
  if (progress > 1.0) progress = 1.0;
  if (s.kind == LrScheduleKind::warmup_linear) return s.base_lr + (s.min_lr - s.base_lr) * progress;
  return s.min_lr + 0.5 * (s.base_lr - s.min_lr) * (1.0 + std::cos(std::numbers::pi * progress));
}

VariableBatchLrSchedule::VariableBatchLrSchedule(LrScheduleSpec spec,
                                                 std::shared_ptr<const LrScalingRule> rule,
                                                 double base_batch_size,
                                                 std::vector<std::int64_t> batch_sizes)
    : spec_(spec),
      rule_(std::move(rule)),
      base_batch_size_(base_batch_size),
      batch_sizes_(std::move(batch_sizes)) {
  check_lr_schedule(spec_);
  if (!rule_) throw bad("variable-batch lr schedule: no scaling rule given");
  if (!std::isfinite(base_batch_size_) || base_batch_size_ <= 0)
    throw bad(fmt::format("variable-batch lr schedule: base_batch_size = {} must be > 0",
                          base_batch_size_));
  if (batch_sizes_.empty()) throw bad("variable-batch lr schedule: no batch sizes (no steps)");
  for (std::size_t i = 0; i < batch_sizes_.size(); ++i)
    if (batch_sizes_[i] < 0)
      throw bad(fmt::format("variable-batch lr schedule: batch size of step {} is {}; must be >= 0",
                            i, batch_sizes_[i]));
  // DeepSpeed's convention: the rate of step 0 is set at construction.
  step_ = 0;
  lr_ = lr_at(0);
}

double VariableBatchLrSchedule::lr_at(std::int64_t step) const {
  const auto n = static_cast<std::int64_t>(batch_sizes_.size());
  const std::int64_t batch = batch_sizes_[static_cast<std::size_t>(((step % n) + n) % n)];
  return rule_->scale(base_schedule_lr(spec_, step), static_cast<double>(batch), base_batch_size_);
}

double VariableBatchLrSchedule::step() {
  // A restored state may stand at any step >= 0, the last one included.
  if (step_ == std::numeric_limits<std::int64_t>::max())
    throw bad(
        fmt::format("variable-batch lr schedule: step {} is the last one an int64 counts "
                    "(2^63 - 1); no step follows it",
                    step_));
  ++step_;
  lr_ = lr_at(step_);
  return lr_;
}

std::string VariableBatchLrSchedule::save_state() const {
  nlohmann::json j = {{"format", "ductile.variable_batch_lr"},
                      {"version", 1},
                      {"step", step_},
                      {"schedule", to_string(spec_.kind)},
                      {"base_lr", spec_.base_lr},
                      {"min_lr", spec_.min_lr},
                      {"warmup_steps", spec_.warmup_steps},
                      {"total_steps", spec_.total_steps},
                      {"base_batch_size", base_batch_size_},
                      {"batch_sizes", batch_sizes_}};
  return j.dump();
}

void VariableBatchLrSchedule::load_state(std::string_view text) {
  // A checkpoint is user input: depth-bounded before it is parsed.
  nlohmann::json j =
      parse_bounded_json(text, "lr schedule state", "not valid JSON", ErrorKind::invalid_argument);
  try {
    if (j.at("format") != "ductile.variable_batch_lr" || j.at("version") != 1)
      throw bad("lr schedule state: not a ductile.variable_batch_lr version 1 document");
    LrScheduleSpec spec;
    spec.kind = parse_lr_schedule_kind(j.at("schedule").get<std::string>());
    spec.base_lr = j.at("base_lr").get<double>();
    spec.min_lr = j.at("min_lr").get<double>();
    spec.warmup_steps = j.at("warmup_steps").get<std::int64_t>();
    spec.total_steps = j.at("total_steps").get<std::int64_t>();
    // Build the restored schedule completely before replacing this one, so a
    // bad state leaves it untouched.
    VariableBatchLrSchedule restored(spec, rule_, j.at("base_batch_size").get<double>(),
                                     j.at("batch_sizes").get<std::vector<std::int64_t>>());
    const auto step = j.at("step").get<std::int64_t>();
    if (step < 0) throw bad(fmt::format("lr schedule state: step = {} must be >= 0", step));
    restored.step_ = step;
    restored.lr_ = restored.lr_at(step);
    *this = std::move(restored);
  } catch (const nlohmann::json::exception& e) {
    throw bad(fmt::format("lr schedule state: missing or mistyped entry: {}", e.what()));
  }
}

}  // namespace ductile::pipeline
