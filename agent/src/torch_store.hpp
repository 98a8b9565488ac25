// The workers' store of a StoreServer: torch's TCPStore protocol, one
// command at a time, over the keys, values and queues the workers share,
// and the clients that wait for keys. The connections, their buffers and
// the poll loop are the server's (store_server.cpp): this side sees a
// command's bytes, its client's waits and the answer it appends. Internal
// to libductile_agent.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <list>
#include <string>
#include <unordered_map>

#include "ductile/agent/store_server.hpp"

namespace ductile::agent {

// torch's command bytes (c10d::detail::QueryType).
enum class TorchCommand : std::uint8_t {
  validate,
  set,
  compare_set,
  get,
  add,
  check,
  wait,
  num_keys,
  delete_key,
  append,
  multi_get,
  multi_set,
  cancel_wait,
  ping,
  queue_push,
  queue_pop,
  queue_len,
  list_keys,
  barrier
};

// Bounds of what one client may send (torch's own server has bounds too):
// a key, a value, the keys of one command, one message with its fields,
// and the answers a connection has not read yet (two of the largest).
inline constexpr std::uint64_t kMaxKey = 64 * 1024;
inline constexpr std::uint64_t kMaxValue = 64u << 20;
inline constexpr std::uint64_t kMaxKeys = 128 * 1024;
inline constexpr std::size_t kMaxBuffered = (64u << 20) + (1u << 20);
inline constexpr std::size_t kMaxUnread = 2 * kMaxBuffered;

using TorchWaiters = std::list<std::uint64_t>;  // connections, in the order they asked

// One torch client's side of the protocol, held with its connection.
struct TorchClient {
  bool validated = false;  // sent VALIDATE and the magic number
  // The distinct keys of a WAIT or BARRIER not there yet, each with this
  // client's place among the key's waiters.
  std::unordered_map<std::string, TorchWaiters::iterator> awaited;

  bool waiting() const { return !awaited.empty(); }
};

// The server's side, for the clients a write wakes.
// Threading: called on the server's thread, from within TorchStore's calls.
class TorchClients {
 public:
  // The client of connection `id`, null once the connection is gone.
  virtual TorchClient* find(std::uint64_t id) = 0;
  // Queues `bytes` (the answer to a WAIT or BARRIER now over) to `id`.
  virtual void answer(std::uint64_t id, const std::string& bytes) = 0;

 protected:
  virtual ~TorchClients() = default;
};

// Ownership: refers to `clients`, which outlives it.
// Threading: the server's thread only.
// Errors: a command that breaks the protocol, or would pass a bound
// (the constants above, StoreLimits' keys and bytes), throws
// wire::BadMessage: the server closes its connection. What the command
// stored, and the waits it ended, before it threw, stay.
class TorchStore {
 public:
  TorchStore(const StoreLimits& limits, TorchClients& clients);

  // Serves the command at the front of `in`, sent by connection `id`, and
  // appends its answer to `reply`: the bytes it took, or 0 when `in` holds
  // only part of it (nothing is done then).
  std::size_t command(std::uint64_t id, TorchClient& client, const std::string& in,
                      std::string& reply);
  // `client` waits for nothing any more (canceled, or its connection goes).
  void forget_waits(TorchClient& client);
  // Forgets every key and every wait (no client waits any more).
  void clear();

 private:
  bool present(const std::string& key) const;
  void make_room(std::size_t keys, std::size_t bytes);
  void store(const std::string& key, std::string value);
  std::size_t erase_value(const std::string& key);
  void push(const std::string& key, std::string value);
  std::string pop(std::unordered_map<std::string, std::deque<std::string>>::iterator q);
  void arrived(const std::string& key, bool one = false);
  void await(std::uint64_t id, TorchClient& client, const std::string& key);

  const std::size_t max_keys_, max_stored_bytes_;
  TorchClients& clients_;
  // What the workers hold, counted against the limits.
  std::unordered_map<std::string, std::string> values_;
  std::unordered_map<std::string, std::deque<std::string>> queues_;  // none empty
  std::unordered_map<std::string, TorchWaiters> waiting_;            // key -> connections
  std::size_t stored_keys_ = 0, stored_bytes_ = 0;
};

}  // namespace ductile::agent
