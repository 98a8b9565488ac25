// Fuzz target: a DeepSpeed JSON config's elasticity block, mapped to a
// policy (elasticity_from_deepspeed_json) and computed by the real plugin
// (v0.1, v0.2, optimal) for three world sizes: none, a small one taken from
// the input's last byte, and one above 2^40.
#include <cstdint>

#include "ductile/core/runtime.hpp"
#include "ductile/elasticity_policy.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "fuzz_support.hpp"

namespace elasticity_api = ductile::pipeline;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::quiet_logging();
  static auto runtime = ductile::core::Runtime::from_string("", "fuzz");
  const auto text = fuzz::as_text(data, size);
  const std::int64_t small_world = size ? 1 + data[size - 1] % 128 : 1;
  fuzz::expect_clean([&] {
    auto source = elasticity_api::elasticity_from_deepspeed_json(text, "fuzz.json");
    auto policy = runtime.create<ductile::ElasticityPolicy>(source.policy, source.params);
    for (std::int64_t world : {std::int64_t{0}, small_world, (std::int64_t{1} << 40) + small_world})
      fuzz::expect_clean([&] {
        auto r = policy->compute(ductile::ElasticityRequest{world, world != 0});
        if (world != 0 && r.micro_batch_size && r.gradient_accumulation_steps &&
            r.data_parallel_size &&
            *r.micro_batch_size * *r.gradient_accumulation_steps * *r.data_parallel_size !=
                r.final_batch_size)
          __builtin_trap();  // the plan must add up
      });
  });
  return 0;
}
