// The variable-batch learning-rate schedule: a base schedule (constant,
// linear warm-up then linear decay, linear warm-up then cosine decay) whose
// value at each step is scaled by that step's real batch size through an
// LrScalingRule plugin (lr x k, lr x sqrt(k), lr; k = batch size / base
// batch size), as DeepSpeed's VariableBatchSizeLR does.
//
// Stepping follows DeepSpeed: construction sets the learning rate of step 0;
// after each optimizer step, step() moves to the next step and sets its
// rate. Batch sizes are those of the packing's steps (PackResult::batch_sizes);
// past the last one they repeat from the first, as DeepSpeed's do.
//
// Ownership: the schedule shares the rule (keeping its plugin loaded).
// Threading: not synchronized; use one schedule from one thread at a time
// (const methods may run concurrently with each other).
// Errors: ductile::Error(invalid_argument) for bad settings or a state that
// does not parse, naming the key and value.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/lr_scaling_rule.hpp"

namespace ductile::pipeline {

enum class LrScheduleKind { constant, warmup_linear, warmup_cosine };

// The names of the kinds, in enum order, nullptr-terminated (as the [lr]
// schedule key's allowed values are).
inline constexpr const char* kLrScheduleNames[] = {"constant", "warmup_linear", "warmup_cosine",
                                                   nullptr};

// One of kLrScheduleNames. Throws Error(invalid_argument).
LrScheduleKind parse_lr_schedule_kind(std::string_view text);
const char* to_string(LrScheduleKind kind);

struct LrScheduleSpec {
  LrScheduleKind kind = LrScheduleKind::constant;
  double base_lr = 1e-3;          // peak rate, tuned for the base batch size
  double min_lr = 0.0;            // rate at the start of warm-up and the end of decay
  std::int64_t warmup_steps = 0;  // linear ramp min_lr -> base_lr over these steps
  std::int64_t total_steps = 0;   // decay reaches min_lr here (not for constant)
};

// Checks a spec. Throws Error(invalid_argument) naming the bad field.
void check_lr_schedule(const LrScheduleSpec& spec);

// The unscaled rate of the base schedule at `step` (>= 0).
double base_schedule_lr(const LrScheduleSpec& spec, std::int64_t step);

class VariableBatchLrSchedule {
 public:
  // batch_sizes: samples of each step (non-empty, each >= 0); base_batch_size
  // > 0: the batch size base_lr is tuned for.
  VariableBatchLrSchedule(LrScheduleSpec spec, std::shared_ptr<const LrScalingRule> rule,
                          double base_batch_size, std::vector<std::int64_t> batch_sizes);

  // The current step and its learning rate.
  std::int64_t step_index() const { return step_; }
  double lr() const { return lr_; }

  // Advances to the next step and returns its learning rate.
  double step();

  // The scaled rate of any step, without changing the schedule.
  double lr_at(std::int64_t step) const;

  // The complete state as a JSON document (step, base schedule, base batch
  // size, batch sizes), to store in a checkpoint.
  std::string save_state() const;
  // Restores a saved state: the schedule continues with exactly the rates it
  // would have had. Throws Error(invalid_argument) for a malformed state.
  void load_state(std::string_view state);

  const LrScheduleSpec& spec() const { return spec_; }
  const std::vector<std::int64_t>& batch_sizes() const { return batch_sizes_; }
  double base_batch_size() const { return base_batch_size_; }

 private:
  LrScheduleSpec spec_;
  std::shared_ptr<const LrScalingRule> rule_;
  double base_batch_size_;
  std::vector<std::int64_t> batch_sizes_;
  std::int64_t step_ = 0;
  double lr_ = 0.0;
};

}  // namespace ductile::pipeline
