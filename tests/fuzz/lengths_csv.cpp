// Fuzz target: the CSV lengths reader, one sample a row or histogram mode.
// The first byte picks the options (bit 0: column "length" named; bit 1:
// histogram with count column "count"); the rest is the file.
#include <cstdint>

#include "ductile/pipeline/lengths.hpp"
#include "fuzz_support.hpp"

namespace lengths_api = ductile::pipeline;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::quiet_logging();
  if (size == 0) return 0;
  lengths_api::LengthReadOptions options;
  if (data[0] & 1) options.column = "length";
  if (data[0] & 2) options.count_column = "count";
  // Histograms of up to 2^30 samples (the default) are valid input that
  // needs 8 GiB; under libFuzzer's 2 GiB limit the cap is what is tested.
  options.max_histogram_samples = std::int64_t{1} << 24;
  const auto file = fuzz::write_file("lengths.csv", fuzz::as_text(data + 1, size - 1));
  fuzz::expect_clean([&] {
    // A histogram row may stand for very many samples: more than the cap
    // must be refused with an Error, not end in bad_alloc or libFuzzer's
    // malloc limit.
    auto lengths = lengths_api::read_lengths(file, options);
    if (lengths.empty()) __builtin_trap();
    for (auto v : lengths)
      if (v < 1) __builtin_trap();
  });
  return 0;
}
