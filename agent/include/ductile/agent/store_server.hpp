// The store an agent serves over TCP, and the agents' client of it.
//
// StoreServer listens on one port of the addresses its host resolves to
// (every interface for an empty host) and answers two protocols, told
// apart by a connection's first byte:
//  - torch's TCPStore protocol (torch.distributed.TCPStore, c10d's
//    TCPStore clients): the workers' store. Workers started with
//    TORCHELASTIC_USE_AGENT_STORE=True connect to it at MASTER_ADDR:
//    MASTER_PORT, as they connect to torchrun's agent's store (set, get,
//    add, compare_set, check, wait, delete_key, num_keys, append,
//    multi_get, multi_set, queues, list_keys, barrier);
//  - the agents' protocol over a MemoryStore: the rendezvous of a c10d or
//    static job, hosted by one agent (RendezvousClient is the others' side).
//    With a secret, the host serves an agent only once it proved it holds
//    the same secret (a challenge-response, HMAC-SHA256; the secret never
//    crosses the wire), and the agent checks the host's proof likewise.
//    torch's TCPStore protocol has no such check.
//
// Ownership: the server owns its thread, its socket and its connections;
// the MemoryStore is shared with the hosting agent.
// Threading: the server runs on a thread of its own; its public calls may
// come from any thread. A RendezvousClient is used by one thread at a time.
// Errors: StoreServer's constructor throws std::system_error when the port
// cannot be bound (EADDRINUSE: another process holds it). A connection
// that breaks the protocol or a bound of StoreLimits is closed (what a
// torch client sees for a protocol error); nothing a client sends stops
// the server or makes one request's work grow faster than its size. RendezvousClient throws
// StoreUnavailable when the host cannot be reached or does not answer in time, StoreGone when a
// host that answered before refuses connections (its agent is gone, with the store), and StoreError
// for an answer that is an error, StoreRefused when its secret and the host's differ.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ductile/agent/kv_store.hpp"
#include "ductile/agent/memory_store.hpp"

namespace ductile::agent {

// The host of a rendezvous and this agent do not hold the same secret (one
// of them may have none): retrying cannot help.
class StoreRefused : public StoreError {
 public:
  using StoreError::StoreError;
};

// What a StoreServer holds at most for its clients; a client that would
// pass a bound is disconnected. The defaults are documented in
// docs/elastic-agent.md (Security).
struct StoreLimits {
  // A connection in the middle of a message that sends nothing for this
  // long is closed (a slow client cannot hold its partial message).
  std::chrono::milliseconds idle_message_timeout{30'000};
  // Bytes in every connection's input and output buffers together; past
  // it, the connection holding the most is closed.
  std::size_t max_buffered_bytes = std::size_t{256} << 20;
  // Keys (and queues) of the workers' store; a write that adds one more
  // closes the writer's connection.
  std::size_t max_keys = std::size_t{1} << 20;
  // Bytes of the workers' store's keys and values; a write past it closes
  // the writer's connection.
  std::size_t max_stored_bytes = std::size_t{256} << 20;
};

class StoreServer {
 public:
  // `host`: the name or address whose addresses it binds (every one the
  // resolver gives; every interface when empty, or when none of them is
  // an address of this machine). `port` 0: a free one. `rendezvous`: the
  // store the agents' protocol serves; null: workers' store only (agents'
  // connections are closed). `agents_secret` not empty: the agents'
  // protocol serves only agents that prove they hold it; one that does not
  // within a few seconds is closed.
  StoreServer(const std::string& host, int port, std::shared_ptr<MemoryStore> rendezvous,
              StoreLimits limits = {}, std::string agents_secret = {});
  ~StoreServer();  // closes every connection and the port
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const;
  // Forgets every key of the workers' store and closes the workers'
  // connections, before a round's workers start: they find an empty store,
  // and a worker of an earlier round can no longer write to it. Returns
  // once done.
  void reset_worker_store();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The agents' side of a StoreServer's rendezvous: a KeyValueStore whose
// calls go to the host at `host`:`port`, each within `timeout`.
class RendezvousClient final : public KeyValueStore {
 public:
  // `description`: the store for messages ("the c10d rendezvous at h:29400").
  // `secret` not empty: each connection proves it to the host, and checks
  // the host's proof, before its first request (StoreRefused when they
  // differ).
  RendezvousClient(std::string host, int port, std::chrono::milliseconds timeout,
                   std::string description, std::string secret = {});
  ~RendezvousClient() override;
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  std::int64_t grant_lease(std::int64_t ttl_seconds) override;
  bool keep_alive(std::int64_t lease) override;
  void revoke_lease(std::int64_t lease) override;
  std::int64_t lease_remaining(std::int64_t lease) override;
  void put(const std::string& key, const std::string& value, std::int64_t lease = 0) override;
  std::vector<std::vector<KeyValue>> read(const std::vector<RangeRead>& reads) override;
  void erase(const std::string& key) override;
  void erase_prefix(const std::string& prefix) override;
  bool compare_and_swap(const std::string& key, std::int64_t expected_mod_revision,
                        const std::string& value, std::int64_t lease = 0) override;
  std::string describe() const override;

 private:
  std::string call(const std::string& request);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ductile::agent
