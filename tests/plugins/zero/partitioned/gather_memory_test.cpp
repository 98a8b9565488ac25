// The partitioned coordinator's pool of gathered copies (gather_memory()) on
// the real cpu backend under mpirun with 1 and 2 ranks: copies reuse the
// pool's buffers once the trace runs, and on the host an idle buffer holds
// no resident page once its pass has issued its last gather.
#include <cstdint>
#include <vector>

#include "residency.hpp"
#include "zero_support.hpp"

using namespace zero_test;

TEST_CASE("on the host, idle gathered copies give their pages back once a pass gathered all") {
  auto& e = env();
  ZeroConfig config;
  config.prefetch_bucket_size = 0;  // each module gathers at its fetch
  config.max_reuse_distance = 0;    // and is freed at its release
  auto zero = make_coordinator(config);
  // Three modules of one parameter each, of distinct sizes (each its own
  // buffer in the pool), many pages each.
  const std::vector<std::size_t> sizes = {96 * 1024, 160 * 1024, 224 * 1024};
  for (ParameterId p = 0; p < sizes.size(); ++p) {
    register_f32(*zero, p, sizes[p]);
    zero->register_module(p, std::vector<ParameterId>{p});
  }
  auto bytes_of = [&](ParameterId p) { return zero->shard_numel(p) * 4 * e.size; };
  auto pass = [&] {
    for (ModuleId m = 0; m < sizes.size(); ++m) {
      zero->fetch(m);
      zero->release(m);
    }
    zero->end_step();
  };
  pass();  // records the trace
  pass();  // runs it: the pool now holds a buffer of each size
  const auto allocations = zero->gather_memory().allocations;

  std::vector<void*> copies(sizes.size());
  for (ModuleId m = 0; m < sizes.size(); ++m) {
    zero->fetch(m);
    copies[m] = zero->full_data(m);
    CHECK(gathered_matches(*zero, m, sizes[m] * 4, 0));
    const Residency used = residency(copies[m], bytes_of(m));
    REQUIRE(used.pages > 16);
    CHECK(used.resident == used.pages);
    zero->release(m);
    if (m + 1 < sizes.size()) {
      // Gathers of this pass are still to come: the idle copies keep their pages.
      for (ModuleId k = 0; k <= m; ++k) {
        const Residency idle = residency(copies[k], bytes_of(k));
        CHECK(idle.resident == idle.pages);
      }
    }
  }
  // The pass has gathered all it will: every idle copy gave its pages back,
  // and kept its buffer (nothing was freed or allocated).
  for (ModuleId m = 0; m < sizes.size(); ++m)
    CHECK(residency(copies[m], bytes_of(m)).resident == 0);
  CHECK(zero->gather_memory().idle_bytes == bytes_of(0) + bytes_of(1) + bytes_of(2));
  zero->end_step();

  // The next pass gathers into the same buffers, whole and right.
  for (ModuleId m = 0; m < sizes.size(); ++m) {
    zero->fetch(m);
    CHECK(zero->full_data(m) == copies[m]);
    CHECK(gathered_matches(*zero, m, sizes[m] * 4, 0));
    const Residency used = residency(copies[m], bytes_of(m));
    CHECK(used.resident == used.pages);
    zero->release(m);
  }
  zero->end_step();
  CHECK(zero->gather_memory().allocations == allocations);
  zero->check_invariants();
}
