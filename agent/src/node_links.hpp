// The links between a job's agents and its leader: how a lost node is known
// in a fraction of a second rather than when its lease expires. Internal to
// libductile_agent; owned by Agent (agent_impl.hpp).
//
// A star: every agent of the job (members and standbys) keeps one TCP link
// to the leader's listener (the oldest registration's; its port is in the
// registration, "link_port"), so N agents hold N links. A link that closes
// without a goodbye (the kernel closes a killed process's sockets at once)
// or stays silent for --heartbeat has its node's lease revoked, which
// deletes its registration: the leader forms the next round without it at
// once. The leader acts on a member's link; the next oldest agent acts on
// its own link to the leader (it leads afterwards). The lease stays the
// fence: a node whose lease was revoked while it runs stops its workers
// (keep_alive.hpp) and joins again as a new node. A node whose judge (the
// leader; for the leader, the next oldest) falls silent may be the one cut
// off: unless its lease renews within a quarter heartbeat, it stops its
// workers too, so that a silent node's lease can be revoked about 1.6
// heartbeats after its last byte, not 3/4 of the TTL.
//
// Its own listener, not the snapshot server's: that one serves a few
// short copies at a time, each on a thread of its own with an idle cut;
// links are many, long-lived and nearly idle, served by one thread that
// polls them all.
//
// The protocol. The agent sends "DLK1" and a random nonce of
// wire::kNonceBytes; the leader answers a byte, 1 when it has the job's
// secret (else 0), its own nonce and its proof,
// HMAC-SHA256(secret, link host label, agent's nonce, leader's nonce)
// (zeros without a secret). The agent checks it and sends a byte (1 with a
// secret), its proof (HMAC-SHA256(secret, link agent label, leader's
// nonce, agent's nonce), zeros without), its node id (a length byte and
// the id) and its lease (64-bit, the host's byte order). Then single bytes
// both ways: 'H' a heartbeat, every quarter of --heartbeat from each side;
// 'B' goodbye (the sender leaves on purpose or links elsewhere: its link's
// end is no loss); 'D' dropped (the sender revoked the other's lease, or
// found it silent: the other must not take the close for a loss). A secret
// on one side only, or two that differ, and the link is not made.
//
// Bounded: a handshake of at most 4 + 32 + 1 + 32 + 1 + kMaxNodeIdChars + 8
// bytes from the agent, within
// wire::kProofTimeout; at most kMaxUnprovenLinks connections in their
// handshake (a newcomer past it cuts the oldest) and kMaxLinks links;
// any other byte on a link closes it. The leader revokes only the lease of
// a live registration whose node id and lease the link named.
//
// Threading: serve(), follow() and close() on the agent's thread; the
// links run on a thread of their own, the revocations (requests to the
// store) on another, so that a slow store never delays a heartbeat.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "agent_common.hpp"
#include "connection.hpp"

namespace ductile::agent {

inline constexpr std::size_t kMaxLinks = 65536;
inline constexpr std::size_t kMaxUnprovenLinks = 64;

class NodeLinks {
 public:
  NodeLinks(const AgentOptions& options, const NodeIdentity& self, RendezvousConnection& conn)
      : o_(options), self_(self), conn_(conn) {}
  ~NodeLinks() { close(); }
  NodeLinks(const NodeLinks&) = delete;
  NodeLinks& operator=(const NodeLinks&) = delete;

  // Listens on a free port of this node's address and starts the links'
  // threads (after conn's open(); none for a rendezvous of one node).
  void serve();
  int port() const { return port_; }
  // Each pass: the oldest registrations as read (empty: not read this
  // pass; those without an address are read from the store) and, when
  // this agent leads, every live one. Links to the leader, or (leading)
  // knows whose links it may act on. Throws StoreError.
  void follow(const std::vector<NodeInfo>& oldest, const std::vector<NodeInfo>& alive);
  // Leaving on purpose: a goodbye on every link, then they close.
  void close();
  // This agent's link to the leader follow() named is made and heard from
  // within --heartbeat (as of the links' thread's last turn, at most 250 ms
  // ago). Any thread.
  bool leader_linked() const { return leader_linked_.load(std::memory_order_relaxed); }

 private:
  struct Peer;  // one link's end on this agent (node_links.cpp)
  struct Leader {
    std::string id;
    std::int64_t lease = 0;
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
    bool next = false;           // this agent is the next oldest: it acts on the link's loss
    std::int64_t own_lease = 0;  // this agent's, named in the link's hello
    std::uint64_t generation = 0;
  };
  struct Revocation {
    std::string id;
    std::int64_t lease = 0;
    std::string why;  // "lost: its link closed; ", "silent for 1.2 s (--heartbeat 1 s): "
  };

  void run();     // the links' thread
  void revoke();  // the revocations' thread
  // A link's loss (`why`): its node's lease revoked when it may be (after
  // checking that this agent's own lease is alive: a node cut off judges
  // no other).
  void lost(const std::string& id, std::int64_t lease, const std::string& why, bool leader);

  const AgentOptions& o_;
  const NodeIdentity& self_;
  RendezvousConnection& conn_;
  std::vector<int> listeners_;
  int wake_[2] = {-1, -1};  // a pipe: written when follow() or close() changed something
  int port_ = 0;
  std::mutex mutex_;
  std::condition_variable revocations_ready_;
  bool stopping_ = false;
  std::weak_ptr<KeepAlive> keep_alive_;  // as follow() last saw it
  Leader leader_;                        // none: an empty id
  std::int64_t own_lease_ = 0;
  std::map<std::string, std::int64_t> members_;  // leading: each live node's lease
  std::string judge_;  // leading: the next oldest, which judges this agent's silence
  std::deque<Revocation> revocations_;
  std::set<std::int64_t> revoked_;  // leases revoked or asked to be (each reported once)
  std::string leader_seen_;         // the leader follow() last looked up
  std::thread links_, revoker_;
  std::atomic<bool> leader_linked_{false};
};

}  // namespace ductile::agent
