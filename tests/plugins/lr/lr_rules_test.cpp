// The LR scaling rules: lr x k, lr x sqrt(k), lr, with k = batch / base batch.
#include <doctest/doctest.h>

#include <cmath>

#include "ductile/core/runtime.hpp"
#include "ductile/lr_scaling_rule.hpp"

namespace {
std::shared_ptr<ductile::LrScalingRule> rule(const std::string& name) {
  static ductile::core::Runtime rt = [] {
    ductile::core::RuntimeOptions options;
    options.extra_plugin_dirs.emplace_back(DUCTILE_PLUGIN_DIR);
    return ductile::core::Runtime::from_string("", "lr test", options);
  }();
  return rt.create<ductile::LrScalingRule>(name);
}
}  // namespace

TEST_CASE("linear: DeepSpeed's illustration, 30-token packs of 10 and 4 samples") {
  // Reference lr 1e-3 for batch 2: batches of 10 and 4 get 5e-3 and 2e-3.
  auto linear = rule("linear");
  CHECK(linear->scale(1e-3, 10, 2) == doctest::Approx(5e-3).epsilon(1e-15));
  CHECK(linear->scale(1e-3, 4, 2) == doctest::Approx(2e-3).epsilon(1e-15));
  // Same operation order as DeepSpeed's base_lr * batch_size / base_batch_size.
  CHECK(linear->scale(0.1, 3, 7) == 0.1 * 3 / 7);
  CHECK(linear->scale(0.5, 0, 7) == 0.0);
}

TEST_CASE("sqrt keeps the gradient variance: lr x sqrt(k)") {
  auto sqrt_rule = rule("sqrt");
  CHECK(sqrt_rule->scale(1e-3, 32, 8) == doctest::Approx(2e-3).epsilon(1e-15));
  CHECK(sqrt_rule->scale(0.2, 3, 5) == 0.2 * std::sqrt(3.0 / 5.0));
}

TEST_CASE("none leaves the learning rate as it is") {
  auto none = rule("none");
  CHECK(none->scale(3e-4, 1000, 8) == 3e-4);
  CHECK(none->scale(3e-4, 1, 8) == 3e-4);
}

TEST_CASE("bad arguments are refused by every rule, naming the value") {
  for (const char* name : {"linear", "sqrt", "none"}) {
    auto r = rule(name);
    INFO(name);
    CHECK_THROWS_WITH_AS(r->scale(1e-3, 4, 0), doctest::Contains("base_batch_size"),
                         ductile::Error);
    CHECK_THROWS_WITH_AS(r->scale(1e-3, -1, 8), doctest::Contains("batch_size = -1"),
                         ductile::Error);
    CHECK_THROWS_AS(r->scale(NAN, 4, 8), ductile::Error);
  }
}
