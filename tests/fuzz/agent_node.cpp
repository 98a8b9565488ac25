// Fuzz target: a node registration as read from etcd (node_from_json).
// Input: the id of the key up to the first newline, then the record. Bad
// input may only raise MalformedRecord; a node that reads back has the key's
// id and a printable address, and writes and reads again the same.
#include <cstdint>

#include "ductile/agent/records.hpp"
#include "fuzz_support.hpp"

namespace agent = ductile::agent;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string input(fuzz::as_text(data, size));
  const auto newline = input.find('\n');
  const std::string key_id = input.substr(0, newline);
  const std::string text = newline == std::string::npos ? "" : input.substr(newline + 1);
  fuzz::expect_only<agent::MalformedRecord>([&] {
    agent::NodeInfo node = agent::node_from_json(text, key_id, 7);
    if (node.id != key_id || !agent::valid_node_id(node.id) || node.addr.empty()) __builtin_trap();
    for (char c : node.addr)
      if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f)
        __builtin_trap();
    const std::string written = agent::to_json(node);
    if (agent::to_json(agent::node_from_json(written, key_id, 7)) != written) __builtin_trap();
  });
  return 0;
}
