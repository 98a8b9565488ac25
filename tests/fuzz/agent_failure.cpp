// Fuzz target: a worker failure report as read from etcd
// (failure_from_json). Bad input may only raise MalformedRecord; a report
// that reads back must write and read again to the same text, with an exit
// status an agent can return (1..255).
#include <cstdint>

#include "ductile/agent/records.hpp"
#include "fuzz_support.hpp"

namespace agent = ductile::agent;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_only<agent::MalformedRecord>([&] {
    agent::FailureReport report = agent::failure_from_json(text);
    if (report.exit_status < 1 || report.exit_status > 255) __builtin_trap();
    if (report.last_lines.size() > agent::kMaxReportLines) __builtin_trap();
    const std::string written = agent::to_json(report);
    if (agent::to_json(agent::failure_from_json(written)) != written) __builtin_trap();
  });
  return 0;
}
