// Learning-rate scaling rule "linear": lr x k with k = batch size / base batch size (Goyal et al.).
#include <cmath>

#include "ductile/lr_scaling_rule.hpp"

namespace {

class LinearRule final : public ductile::LrScalingRule {
 public:
  explicit LinearRule(const ductile::HostContext&) {}

  double scale(double lr, double batch_size, double base_batch_size) const override {
    ductile::check_lr_scaling_arguments(lr, batch_size, base_batch_size);
    // Same operation order as DeepSpeed (lr * bs / base), so values match bit for bit.
    return lr * batch_size / base_batch_size;
  }
};

}  // namespace

DUCTILE_PLUGIN_NO_PARAMS(LinearRule, "linear", "1.0.0",
                         "lr x k with k = batch size / base batch size (Goyal et al.)")
