// Fuzz target: a worker's TORCHELASTIC_ERROR_FILE as the agent reads it
// after the worker failed (worker_error_from_json). Bad input may only raise
// MalformedRecord; what it returns fits a failure report.
#include <cstdint>

#include "ductile/agent/records.hpp"
#include "fuzz_support.hpp"

namespace agent = ductile::agent;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_only<agent::MalformedRecord>([&] {
    agent::WorkerError error = agent::worker_error_from_json(text);
    if (error.message.size() > agent::kMaxTextChars ||
        error.traceback.size() > agent::kMaxTracebackChars)
      __builtin_trap();
    agent::FailureReport report{"n", 0, 0, 1, {}, error.message, error.traceback};
    if (agent::failure_from_json(agent::to_json(report)).error_traceback != error.traceback)
      __builtin_trap();
  });
  return 0;
}
