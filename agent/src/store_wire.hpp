// Byte-level helpers of the stores' protocols (store_server.cpp: torch's
// TCPStore protocol; store_protocol.cpp: the agents' protocol). Values go
// in the host's byte order, as torch's TCPStore sends them; strings and
// byte strings as a 64-bit length and the bytes. Internal to
// libductile_agent.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ductile/agent/kv_store.hpp"

namespace ductile::agent::wire {

// A message that breaks the protocol: the connection is closed.
class BadMessage : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class T>
void put(std::string& out, T value) {
  static_assert(std::is_trivially_copyable_v<T>);
  out.append(reinterpret_cast<const char*>(&value), sizeof value);
}

inline void put_bytes(std::string& out, const std::string& bytes) {
  put<std::uint64_t>(out, bytes.size());
  out += bytes;
}

// Reads values from the front of a buffer that may hold an incomplete
// message: each read returns false when the buffer ends first (wait for
// more), and throws BadMessage for a length over its limit.
class Cursor {
 public:
  explicit Cursor(const std::string& buffer) : buffer_(buffer) {}

  template <class T>
  bool value(T& out) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (buffer_.size() - pos_ < sizeof out) return false;
    std::memcpy(&out, buffer_.data() + pos_, sizeof out);
    pos_ += sizeof out;
    return true;
  }
  bool bytes(std::string& out, std::uint64_t limit) {
    std::uint64_t size = 0;
    if (!value(size)) return false;
    if (size > limit)
      throw BadMessage("a string of " + std::to_string(size) + " bytes, more than the " +
                       std::to_string(limit) + " allowed");
    if (buffer_.size() - pos_ < size) return false;
    out.assign(buffer_, pos_, static_cast<std::size_t>(size));
    pos_ += static_cast<std::size_t>(size);
    return true;
  }
  std::size_t used() const { return pos_; }
  std::size_t left() const { return buffer_.size() - pos_; }

 private:
  const std::string& buffer_;
  std::size_t pos_ = 0;
};

// The agents' protocol: after the 4 bytes "DKV1", frames of a 32-bit
// length and a body, both ways. A request's body starts with its operation.
inline constexpr char kAgentMagic[4] = {'D', 'K', 'V', '1'};
inline constexpr std::uint32_t kMaxFrame = 8u << 20;
enum class Op : std::uint8_t {
  grant = 1,
  keep_alive,
  revoke,
  remaining,
  put,
  read,
  erase,
  erase_prefix,
  compare_and_swap
};
enum class Status : std::uint8_t { ok = 0, error = 1 };

// Runs one request of the agents' protocol on `store` and returns the
// answer's body (a StoreError becomes an error answer). Throws BadMessage
// for a request that is not one.
std::string serve(KeyValueStore& store, const std::string& request);

}  // namespace ductile::agent::wire
