// Learning-rate scaling rule "sqrt": lr x sqrt(k) with k = batch size / base batch size
// (Krizhevsky).
#include <cmath>

#include "ductile/lr_scaling_rule.hpp"

namespace {

class SqrtRule final : public ductile::LrScalingRule {
 public:
  explicit SqrtRule(const ductile::HostContext&) {}

  double scale(double lr, double batch_size, double base_batch_size) const override {
    ductile::check_lr_scaling_arguments(lr, batch_size, base_batch_size);
    return lr * std::sqrt(batch_size / base_batch_size);
  }
};

}  // namespace

DUCTILE_PLUGIN_NO_PARAMS(SqrtRule, "sqrt", "1.0.0",
                         "lr x sqrt(k) with k = batch size / base batch size (Krizhevsky)")
