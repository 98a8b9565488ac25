// Fuzz target: a DeepSpeed JSON config's dynamic batching block, mapped to
// the greedy sampler's parameters (parse_deepspeed_batching) and, when it
// maps, the sampler created with them and run on a fixed set of lengths.
#include <cstdint>
#include <vector>

#include "ductile/batch_sampler.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/deepspeed_batching.hpp"
#include "fuzz_support.hpp"

namespace batching_api = ductile::pipeline;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::quiet_logging();
  static auto runtime = ductile::core::Runtime::from_string("", "fuzz");
  static const std::vector<std::int64_t> lengths = [] {
    std::vector<std::int64_t> v;
    for (std::int64_t i = 0; i < 200; ++i) v.push_back(1 + (i * 37) % 300);
    return v;
  }();
  fuzz::expect_clean([&] {
    auto mapped = batching_api::parse_deepspeed_batching(fuzz::as_text(data, size), "fuzz.json",
                                                         "/fuzz-base");
    const auto& options = mapped.setup.options;
    auto sampler = runtime.create<ductile::BatchSampler>(options.sampler, options.sampler_params);
    auto result = sampler->pack({lengths, std::nullopt});
    if (result.microbatch_offsets.back() != result.sample_ids.size()) __builtin_trap();
  });
  return 0;
}
