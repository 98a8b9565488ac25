// Learning-rate scaling rule "none": the learning rate unchanged whatever the batch size.
#include <cmath>

#include "ductile/lr_scaling_rule.hpp"

namespace {

class NoScaling final : public ductile::LrScalingRule {
 public:
  explicit NoScaling(const ductile::HostContext&) {}

  double scale(double lr, double batch_size, double base_batch_size) const override {
    ductile::check_lr_scaling_arguments(lr, batch_size, base_batch_size);
    return lr;
  }
};

}  // namespace

DUCTILE_PLUGIN_NO_PARAMS(NoScaling, "none", "1.0.0",
                         "the learning rate unchanged whatever the batch size")
