// Fuzz target: a checkpoint request as read from etcd under
// checkpoint/1 (checkpoint_from_json), and a done mark under done/1/n
// (check_mark). Bad input may only raise MalformedRecord; a request that
// reads back writes and reads again to the same text.
#include <cstdint>

#include "ductile/agent/records.hpp"
#include "fuzz_support.hpp"

namespace agent = ductile::agent;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_only<agent::MalformedRecord>([&] {
    agent::CheckpointRequest request = agent::checkpoint_from_json(text, 1);
    if (request.round != 1 || !agent::valid_node_id(request.by) || request.requested_ms < 0)
      __builtin_trap();
    const std::string written = agent::to_json(request);
    if (agent::to_json(agent::checkpoint_from_json(written, 1)) != written) __builtin_trap();
  });
  fuzz::expect_only<agent::MalformedRecord>([&] { agent::check_mark("done", text, "n", 1); });
  return 0;
}
