// The agent's line to its job's rendezvous: the store of the options' kind
// (an etcd, a hosted store this agent serves or joins, or its own), this
// agent's lease and the thread that keeps it alive (and fences the workers
// when it cannot), and the log of records it ignored. Internal to
// libductile_agent; owned by Agent (agent_impl.hpp).
//
// The agent takes the job's secret from the environment, for a hosted
// rendezvous (c10d, static) and for the snapshot servers:
// DUCTILE_RDZV_SECRET_FILE (a regular file of at most 4 KiB, one trailing
// newline dropped) or DUCTILE_RDZV_SECRET (the value). The host admits only
// agents that prove they hold it (store_server.hpp).
//
// Errors: open() throws ductile::Error (invalid_argument) for a bad secret
// variable or TLS files the snapshot copies cannot load;
// grant_first_lease() for a host whose secret differs.
//
// Threading: used by the agent's thread only; the keep-alive runs threads
// of its own (keep_alive.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "agent_common.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "ductile/agent/kv_store.hpp"
#include "ductile/agent/memory_store.hpp"
#include "ductile/agent/store_server.hpp"
#include "keep_alive.hpp"
#include "snapshot_server.hpp"

namespace ductile::agent {

class MirroredStore;

class RendezvousConnection {
 public:
  RendezvousConnection(const AgentOptions& options, const NodeIdentity& self)
      : o_(options), self_(self) {}

  // Opens the rendezvous store of this agent's kind and, hosting one, its
  // server. Throws ductile::Error for a bad endpoint or a port in use.
  void open();
  // The first lease, waiting for a hosted rendezvous' host to come up.
  void grant_first_lease();
  // The lease is kept alive from now on.
  void start_keep_alive();
  // A new lease in place of one that was lost or revoked.
  void renew_lease();
  // Stops the keep-alive and revokes the lease (when the store answers; the
  // lease expires on its own otherwise).
  void close();

  KeyValueStore& store() { return *store_; }
  // The job's keys this agent follows in its mirror of an etcd (the other
  // stores answer every read themselves: always "everything"): every key
  // but the age index's when it leads or is next in line, else its own part
  // (the round, the job's settings and marks, the restore/ records and its
  // registration), so that a record each node writes reaches only the few
  // that lead.
  void follow_everything(bool everything);
  bool follows_everything() const { return !mirror_ || following_everything_; }
  // How the snapshot servers know the job's agents, after open(): the
  // job's secret (empty: none), proved as the hosted rendezvous does,
  // whatever the rendezvous' kind; and TLS when the job's etcd is https
  // with a CA, a certificate and a key.
  const SnapshotAuth& snapshot_auth() const { return snapshot_auth_; }
  std::int64_t lease() const { return lease_; }
  KeepAlive& keep_alive() { return *keep_alive_; }
  // For another thread: the keep-alive while it runs (expired after close()).
  std::weak_ptr<KeepAlive> keep_alive_handle() const { return keep_alive_; }
  // Makes a store of another thread's own (requests give up after the
  // timeout given), after open().
  const KeepAlive::StoreFactory& store_factory() const { return make_store_; }
  // The guards of the workers the fence kills (empty: none); nothing before
  // the keep-alive started or after close().
  void fence_workers(const std::vector<int>& guard_pids);
  // The server of the rendezvous this agent hosts; null when it hosts none.
  StoreServer* rendezvous_server() { return rdzv_server_.get(); }
  // Hosting a rendezvous: before leaving, until the other agents left or
  // their leases could have expired, so that every one reads the end.
  void linger_as_host();
  // Logs a record that is ignored, once per key and revision: the first
  // few of each kind (the key's directory: nodes/, failure/, ...) line by
  // line, the others counted and summed up by report_ignored().
  void ignore_record(const KeyValue& kv, const std::string& problem, const std::string& outcome);
  // True when this revision of the record was ignored already (the caller
  // need not read it again).
  bool ignored(const KeyValue& kv) const;
  // One line per kind for the records ignored and not logged since the
  // last report.
  void report_ignored();
  // The key holds a valid record again: a bad one is logged anew.
  void forget_ignored(const std::string& key) { ignored_.erase(key); }
  // After the fence: revokes the lease the fence gave up on (throws
  // StoreError while the store cannot be reached), says so once, and
  // takes a new lease.
  void leave_fenced_lease();
  // What became of this node's workers while the store is unreachable,
  // for the outage's message.
  std::string workers_during_outage();

 private:
  const AgentOptions& o_;
  const NodeIdentity& self_;
  // The ranges of follow_everything(false).
  std::vector<KeyRange> own_part() const;
  std::unique_ptr<KeyValueStore> store_;
  MirroredStore* mirror_ = nullptr;  // store_, when it is etcd's mirror
  bool following_everything_ = false;
  KeepAlive::StoreFactory make_store_;  // a store for the keep-alive thread
  // Hosting or embedding the rendezvous: its store, and (hosting) its
  // server, which may also serve the workers' store (static).
  std::shared_ptr<MemoryStore> memory_;
  std::unique_ptr<StoreServer> rdzv_server_;
  std::int64_t lease_ = 0;
  KeepAlive::Clock::time_point granted_at_;  // when the first lease's grant was sent
  // Shared with the links' thread, which holds it weakly (node_links.hpp).
  std::shared_ptr<KeepAlive> keep_alive_;
  std::map<std::string, std::int64_t> ignored_;  // key -> mod revision logged
  struct IgnoredKind {
    std::size_t logged = 0;    // line by line
    std::size_t unlogged = 0;  // since the last report
    std::string last;          // the last one not logged: key, problem, outcome
  };
  std::map<std::string, IgnoredKind> ignored_kinds_;
  // The job's secret (empty: none) and the variable it came from.
  std::string secret_, secret_source_;
  SnapshotAuth snapshot_auth_;
};

}  // namespace ductile::agent
