// The plugin class of every built-in elasticity policy: each policy's folder
// instantiates this template over its own search function and checks, so the
// policies differ only in the algorithm they run.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "ductile/elasticity_policy.hpp"
#include "elastic_settings.hpp"
#include "plan.hpp"

namespace ductile::elastic {

template <ElasticityResult (*Compute)(const Settings&, const ElasticityRequest&), auto Check>
class PolicyPlugin final : public ElasticityPolicy {
 public:
  // compute() runs every check again, so that the embedding API reports the
  // same typed errors (ElasticityConfigError) when nothing validated first.
  explicit PolicyPlugin(const HostContext& ctx)
      : name_(ctx.plugin_name()), params_(ctx.params()), logger_(ctx.logger()) {}

  // The validate hook (see DUCTILE_PLUGIN): DeepSpeed's configuration checks
  // and the policy's own, on the parameters alone.
  static void validate(const Params& params, std::string_view name) {
    Check(read_settings(params, name));
  }

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
