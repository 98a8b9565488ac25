// The plugin class of every built-in elasticity policy: each policy's folder
// instantiates this template over its own search function and checks, so the
// policies differ only in the algorithm they run.
#pragma once

#include <memory>
#include <string_view>

#include "ductile/elasticity_policy.hpp"
#include "elastic_settings.hpp"
#include "plan.hpp"

namespace ductile::elastic {

template <ElasticityResult (*Compute)(const Settings&, const ElasticityRequest&), auto Check>
class PolicyPlugin final : public ElasticityPolicy {
 public:
  // The core creates a plugin only from parameters its validate hook
  // accepted: they are read once here, and every plan is computed from them.
  explicit PolicyPlugin(const HostContext& ctx)
      : settings_(read_settings(ctx.params(), ctx.plugin_name())), logger_(ctx.logger()) {}

  // The validate hook (see DUCTILE_PLUGIN): DeepSpeed's configuration checks
  // and the policy's own, on the parameters alone.
  static void validate(const Params& params, std::string_view name) {
    Check(read_settings(params, name));
  }

  ElasticityResult compute(const ElasticityRequest& request) const override {
    auto result = Compute(settings_, request);
    for (const auto& warning : result.warnings) logger_->warn("{}", warning);
    return result;
  }

 private:
  Settings settings_;
  std::shared_ptr<spdlog::logger> logger_;
};

}  // namespace ductile::elastic
