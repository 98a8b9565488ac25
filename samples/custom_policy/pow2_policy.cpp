// "pow2": an elasticity policy where only power-of-two GPU counts are valid.
// Built out of tree against the installed SDK (see README.md).
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "ductile/elasticity_policy.hpp"

namespace {

// clang-format off
constexpr ductile::ParamSpec kSchema[] = {
    {.key = "max_train_batch_size", .type = ductile::ParamType::integer, .flags = ductile::param_required | ductile::param_has_min, .min_value = 1, .doc = "Largest acceptable global batch size"},
    {.key = "micro_batch_size", .type = ductile::ParamType::integer, .flags = ductile::param_has_min, .default_value = "1", .min_value = 1, .doc = "Micro batch size per GPU"},
    {.key = "min_gpus", .type = ductile::ParamType::integer, .flags = ductile::param_has_min, .default_value = "1", .min_value = 1, .doc = "Fewest GPUs"},
    {.key = "max_gpus", .type = ductile::ParamType::integer, .flags = ductile::param_has_min, .default_value = "1024", .min_value = 1, .doc = "Most GPUs"},
};
// clang-format on

class PowerOfTwoPolicy final : public ductile::ElasticityPolicy {
 public:
  explicit PowerOfTwoPolicy(const ductile::HostContext& ctx)
      : cap_(ctx.params().get_int("max_train_batch_size")),
        micro_(ctx.params().get_int("micro_batch_size")),
        min_gpus_(ctx.params().get_int("min_gpus")),
        max_gpus_(ctx.params().get_int("max_gpus")) {}

  // The validate hook: `ductile config check` reports these, at the key named.
  static void validate(const ductile::Params& params, std::string_view) {
    check(params.get_int("max_train_batch_size"), params.get_int("micro_batch_size"),
          params.get_int("min_gpus"), params.get_int("max_gpus"));
  }

  ductile::ElasticityResult compute(const ductile::ElasticityRequest& request) const override {
    check(cap_, micro_, min_gpus_, max_gpus_);
    // The largest power of two within max_gpus whose micro batches fit the cap.
    std::int64_t largest = 0;
    for (std::int64_t g = 1; g <= max_gpus_ && g <= cap_ / micro_; g *= 2) largest = g;
    if (largest < min_gpus_)
      fail_config(
          fmt::format("no power-of-two GPU count between min_gpus = {} and max_gpus = {} "
                      "fits micro_batch_size = {} within max_train_batch_size = {}",
                      min_gpus_, max_gpus_, micro_, cap_));
    ductile::ElasticityResult r;
    r.final_batch_size = cap_ / (micro_ * largest) * micro_ * largest;
    for (std::int64_t g = 1; g <= largest; g *= 2)
      if (g >= min_gpus_) r.valid_gpus.push_back(g);
    r.valid_dp_sizes = r.valid_gpus;
    if (request.require_micro_batch && request.world_size == 0)
      throw ductile::Error(ductile::ErrorKind::invalid_argument,
                           "pow2: a micro batch size needs a world size",
                           ductile::kElasticityError);
    if (request.world_size != 0) {
      const auto n = request.world_size;
      if (n < 0 || (n & (n - 1)) != 0 || n < min_gpus_ || n > largest)
        throw ductile::Error(ductile::ErrorKind::incompatible,
                             fmt::format("pow2: world size {} is not a power of two in [{}, {}]", n,
                                         min_gpus_, largest),
                             ductile::kElasticityIncompatibleWorldSize);
      r.world_size = r.data_parallel_size = n;
      r.micro_batch_size = micro_;
      r.gradient_accumulation_steps = r.final_batch_size / (micro_ * n);
    }
    return r;
  }

 private:
  static void check(std::int64_t cap, std::int64_t micro, std::int64_t min_gpus,
                    std::int64_t max_gpus) {
    if (min_gpus > max_gpus)
      throw ductile::ParamError(
          ductile::ErrorKind::config, "min_gpus",
          fmt::format("pow2: min_gpus = {} is greater than max_gpus = {}", min_gpus, max_gpus),
          ductile::kElasticityConfigError);
    if (micro > cap)
      throw ductile::ParamError(
          ductile::ErrorKind::config, "micro_batch_size",
          fmt::format("pow2: micro_batch_size = {} is above max_train_batch_size = {}", micro, cap),
          ductile::kElasticityConfigError);
  }

  [[noreturn]] static void fail_config(const std::string& message) {
    throw ductile::Error(ductile::ErrorKind::config, "pow2: " + message,
                         ductile::kElasticityConfigError);
  }

  std::int64_t cap_, micro_, min_gpus_, max_gpus_;
};

}  // namespace

DUCTILE_PLUGIN(PowerOfTwoPolicy, "pow2", "1.0.0", "Only power-of-two GPU counts are valid", kSchema)
