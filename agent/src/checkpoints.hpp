// Checkpoints before a planned re-form, on this node's side: the round's
// checkpoint request (checkpoint/<round>, written by the leader or a
// draining node) passed to this node's workers as the file they watch
// (DUCTILE_CHECKPOINT_REQUEST), and saved/<round>/<id> written once all of
// them saved. Internal to libductile_agent; owned by Agent
// (agent_impl.hpp).
//
// Threading: the agent's thread only. Errors: StoreError from the store.
#pragma once

#include "agent_common.hpp"
#include "connection.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "node_workers.hpp"

namespace ductile::agent {

class Checkpoints {
 public:
  Checkpoints(const RendezvousSettings& settings, const NodeIdentity& self,
              RendezvousConnection& conn, const NodeWorkers& workers)
      : settings_(settings), self_(self), conn_(conn), workers_(workers) {}

  // A new round: nothing asked of its workers yet.
  void enter_round() { asked_ = saved_reported_ = false; }
  // With checkpoints on: passes the round's checkpoint request to this
  // node's workers and reports when all of them saved.
  void follow();
  // The workers were asked to save and all of them saved: their exits are
  // neither a failure nor the end of the job.
  bool saved_on_request() const { return asked_ && workers_.all_saved(); }

 private:
  const RendezvousSettings& settings_;
  const NodeIdentity& self_;
  RendezvousConnection& conn_;
  const NodeWorkers& workers_;
  bool asked_ = false;           // this round's workers were asked to save
  bool saved_reported_ = false;  // ... and saved/<round>/<id> is written
};

}  // namespace ductile::agent
