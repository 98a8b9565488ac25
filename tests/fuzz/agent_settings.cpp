// Fuzz target: a job's settings record as read from etcd, compared with an
// agent's own (settings_differences). Bad input may only raise
// MalformedRecord; the differences quote excerpts, never whole values.
#include <cstdint>

#include "ductile/agent/records.hpp"
#include "fuzz_support.hpp"

namespace agent = ductile::agent;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::string mine =
      R"({"mpi_world":false,"nproc_per_node":2,"params":{"max_gpus":6,"max_train_batch_size":24,)"
      R"("micro_batch_sizes":[1,2,3],"min_gpus":1,"prefer_larger_batch":true},"policy":"v0.1"})";
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_only<agent::MalformedRecord>([&] {
    for (const auto& line : agent::settings_differences(text, mine))
      if (line.size() > 600) __builtin_trap();
  });
  return 0;
}
