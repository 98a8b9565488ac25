// Fuzz target: the agent's round record as read from etcd (round_from_json,
// then check_round_fits for 1 to 4 workers a node). Bad input may only raise
// MalformedRecord; a record that reads back must write and read again to
// the same text.
#include <cstdint>

#include "ductile/agent/records.hpp"
#include "fuzz_support.hpp"

namespace agent = ductile::agent;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_only<agent::MalformedRecord>([&] {
    agent::RoundRecord round = agent::round_from_json(text);
    const std::string written = agent::to_json(round);
    if (agent::to_json(agent::round_from_json(written)) != written) __builtin_trap();
    if (round.members.empty() != (round.world_size == 0)) __builtin_trap();
    agent::check_round_fits(round, 1 + static_cast<std::int64_t>(size % 4), {1, 2, 3, 4, 6});
  });
  return 0;
}
