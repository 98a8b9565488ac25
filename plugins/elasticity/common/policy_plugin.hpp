// The plugin class of every elasticity policy. The v0.1, v0.2 and optimal
// libraries are this template over their search function, so they differ
// only in the algorithm they run.
#pragma once

#include <memory>
#include <string>

#include "ductile/elasticity_policy.hpp"
#include "elastic_policies.hpp"
#include "elastic_settings.hpp"

namespace ductile::elastic {

template <ElasticityResult (*Compute)(const Settings&, const ElasticityRequest&)>
class PolicyPlugin final : public ElasticityPolicy {
 public:
  // Parameters are only checked by compute(), so that a bad value is reported
  // as an ElasticityConfigError (a factory failure would lose the type).
  explicit PolicyPlugin(const HostContext& ctx)
      : name_(ctx.plugin_name()), params_(ctx.params()), logger_(ctx.logger()) {}

  ElasticityResult compute(const ElasticityRequest& request) const override {
    auto settings = read_settings(params_, name_);
    auto result = Compute(settings, request);
    for (const auto& warning : result.warnings) logger_->warn("{}", warning);
    return result;
  }

 private:
  std::string name_;
  Params params_;
  std::shared_ptr<spdlog::logger> logger_;
};

}  // namespace ductile::elastic
