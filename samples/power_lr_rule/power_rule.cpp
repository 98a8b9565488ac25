// lr x k^exponent with k = batch_size / base_batch_size: the family that
// contains the built-in rules (exponent 1 is "linear", 0.5 is "sqrt", 0 is
// "none"), for jobs tuned with another exponent.
#include <cmath>

#include <ductile/lr_scaling_rule.hpp>

namespace {

class PowerRule final : public ductile::LrScalingRule {
 public:
  explicit PowerRule(const ductile::HostContext& context)
      : exponent_(context.params().get_double("exponent")) {
    context.logger()->debug("power rule with exponent {}", exponent_);
  }

  double scale(double lr, double batch_size, double base_batch_size) const override {
    ductile::check_lr_scaling_arguments(lr, batch_size, base_batch_size);
    return lr * std::pow(batch_size / base_batch_size, exponent_);
  }

 private:
  double exponent_;
};

constexpr ductile::ParamSpec kSchema[] = {
    {.key = "exponent",
     .type = ductile::ParamType::floating,
     .flags = ductile::param_has_min | ductile::param_has_max,
     .default_value = "0.5",
     .max_value = 2.0,
     .doc = "p in lr x (batch / base_batch)^p"},
};

}  // namespace

DUCTILE_PLUGIN(PowerRule, "power", "1.0.0", "Learning rate scaled by (batch / base)^exponent",
               kSchema)
