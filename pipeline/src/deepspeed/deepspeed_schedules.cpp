// DeepSpeed's learning-rate schedulers (see
// ductile/pipeline/deepspeed_schedules.hpp): each type's parameters as one
// table (fields()) that reading, checking and writing back all walk, and the
// rates computed in the order of DeepSpeed's operations, so that the values
// are DeepSpeed's to the last bit on the same libm.
#include "ductile/pipeline/deepspeed_schedules.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <set>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ductile/error.hpp"

namespace ductile::pipeline {
namespace {

using nlohmann::json;

// What a field's values must be, for the check and its message.
struct Bounds {
  double low = -std::numeric_limits<double>::infinity();
  double high = std::numeric_limits<double>::infinity();
  bool low_open = false;
  bool high_open = false;
  const char* valid = "";
};

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr Bounds kRate{0, kInf, false, false, "a number >= 0"};
constexpr Bounds kRates{0, kInf, false, false,
                        "a number >= 0, or a list of them with one per param group"};
constexpr Bounds kMomenta{0, 1, false, true,
                          "a number in [0, 1), or a list of them with one per param group"};
constexpr Bounds kPositiveSteps{1, kInf, false, false, "an integer >= 1"};
constexpr Bounds kTotalSteps{0, kInf, false, false, "an integer >= 0"};
constexpr Bounds kPositive{0, kInf, true, false, "a number > 0"};
constexpr Bounds kStairs{-kInf, kInf, false, false, "an integer (0 or less: no stairs)"};
constexpr Bounds kAnyNumber{-kInf, kInf, false, false, "a finite number"};
constexpr Bounds kFlag{-kInf, kInf, false, false, "true or false"};
constexpr Bounds kWarmupType{-kInf, kInf, false, false, "\"log\" or \"linear\""};
constexpr Bounds kLastBatch{-1, kInf, false, false, "an integer >= -1 (-1: from the beginning)"};

// A key the type cannot do without (DeepSpeed's positional arguments).
constexpr bool kRequired = true;

// Every parameter of a spec, in DeepSpeed's order: visit(key, field, bounds,
// required). `Spec` may be const.
template <class Spec, class Visit>
void fields(Spec& s, Visit&& visit) {
  using Plain = std::remove_const_t<Spec>;
  if constexpr (std::is_same_v<Plain, WarmupLrSpec> || std::is_same_v<Plain, WarmupDecayLrSpec>) {
    if constexpr (std::is_same_v<Plain, WarmupDecayLrSpec>)
      visit("total_num_steps", s.total_num_steps, kTotalSteps, kRequired);
    visit("warmup_min_lr", s.warmup_min_lr, kRates, false);
    visit("warmup_max_lr", s.warmup_max_lr, kRates, false);
    visit("warmup_num_steps", s.warmup_num_steps, kPositiveSteps, false);
    visit("warmup_type", s.warmup_type, kWarmupType, false);
  } else if constexpr (std::is_same_v<Plain, WarmupCosineLrSpec>) {
    visit("total_num_steps", s.total_num_steps, kTotalSteps, kRequired);
    visit("warmup_min_ratio", s.warmup_min_ratio, kRate, false);
    visit("warmup_num_steps", s.warmup_num_steps, kPositiveSteps, false);
    visit("cos_min_ratio", s.cos_min_ratio, kRate, false);
    visit("warmup_type", s.warmup_type, kWarmupType, false);
  } else if constexpr (std::is_same_v<Plain, OneCycleSpec>) {
    visit("cycle_min_lr", s.cycle_min_lr, kRates, kRequired);
    visit("cycle_max_lr", s.cycle_max_lr, kRates, kRequired);
    visit("decay_lr_rate", s.decay_lr_rate, kRate, false);
    visit("cycle_first_step_size", s.cycle_first_step_size, kPositive, false);
    visit("cycle_second_step_size", s.cycle_second_step_size, kRate, false);
    visit("cycle_first_stair_count", s.cycle_first_stair_count, kStairs, false);
    visit("cycle_second_stair_count", s.cycle_second_stair_count, kStairs, false);
    visit("decay_step_size", s.decay_step_size, kRate, false);
    visit("cycle_momentum", s.cycle_momentum, kFlag, false);
    visit("cycle_min_mom", s.cycle_min_mom, kMomenta, false);
    visit("cycle_max_mom", s.cycle_max_mom, kMomenta, false);
    visit("decay_mom_rate", s.decay_mom_rate, kAnyNumber, false);
  } else {
    static_assert(std::is_same_v<Plain, LrRangeTestSpec>);
    visit("lr_range_test_min_lr", s.lr_range_test_min_lr, kRates, false);
    visit("lr_range_test_step_size", s.lr_range_test_step_size, kPositiveSteps, false);
    visit("lr_range_test_step_rate", s.lr_range_test_step_rate, kRate, false);
    visit("lr_range_test_staircase", s.lr_range_test_staircase, kFlag, false);
  }
}

// The spec's fields and then last_batch_iteration, common to every type.
template <class Spec, class Visit>
void all_fields(Spec& spec, Visit&& visit) {
  std::visit([&](auto& params) { fields(params, visit); }, spec.params);
  visit("last_batch_iteration", spec.last_batch_iteration, kLastBatch, false);
}

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

// A field's value as JSON (an unset optional: null).
template <class T>
json to_json(const T& field) {
  if constexpr (is_optional<T>::value) {
    return field ? to_json(*field) : json(nullptr);
  } else if constexpr (std::is_same_v<T, PerGroup>) {
    if (field.list) return json(field.values);
    return field.values.empty() ? json(nullptr) : json(field.values.front());
  } else if constexpr (std::is_same_v<T, WarmupType>) {
    return field == WarmupType::log ? "log" : "linear";
  } else {
    return json(field);
  }
}

// Whether a typed value is within `bounds` (a PerGroup: each value, and at
// least one).
bool in_bounds(double value, const Bounds& bounds) {
  return std::isfinite(value) && (bounds.low_open ? value > bounds.low : value >= bounds.low) &&
         (bounds.high_open ? value < bounds.high : value <= bounds.high);
}
template <class T>
bool in_bounds(const T& field, const Bounds& bounds) {
  if constexpr (is_optional<T>::value) {
    return !field || in_bounds(*field, bounds);
  } else if constexpr (std::is_same_v<T, PerGroup>) {
    if (field.values.empty()) return false;
    return std::all_of(field.values.begin(), field.values.end(),
                       [&](double v) { return in_bounds(v, bounds); });
  } else if constexpr (std::is_same_v<T, double> || std::is_same_v<T, std::int64_t>) {
    return in_bounds(static_cast<double>(field), bounds);
  } else {
    return true;  // bool, WarmupType: any value of the type
  }
}

// Reads one present (not null, not "auto") JSON value into a field of its
// type; false when the value is not of that type.
bool read_value(const json& value, double& out) {
  if (!value.is_number()) return false;
  out = value.get<double>();
  return true;
}
bool read_value(const json& value, std::int64_t& out) {
  if (!value.is_number_integer()) return false;
  if (value.is_number_unsigned() &&
      value.get<std::uint64_t>() >
          static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    return false;
  out = value.get<std::int64_t>();
  return true;
}
bool read_value(const json& value, bool& out) {
  if (!value.is_boolean()) return false;
  out = value.get<bool>();
  return true;
}
bool read_value(const json& value, WarmupType& out) {
  if (value == "log") {
    out = WarmupType::log;
  } else if (value == "linear") {
    out = WarmupType::linear;
  } else {
    return false;
  }
  return true;
}
bool read_value(const json& value, PerGroup& out) {
  if (value.is_number()) {
    out = PerGroup(value.get<double>());
    return true;
  }
  if (!value.is_array() || value.empty()) return false;
  std::vector<double> values;
  for (const auto& v : value) {
    if (!v.is_number()) return false;
    values.push_back(v.get<double>());
  }
  out = PerGroup(std::move(values), true);
  return true;
}
template <class T>
bool read_value(const json& value, std::optional<T>& out) {
  T typed{};
  if (!read_value(value, typed)) return false;
  out = std::move(typed);
  return true;
}

// The parameters of a type, for messages: "warmup_min_lr, warmup_max_lr, ...".
std::string parameter_list(const DeepSpeedScheduleSpec& spec) {
  std::string out;
  all_fields(spec, [&](const char* key, const auto&, const Bounds&, bool) {
    out += out.empty() ? key : fmt::format(", {}", key);
  });
  return out;
}

std::string valid_types() {
  std::string out;
  for (const char* const* name = kDeepSpeedScheduleNames; *name; ++name)
    out += fmt::format("{}\"{}\"", out.empty() ? "" : ", ", *name);
  return out;
}

DeepSpeedScheduleParams default_params(DeepSpeedScheduleType type) {
  switch (type) {
    case DeepSpeedScheduleType::warmup_lr:
      return WarmupLrSpec{};
    case DeepSpeedScheduleType::warmup_decay_lr:
      return WarmupDecayLrSpec{};
    case DeepSpeedScheduleType::warmup_cosine_lr:
      return WarmupCosineLrSpec{};
    case DeepSpeedScheduleType::one_cycle:
      return OneCycleSpec{};
    case DeepSpeedScheduleType::lr_range_test:
      break;
  }
  return LrRangeTestSpec{};
}

// The values of a PerGroup, one per param group.
std::vector<double> expand(const PerGroup& value, std::size_t groups, const char* key) {
  if (!value.list) return std::vector<double>(groups, value.values.at(0));
  if (value.values.size() != groups)
    throw Error(
        ErrorKind::invalid_argument,
        fmt::format("{} = {} has {} values, but the optimizer has {} param groups; "
                    "valid: one number for every group, or a list of {}",
                    key, json_excerpt(to_json(value)), value.values.size(), groups, groups));
  return value.values;
}

// Python's float `a % b` (the result takes the sign of b), as OneCycle's
// stairs compute it.
double python_mod(double a, double b) {
  double mod = std::fmod(a, b);
  if (mod != 0.0) {
    if ((b < 0) != (mod < 0)) mod += b;
  } else {
    mod = std::copysign(0.0, b);
  }
  return mod;
}

// DeepSpeed's warm-up length: at least 2 steps (log(1) would divide by 0).
std::int64_t warmup_steps(std::int64_t warmup_num_steps) {
  return std::max<std::int64_t>(2, warmup_num_steps);
}

// The warm-up's fraction at `step` (0 <= step < warmup steps `n`).
double warmup_gamma(WarmupType type, std::int64_t n, std::int64_t step) {
  if (type == WarmupType::log)
    return (1.0 / std::log(static_cast<double>(n))) * std::log(static_cast<double>(step + 1));
  return static_cast<double>(step) / static_cast<double>(n);
}

}  // namespace

const char* to_string(DeepSpeedScheduleType type) {
  return kDeepSpeedScheduleNames[static_cast<int>(type)];
}

std::optional<DeepSpeedScheduleType> deepspeed_schedule_type(std::string_view name) {
  for (int i = 0; kDeepSpeedScheduleNames[i]; ++i)
    if (name == kDeepSpeedScheduleNames[i]) return static_cast<DeepSpeedScheduleType>(i);
  return std::nullopt;
}

std::optional<DeepSpeedScheduleSpec> read_deepspeed_schedule(const json& type, const json* params,
                                                             const std::string& type_key,
                                                             const std::string& key_prefix,
                                                             const ScheduleReport& report) {
  const std::optional<DeepSpeedScheduleType> kind =
      type.is_string() ? deepspeed_schedule_type(type.get_ref<const std::string&>()) : std::nullopt;
  if (!kind) {
    report.problem(type_key, type.is_null() ? fmt::format("is missing; valid: {}", valid_types())
                                            : fmt::format("= {}; valid: {}", json_excerpt(type),
                                                          valid_types()));
    return std::nullopt;
  }
  DeepSpeedScheduleSpec spec{default_params(*kind)};
  static const json kNone = json::object();
  if (params == nullptr || params->is_null()) params = &kNone;
  if (!params->is_object()) {
    const std::string where =
        key_prefix.empty() ? "params" : key_prefix.substr(0, key_prefix.size() - 1);
    report.problem(where, fmt::format("must be an object, got {}", json_excerpt(*params)));
    return std::nullopt;
  }
  bool ok = true;
  std::set<std::string, std::less<>> known;
  all_fields(spec, [&](const char* key, auto& field, const Bounds& bounds, bool required) {
    known.insert(key);
    auto it = params->find(key);
    const bool present = it != params->end() && !(it->is_string() && *it == "auto");
    if (present && it->is_null()) {
      // DeepSpeed's None: an optional's own "not given" value.
      if constexpr (is_optional<std::remove_reference_t<decltype(field)>>::value) {
        field.reset();
        return;
      }
    }
    if (!present || it->is_null()) {
      if (required) {
        report.problem(key_prefix + key,
                       fmt::format("is missing; {} needs it: {}", to_string(*kind), bounds.valid));
        ok = false;
      }
      return;
    }
    // The value as written in the message, typed or out of bounds.
    if (!read_value(*it, field) || !in_bounds(field, bounds)) {
      report.problem(key_prefix + key,
                     fmt::format("= {}; valid: {}", json_excerpt(*it), bounds.valid));
      ok = false;
    }
  });
  for (auto it = params->begin(); it != params->end(); ++it)
    if (!known.count(it.key()))
      report.unknown(key_prefix + it.key(),
                     fmt::format("{} has no such parameter (its parameters: {})", to_string(*kind),
                                 parameter_list(spec)));
  if (!ok) return std::nullopt;
  return spec;
}

DeepSpeedScheduleSpec deepspeed_schedule_spec(std::string_view type, const json& params,
                                              const std::string& key_prefix) {
  std::vector<std::string> problems;
  ScheduleReport report{[&](const std::string& key, const std::string& what) {
                          problems.push_back(fmt::format("{} {}", key, what));
                        },
                        [&](const std::string& key, const std::string& why) {
                          problems.push_back(fmt::format("{}: {}", key, why));
                        }};
  auto spec = read_deepspeed_schedule(json(std::string(type)), &params, key_prefix + "type",
                                      key_prefix, report);
  if (!problems.empty() || !spec)
    throw Error(ErrorKind::invalid_argument, fmt::format("{}", fmt::join(problems, "\n")));
  return *spec;
}

void check_deepspeed_schedule(const DeepSpeedScheduleSpec& spec) {
  all_fields(spec, [&](const char* key, const auto& field, const Bounds& bounds, bool) {
    if (!in_bounds(field, bounds))
      throw Error(
          ErrorKind::invalid_argument,
          fmt::format("{} = {}; valid: {}", key, json_excerpt(to_json(field)), bounds.valid));
  });
}

json deepspeed_schedule_params(const DeepSpeedScheduleSpec& spec) {
  json out = json::object();
  all_fields(spec, [&](const char* key, const auto& field, const Bounds&, bool) {
    out[key] = to_json(field);
  });
  return out;
}

DeepSpeedSchedule::DeepSpeedSchedule(DeepSpeedScheduleSpec spec, std::vector<double> group_lrs,
                                     bool optimizer_has_betas)
    : spec_(std::move(spec)), group_lrs_(std::move(group_lrs)) {
  check_deepspeed_schedule(spec_);
  if (group_lrs_.empty())
    throw Error(ErrorKind::invalid_argument,
                "the optimizer has no param groups; valid: at least one");
  const std::size_t n = group_lrs_.size();
  std::visit(
      [&](const auto& p) {
        using Plain = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<Plain, WarmupLrSpec> ||
                      std::is_same_v<Plain, WarmupDecayLrSpec>) {
          low_lrs_ = expand(p.warmup_min_lr, n, "warmup_min_lr");
          high_lrs_ = p.warmup_max_lr ? expand(*p.warmup_max_lr, n, "warmup_max_lr") : group_lrs_;
        } else if constexpr (std::is_same_v<Plain, OneCycleSpec>) {
          low_lrs_ = expand(p.cycle_min_lr, n, "cycle_min_lr");
          high_lrs_ = expand(p.cycle_max_lr, n, "cycle_max_lr");
          cycles_momentum_ = p.cycle_momentum && optimizer_has_betas;
          if (cycles_momentum_) {
            low_moms_ = expand(p.cycle_min_mom, n, "cycle_min_mom");
            high_moms_ = expand(p.cycle_max_mom, n, "cycle_max_mom");
          }
        } else if constexpr (std::is_same_v<Plain, LrRangeTestSpec>) {
          low_lrs_ = expand(p.lr_range_test_min_lr, n, "lr_range_test_min_lr");
        }
      },
      spec_.params);
}

namespace {

// OneCycle's cycle: the fraction of the way from the low to the high end at
// `last_batch_iteration` (< the cycle's length).
double one_cycle_scale(const OneCycleSpec& p, std::int64_t last_batch_iteration) {
  const double first = p.cycle_first_step_size;
  const double second = p.cycle_second_step_size.value_or(first);
  const double total = first + second;
  const double step_ratio = first / total;
  const std::int64_t batch = last_batch_iteration + 1;
  const double position = static_cast<double>(batch) / total;
  const double cycle = std::floor(1 + position);
  const double x = 1. + position - cycle;
  double scale = 0;
  std::int64_t stairs = 0;
  if (x <= step_ratio) {
    scale = x / step_ratio;
    stairs = p.cycle_first_stair_count;
  } else {
    scale = (x - 1) / (step_ratio - 1);
    stairs = p.cycle_second_stair_count.value_or(p.cycle_first_stair_count);
  }
  if (stairs > 0) {
    // From the integer offset in the cycle, as DeepSpeed does, so that a
    // stair boundary is exact.
    const double in_cycle = python_mod(static_cast<double>(batch), total);
    const double stair = in_cycle <= first
                             ? in_cycle * static_cast<double>(stairs) / first
                             : (total - in_cycle) * static_cast<double>(stairs) / second;
    scale = std::floor(stair) / static_cast<double>(stairs);
  }
  return scale;
}

double one_cycle_length(const OneCycleSpec& p) {
  return p.cycle_first_step_size + p.cycle_second_step_size.value_or(p.cycle_first_step_size);
}

}  // namespace

std::vector<double> DeepSpeedSchedule::lrs(std::int64_t last_batch_iteration) const {
  const std::int64_t i = last_batch_iteration;
  const std::size_t n = group_lrs_.size();
  std::vector<double> out(n);
  auto warmup_rates = [&](const auto& p, auto after_warmup) {
    if (i < 0) return low_lrs_;
    const std::int64_t steps = warmup_steps(p.warmup_num_steps);
    const double gamma = i < steps ? warmup_gamma(p.warmup_type, steps, i) : after_warmup(steps);
    for (std::size_t g = 0; g < n; ++g) out[g] = low_lrs_[g] + (high_lrs_[g] - low_lrs_[g]) * gamma;
    return out;
  };
  return std::visit(
      [&](const auto& p) -> std::vector<double> {
        using Plain = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<Plain, WarmupLrSpec>) {
          return warmup_rates(p, [](std::int64_t) { return 1.0; });
        } else if constexpr (std::is_same_v<Plain, WarmupDecayLrSpec>) {
          return warmup_rates(p, [&](std::int64_t steps) {
            return std::max(0.0, static_cast<double>(p.total_num_steps - i) /
                                     std::max(1.0, static_cast<double>(p.total_num_steps - steps)));
          });
        } else if constexpr (std::is_same_v<Plain, WarmupCosineLrSpec>) {
          if (i < 0) return std::vector<double>(n, 0.0);
          const std::int64_t steps = warmup_steps(p.warmup_num_steps);
          double ratio = 0;
          if (i < steps) {
            ratio = p.warmup_min_ratio +
                    warmup_gamma(p.warmup_type, steps, i) * (1. - p.warmup_min_ratio);
          } else {
            const std::int64_t done = i - steps + 1;
            const std::int64_t decay_steps = std::max<std::int64_t>(1, p.total_num_steps - steps);
            const double progress =
                std::min(1.0, static_cast<double>(done) / static_cast<double>(decay_steps));
            const double cosine = (1 + std::cos(std::numbers::pi * progress)) / 2;
            ratio = std::max(0.0, p.cos_min_ratio + (1. - p.cos_min_ratio) * cosine);
          }
          for (std::size_t g = 0; g < n; ++g) out[g] = group_lrs_[g] * ratio;
          return out;
        } else if constexpr (std::is_same_v<Plain, OneCycleSpec>) {
          const double length = one_cycle_length(p);
          if (static_cast<double>(i) < length) {
            const double scale = one_cycle_scale(p, i);
            for (std::size_t g = 0; g < n; ++g)
              out[g] = low_lrs_[g] + (high_lrs_[g] - low_lrs_[g]) * scale;
            return out;
          }
          if (p.decay_step_size == 0 || p.decay_lr_rate == 0) return low_lrs_;
          const double decay_batch = static_cast<double>(i) - length + 1;
          const double factor = 1 + p.decay_lr_rate * (decay_batch / p.decay_step_size);
          for (std::size_t g = 0; g < n; ++g) out[g] = low_lrs_[g] / factor;
          return out;
        } else {
          const double steps =
              static_cast<double>(i + 1) / static_cast<double>(p.lr_range_test_step_size);
          const double interval = p.lr_range_test_staircase ? std::floor(steps) : steps;
          const double increase = 1 + p.lr_range_test_step_rate * interval;
          for (std::size_t g = 0; g < n; ++g) out[g] = low_lrs_[g] * increase;
          return out;
        }
      },
      spec_.params);
}

