// Byte-level helpers of the stores' protocols (torch_store.cpp: torch's
// TCPStore protocol; store_protocol.cpp: the agents' protocol). Values go
// in the host's byte order, as torch's TCPStore sends them; strings and
// byte strings as a 64-bit length and the bytes. Internal to
// libductile_agent.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
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
//
// A host with a secret (DUCTILE_RDZV_SECRET) serves nothing before the
// client proved it holds the secret too, by a challenge-response that never
// sends the secret: the client sends `hello` and a random nonce; the host
// answers 1, its own random nonce and its proof, HMAC-SHA256(secret, "host"
// label, client nonce, host nonce); the client checks it and sends `prove`
// and HMAC-SHA256(secret, "agent" label, host nonce, client nonce). A host
// without a secret answers `hello` with 0. A request before the proof, a
// wrong proof, or no proof within kProofTimeout: an `unauthorized` answer
// (where there is a request to answer) and the connection is closed.
inline constexpr char kAgentMagic[4] = {'D', 'K', 'V', '1'};
inline constexpr std::uint32_t kMaxFrame = 8u << 20;
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::chrono::seconds kProofTimeout{5};
enum class Op : std::uint8_t {
  grant = 1,
  keep_alive,
  revoke,
  remaining,
  put,
  read,
  erase,
  erase_prefix,
  compare_and_swap,
  hello,
  prove
};
enum class Status : std::uint8_t { ok = 0, error = 1, unauthorized = 2 };

// The pieces of the challenge-response, shared with the snapshot servers'
// protocol (snapshot_server.hpp), which proves the same secret under labels
// of its own. Each throws BadMessage when OpenSSL fails.
// `kNonceBytes` random bytes.
std::string random_nonce();
// HMAC-SHA256(secret, label, first, second), each field after its length.
std::string proof(const std::string& secret, std::string_view label, const std::string& first,
                  const std::string& second);
// Compares two proofs in constant time.
bool same_proof(const std::string& a, const std::string& b);

// Runs one request of the agents' protocol on `store` and returns the
// answer's body (a StoreError becomes an error answer). Throws BadMessage
// for a request that is not one.
std::string serve(KeyValueStore& store, const std::string& request);

// The host's side of one agent's connection: the proof of the secret, then
// the requests, served on `store`.
// Ownership: refers to `store`, which outlives it. Threading: the server's
// thread only. Errors: answer() throws BadMessage as serve() does.
class AgentPeer {
 public:
  // `secret` empty: no proof asked, every request served.
  AgentPeer(KeyValueStore& store, std::string secret);
  // The answer to one request. `close` is set when the connection must be
  // closed once the answer is sent (a request before the proof, a wrong
  // proof).
  std::string answer(const std::string& request, bool& close);
  // True once the client proved the secret (at once without one).
  bool admitted() const { return admitted_; }

 private:
  KeyValueStore& store_;
  const std::string secret_;
  bool admitted_;
  std::string client_nonce_, host_nonce_;  // of the hello answered
};

}  // namespace ductile::agent::wire
