// DeepSpeed's learning-rate schedulers (deepspeed.runtime.lr_schedules):
// WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle and LRRangeTest, as a
// DeepSpeed config's `scheduler {type, params}` block or the Python classes
// of ductile.deepspeed.lr_schedules name them. Each type has a typed spec
// whose fields carry DeepSpeed's parameter names and defaults; the spec is
// read from JSON once (the config mapping and the Python binding share
// read_deepspeed_schedule), checked once, and DeepSpeedSchedule computes the
// rate of every param group (and OneCycle's first beta) at any step with
// DeepSpeed's formulas, in the same floating-point operations.
//
// Steps follow DeepSpeed: `last_batch_iteration` is the index of the last
// batch trained; -1 (the default) starts from the beginning, and a scheduler
// made at -1 sets initial_lrs() (and initial_betas()). Each step() of the
// Python scheduler adds one and sets lrs() of the new index.
//
// Where ductile is stricter than DeepSpeed, it says so at the field: an
// unknown warmup_type is an error (DeepSpeed falls back to "log" with a
// warning), and values DeepSpeed takes without a check (a negative rate, a
// momentum outside [0, 1)) are refused.
//
// Ownership: specs and schedules are plain values.
// Threading: no shared state; a schedule's const methods may run
// concurrently.
// Errors: ductile::Error(invalid_argument) naming the key (with the caller's
// prefix, e.g. "scheduler.params.warmup_num_steps"), the bad value and what
// would be valid.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "ductile/pipeline/json.hpp"

namespace ductile::pipeline {

enum class DeepSpeedScheduleType {
  warmup_lr,
  warmup_decay_lr,
  warmup_cosine_lr,
  one_cycle,
  lr_range_test
};

// DeepSpeed's names of the types, in enum order, nullptr-terminated. The
// names are exact (DeepSpeed looks them up as attribute names).
inline constexpr const char* kDeepSpeedScheduleNames[] = {
    "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", nullptr};

const char* to_string(DeepSpeedScheduleType type);
// nullopt for any name but the five.
std::optional<DeepSpeedScheduleType> deepspeed_schedule_type(std::string_view name);

// How the warm-up rises: "log" (DeepSpeed's default): log(step + 1) /
// log(warmup_num_steps); "linear": step / warmup_num_steps.
enum class WarmupType { log, linear };

// A value for every param group: one number for all of them, or a list of
// one per group (`list` true: its length must be the number of groups).
struct PerGroup {
  std::vector<double> values;
  bool list = false;

  PerGroup() = default;
  PerGroup(double value) : values{value} {}  // implicit: one value for all groups
  PerGroup(std::vector<double> per_group, bool is_list)
      : values(std::move(per_group)), list(is_list) {}
  bool operator==(const PerGroup&) const = default;
};

struct WarmupLrSpec {
  PerGroup warmup_min_lr = 0.0;
  std::optional<PerGroup> warmup_max_lr;  // nullopt: each group's lr
  std::int64_t warmup_num_steps = 1000;   // >= 1; DeepSpeed warms up over max(2, this)
  WarmupType warmup_type = WarmupType::log;
};

// WarmupLR's warm-up, then a linear decay to warmup_min_lr at
// total_num_steps.
struct WarmupDecayLrSpec {
  std::int64_t total_num_steps = 0;  // required
  PerGroup warmup_min_lr = 0.0;
  // nullopt (a null in JSON, None in Python): each group's lr, as DeepSpeed
  // passes None on to WarmupLR.
  std::optional<PerGroup> warmup_max_lr = PerGroup(0.001);
  std::int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::log;
};

// Ratios of each group's lr when the scheduler is made: a warm-up from
// warmup_min_ratio to 1, then a cosine decay to cos_min_ratio at
// total_num_steps.
struct WarmupCosineLrSpec {
  std::int64_t total_num_steps = 0;  // required
  double warmup_min_ratio = 0.0;
  std::int64_t warmup_num_steps = 1000;
  double cos_min_ratio = 0.0001;
  WarmupType warmup_type = WarmupType::log;
};

// One cycle cycle_min_lr -> cycle_max_lr -> cycle_min_lr (first half
// cycle_first_step_size steps, second half cycle_second_step_size), then a
// decay of the rate (min_lr / (1 + decay_lr_rate * steps / decay_step_size))
// and of the first beta; the first beta cycles inversely, max -> min -> max.
struct OneCycleSpec {
  PerGroup cycle_min_lr;  // required
  PerGroup cycle_max_lr;  // required
  double decay_lr_rate = 0.0;
  double cycle_first_step_size = 2000;                   // > 0
  std::optional<double> cycle_second_step_size;          // nullopt: the first's
  std::int64_t cycle_first_stair_count = 0;              // <= 0: continuous
  std::optional<std::int64_t> cycle_second_stair_count;  // nullopt: the first's
  double decay_step_size = 0;                            // 0: no decay after the cycle
  // Cycles the first beta of optimizers that have betas (Adam's); the
  // second is set to 0.99, as DeepSpeed does.
  bool cycle_momentum = true;
  PerGroup cycle_min_mom = 0.8;
  PerGroup cycle_max_mom = 0.9;
  double decay_mom_rate = 0.0;
};

// lr_range_test_min_lr x (1 + lr_range_test_step_rate x interval), the
// interval being (step + 1) / lr_range_test_step_size, floored when
// lr_range_test_staircase.
struct LrRangeTestSpec {
  PerGroup lr_range_test_min_lr = 0.001;
  std::int64_t lr_range_test_step_size = 2000;
  double lr_range_test_step_rate = 1.0;
  bool lr_range_test_staircase = false;
};

using DeepSpeedScheduleParams = std::variant<WarmupLrSpec, WarmupDecayLrSpec, WarmupCosineLrSpec,
                                             OneCycleSpec, LrRangeTestSpec>;

struct DeepSpeedScheduleSpec {
  DeepSpeedScheduleParams params;  // its alternative is the type
  // The index of the last batch when the scheduler is made (>= -1; -1: from
  // the beginning), a parameter of every type.
  std::int64_t last_batch_iteration = -1;