std::vector<double> DeepSpeedSchedule::betas(std::int64_t last_batch_iteration) const {
  if (!cycles_momentum_) return {};
  const auto& p = std::get<OneCycleSpec>(spec_.params);
  const std::size_t n = group_lrs_.size();
  std::vector<double> out(n);
  const double length = one_cycle_length(p);
  if (static_cast<double>(last_batch_iteration) < length) {
    const double scale = one_cycle_scale(p, last_batch_iteration);
    for (std::size_t g = 0; g < n; ++g)
      out[g] = high_moms_[g] - (high_moms_[g] - low_moms_[g]) * scale;
    return out;
  }
  if (p.decay_step_size == 0 || p.decay_mom_rate == 0) return high_moms_;
  const double decay_batch = static_cast<double>(last_batch_iteration) - length + 1;
  const double factor = 1 + p.decay_mom_rate * (decay_batch / p.decay_step_size);
  for (std::size_t g = 0; g < n; ++g) out[g] = high_moms_[g] * factor;
  return out;
}

std::vector<double> DeepSpeedSchedule::initial_lrs() const {
  // DeepSpeed sets the rates of index -1, except that OneCycle and
  // LRRangeTest set their low rates directly (the same values).
  if (spec_.type() == DeepSpeedScheduleType::one_cycle ||
      spec_.type() == DeepSpeedScheduleType::lr_range_test)
    return low_lrs_;
  return lrs(-1);
}

std::vector<double> DeepSpeedSchedule::initial_betas() const {
  return low_moms_;
}

}  // namespace ductile::pipeline
