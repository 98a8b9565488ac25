// The "v0.2" elasticity policy: a thin wrapper over the shared implementation
// in plugins/elasticity/common (see elastic_policies.hpp).
#include "ductile/elasticity_policy.hpp"
#include "elastic_policies.hpp"
#include "elastic_settings.hpp"

namespace {

class DeepSpeedV02Policy final : public ductile::ElasticityPolicy {
 public:
  // Parameters are only checked by compute(), so that a bad value is reported
  // as an ElasticityConfigError (a factory failure would lose the type).
  explicit DeepSpeedV02Policy(const ductile::HostContext& ctx)
      : params_(ctx.params()), logger_(ctx.logger()) {}

  ductile::ElasticityResult compute(const ductile::ElasticityRequest& request) const override {
    auto settings = ductile::elastic::read_settings(params_, "v0.2");
    auto result = ductile::elastic::compute_v02(settings, request);
    for (const auto& warning : result.warnings) logger_->warn("{}", warning);
    return result;
  }

 private:
  ductile::Params params_;
  std::shared_ptr<spdlog::logger> logger_;
};

}  // namespace

DUCTILE_PLUGIN(DeepSpeedV02Policy, "v0.2", "1.0.0",
               "DeepSpeed elasticity v0.2: node-aware, model-parallel aware, reported fallback",
               ductile::elastic::kElasticitySchema)
