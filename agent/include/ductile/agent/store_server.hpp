// The store an agent serves over TCP, and the agents' client of it.
//
// StoreServer listens on one port (every interface) and answers two
// protocols, told apart by a connection's first byte:
//  - torch's TCPStore protocol (torch.distributed.TCPStore, c10d's
//    TCPStore clients): the workers' store. Workers started with
//    TORCHELASTIC_USE_AGENT_STORE=True connect to it at MASTER_ADDR:
//    MASTER_PORT, as they connect to torchrun's agent's store (set, get,
//    add, compare_set, check, wait, delete_key, num_keys, append,
//    multi_get, multi_set, queues, list_keys, barrier);
//  - the agents' protocol over a MemoryStore: the rendezvous of a c10d or
//    static job, hosted by one agent (RendezvousClient is the others' side).
//
// Ownership: the server owns its thread, its socket and its connections;
// the MemoryStore is shared with the hosting agent.
// Threading: the server runs on a thread of its own; its public calls may
// come from any thread. A RendezvousClient is used by one thread at a time.
// Errors: StoreServer's constructor throws std::system_error when the port
// cannot be bound (EADDRINUSE: another process holds it). A connection
// that breaks the protocol is closed; nothing a client sends stops the
// server. RendezvousClient throws StoreUnavailable when the host cannot be
// reached or does not answer in time, StoreGone when a host that answered
// before refuses connections (its agent is gone, with the store), and
// StoreError for an answer that is an error.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ductile/agent/kv_store.hpp"
#include "ductile/agent/memory_store.hpp"

namespace ductile::agent {

class StoreServer {
 public:
  // `port` 0: a free one. `rendezvous`: the store the agents' protocol
  // serves; null: workers' store only (agents' connections are closed).
  StoreServer(int port, std::shared_ptr<MemoryStore> rendezvous);
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
  RendezvousClient(std::string host, int port, std::chrono::milliseconds timeout,
                   std::string description);
  ~RendezvousClient() override;
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  std::int64_t grant_lease(std::int64_t ttl_seconds) override;
  bool keep_alive(std::int64_t lease) override;
  void revoke_lease(std::int64_t lease) override;
  std::int64_t lease_remaining(std::int64_t lease) override;
  void put(const std::string& key, const std::string& value, std::int64_t lease = 0) override;
  std::optional<KeyValue> get(const std::string& key) override;
  std::vector<KeyValue> get_prefix(const std::string& prefix) override;
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