  DeepSpeedScheduleType type() const { return static_cast<DeepSpeedScheduleType>(params.index()); }
};

// Where read_deepspeed_schedule reports: `problem(key, what)` for a value it
// refuses (the key with the caller's prefix; `what` starts with "= <value>;
// valid: ..." or "is missing"), `unknown(key, why)` for a parameter the type
// does not have (`why` lists the type's parameters).
struct ScheduleReport {
  std::function<void(const std::string& key, const std::string& what)> problem;
  std::function<void(const std::string& key, const std::string& why)> unknown;
};

// The spec of `type` (a JSON string, one of kDeepSpeedScheduleNames) from
// `params` (a JSON object; nullptr or null: none given). A key absent, null
// or "auto" (Hugging Face's placeholder) keeps the type's default; null sets
// an optional field (warmup_max_lr, cycle_second_*) to nullopt, as
// DeepSpeed's None. Keys are named `key_prefix` + the parameter
// ("scheduler.params." + "warmup_num_steps"); a bad type is reported as
// `type_key`. Returns nullopt after reporting any problem.
std::optional<DeepSpeedScheduleSpec> read_deepspeed_schedule(const nlohmann::json& type,
                                                             const nlohmann::json* params,
                                                             const std::string& type_key,
                                                             const std::string& key_prefix,
                                                             const ScheduleReport& report);

// The same, throwing Error(invalid_argument) with every problem, an unknown
// parameter included (one per line).
DeepSpeedScheduleSpec deepspeed_schedule_spec(std::string_view type, const nlohmann::json& params,
                                              const std::string& key_prefix = "");

// Checks a spec made in code as read_deepspeed_schedule checks one read.
// Throws Error(invalid_argument) naming the field.
void check_deepspeed_schedule(const DeepSpeedScheduleSpec& spec);

// Every parameter of the spec with its value (defaults included; an unset
// optional is null; a PerGroup is a number or a list), and
// last_batch_iteration: what read_deepspeed_schedule reads back to the same
// spec.
nlohmann::json deepspeed_schedule_params(const DeepSpeedScheduleSpec& spec);

class DeepSpeedSchedule {
 public:
  // OneCycle's second beta, which DeepSpeed sets in every group it cycles.
  static constexpr double kOneCycleSecondBeta = 0.99;

  // group_lrs: each param group's lr when the scheduler is made (WarmupLR's
  // warmup_max_lr when absent, WarmupCosineLR's base); non-empty.
  // optimizer_has_betas: whether the optimizer has betas (OneCycle cycles
  // the first one only then, as DeepSpeed does). Throws
  // Error(invalid_argument) for a bad spec or a per-group list whose length
  // is not the number of groups.
  DeepSpeedSchedule(DeepSpeedScheduleSpec spec, std::vector<double> group_lrs,
                    bool optimizer_has_betas = true);

  const DeepSpeedScheduleSpec& spec() const { return spec_; }
  std::size_t groups() const { return group_lrs_.size(); }
  // OneCycle with cycle_momentum on an optimizer with betas.
  bool cycles_momentum() const { return cycles_momentum_; }

  // The rate of every group once `last_batch_iteration` batches (plus one)
  // have run: DeepSpeed's get_lr() at that index (any integer).
  std::vector<double> lrs(std::int64_t last_batch_iteration) const;
  // The first beta of every group at that index (empty unless
  // cycles_momentum()).
  std::vector<double> betas(std::int64_t last_batch_iteration) const;

  // What a scheduler made at last_batch_iteration -1 sets at once (the
  // momentum's initial value is the cycle's minimum, not betas(-1)).
  std::vector<double> initial_lrs() const;
  std::vector<double> initial_betas() const;

 private:
  DeepSpeedScheduleSpec spec_;
  std::vector<double> group_lrs_;
  bool cycles_momentum_ = false;
  // The spec's per-group values, one per group: the low and high rates
  // (warmup_min_lr / warmup_max_lr, cycle_min_lr / cycle_max_lr,
  // lr_range_test_min_lr) and OneCycle's momenta.
  std::vector<double> low_lrs_, high_lrs_, low_moms_, high_moms_;
};

}  // namespace ductile::pipeline
