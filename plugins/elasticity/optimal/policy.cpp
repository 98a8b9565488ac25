// The "optimal" elasticity policy: a thin wrapper over the shared implementation
// in plugins/elasticity/common (see elastic_policies.hpp).
#include "ductile/elasticity_policy.hpp"
#include "elastic_policies.hpp"
#include "elastic_settings.hpp"

namespace {

class OptimalPolicy final : public ductile::ElasticityPolicy {
 public:
  // Parameters are only checked by compute(), so that a bad value is reported
  // as an ElasticityConfigError (a factory failure would lose the type).
  explicit OptimalPolicy(const ductile::HostContext& ctx)
      : params_(ctx.params()), logger_(ctx.logger()) {}

  ductile::ElasticityResult compute(const ductile::ElasticityRequest& request) const override {
    auto settings = ductile::elastic::read_settings(params_, "optimal");
    auto result = ductile::elastic::compute_optimal(settings, request);
    for (const auto& warning : result.warnings) logger_->warn("{}", warning);
    return result;
  }

 private:
  ductile::Params params_;
  std::shared_ptr<spdlog::logger> logger_;
};

}  // namespace

DUCTILE_PLUGIN(OptimalPolicy, "optimal", "1.0.0",
               "Every batch size up to the cap: the most valid GPU counts, never fewer than v0.1",
               ductile::elastic::kElasticitySchema)
