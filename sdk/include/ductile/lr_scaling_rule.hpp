// The LrScalingRule interface (plugin kind PluginKind::lr): how the learning
// rate follows the batch size when batches vary in size (dynamic batching).
//
// With k = batch_size / base_batch_size, a rule maps a learning rate tuned
// for base_batch_size to the one for batch_size: "linear" gives lr x k
// (Goyal et al.), "sqrt" gives lr x sqrt(k) (Krizhevsky), "none" gives lr.
// The core's variable-batch schedule (core/lr_schedule.hpp) applies a rule
// to every step of a base schedule.
//
// Ownership: nothing is retained between calls.
// Threading: rules are stateless after creation; scale() may be called
// concurrently from any thread.
#pragma once

#include <cmath>
#include <string>

#include "ductile/plugin.hpp"

namespace ductile {

class DUCTILE_SDK_API LrScalingRule : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::lr;

  // The learning rate for a step of `batch_size` samples, given `lr` tuned
  // for `base_batch_size`. Throws Error(invalid_argument) naming the value
  // when base_batch_size <= 0, batch_size < 0, or a value is not finite.
  virtual double scale(double lr, double batch_size, double base_batch_size) const = 0;
};

// Shared argument check for rules. Throws Error(invalid_argument).
DUCTILE_SDK_API inline void check_lr_scaling_arguments(double lr, double batch_size,
                                                       double base_batch_size) {
  auto bad = [](const char* what, double v, const char* need) {
    return Error(ErrorKind::invalid_argument, std::string("learning-rate scaling: ") + what +
                                                  " = " + std::to_string(v) + " is invalid; need " +
                                                  need);
  };
  if (!std::isfinite(lr)) throw bad("lr", lr, "a finite number");
  if (!std::isfinite(base_batch_size) || base_batch_size <= 0.0)
    throw bad("base_batch_size", base_batch_size, "a finite number > 0");
  if (!std::isfinite(batch_size) || batch_size < 0.0)
    throw bad("batch_size", batch_size, "a finite number >= 0");
}

}  // namespace ductile
