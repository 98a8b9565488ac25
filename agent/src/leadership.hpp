// Leadership: the oldest live agent (a static job's node rank 0) reads the
// members' done, saved and draining marks and the round's failure and
// checkpoint records, asks the policy (rendezvous.hpp) what to do, and
// writes the next round with the place of its workers' store, which it
// serves (TORCHELASTIC_USE_AGENT_STORE). Also this agent's ompi-server
// (--mpi-world), whose URI the leader publishes. Internal to
// libductile_agent; owned by Agent (agent_impl.hpp).
//
// Threading: the agent's thread only; the store servers run threads of
// their own. Errors: StoreError from the store; ductile::Error when the
// fixed workers' store port cannot be served.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent_common.hpp"
#include "connection.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "ductile/agent/store_server.hpp"
#include "membership.hpp"
#include "ompi_server.hpp"

namespace ductile::agent {

class Leadership {
 public:
  Leadership(const AgentOptions& options, const RendezvousSettings& settings,
             const NodeIdentity& self, RendezvousConnection& conn, Membership& membership)
      : o_(options), settings_(settings), self_(self), conn_(conn), membership_(membership) {}

  // One static node: its workers' store at the port asked, served from the
  // start.
  void serve_fixed_worker_store();
  // With --mpi-world: this agent's ompi-server (started, and stopped).
  void start_mpi_server();
  void stop_mpi_server() { mpi_server_.reset(); }
  // A store this agent served for an earlier round's workers serves no one
  // once another leader placed the store of `round`'s.
  void drop_stale_worker_store(const RoundRecord& round);
  // Leading: the live nodes now; the membership changed when they did.
  // Not leading: when this agent leads again (the leader gone), that is a
  // change of membership, seen then.
  void track_membership(const std::vector<NodeInfo>& alive);
  void not_leading() { last_alive_.clear(); }
  void set_membership_change(std::chrono::milliseconds at) { last_membership_change_ = at; }
  // The leader's pass over the round record (round_kv as read, round as
  // read_round() took it): both updated when it writes the next.
  // `snapshots_held`: a node holds a snapshot (the next round says so).
  void lead(const std::vector<NodeInfo>& alive, std::optional<KeyValue>& round_kv,
            std::optional<RoundRecord>& round, bool snapshots_held);

 private:
  // The round's members whose mark (done/ or saved/<round>/<id>) is theirs,
  // or with `round` null the live nodes whose draining/<id> is: the record
  // an agent writes, on the lease of the node's registration. A mark that
  // is not is ignored, saying `if_ignored`.
  std::vector<std::string> marked(const std::string& what, const RoundRecord* round,
                                  const std::vector<NodeInfo>& alive,
                                  const char* if_ignored = "not counted");
  // Where the round's workers find their store (MASTER_ADDR, MASTER_PORT),
  // serving it when this agent does; `server` receives a new one.
  void place_worker_store(RoundRecord& next, const NodeInfo& rank0,
                          std::unique_ptr<StoreServer>& server);

  const AgentOptions& o_;
  const RendezvousSettings& settings_;
  const NodeIdentity& self_;
  RendezvousConnection& conn_;
  Membership& membership_;
  std::unique_ptr<OmpiServer> mpi_server_;  // with --mpi-world
  // The workers' store this agent serves (TORCHELASTIC_USE_AGENT_STORE):
  // the current round's, when it leads with a free port each round; the
  // fixed one of a single static node.
  std::unique_ptr<StoreServer> worker_store_;
  int last_port_ = 0;
  std::vector<std::string> last_alive_;
  std::chrono::milliseconds last_membership_change_{0};
  std::map<std::int64_t, std::chrono::milliseconds> failure_seen_;
};

}  // namespace ductile::agent
