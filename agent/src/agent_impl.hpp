// The agent of one node, split along its seams (as FSDP2 splits its state
// into param groups and params): Agent runs the loop and owns the parts,
// each with its own state:
//   RendezvousConnection (connection.hpp): the store, the lease, its keep-alive;
//   NodeLinks (node_links.hpp): the links to the leader, which revoke a lost
//     node's lease;
//   Membership (membership.hpp): this node's registration, the live nodes,
//     the round records;
//   Leadership (leadership.hpp): the leader's pass and the workers' store;
//   NodeWorkers (node_workers.hpp): this node's workers in the round;
//   Checkpoints (checkpoints.hpp): the round's checkpoint request followed;
//   NodeSnapshots (node_snapshots.hpp): the workers' in-memory snapshots:
//     their area, its server, the replicas, a new round's restore;
//   StopSignals (signals.hpp): leaving, or draining, on a stop signal.
// The parts hold references to the options, the job's settings and this
// agent's identity, which Agent owns and sets once in setup(). Internal to
// libductile_agent; see agent.hpp for the contract.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "agent_common.hpp"
#include "checkpoints.hpp"
#include "connection.hpp"
#include "ductile/agent/agent.hpp"
#include "ductile/agent/job_policy.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "leadership.hpp"
#include "membership.hpp"
#include "node_links.hpp"
#include "node_snapshots.hpp"
#include "node_workers.hpp"
#include "signals.hpp"

namespace ductile::agent {

class Agent {
 public:
  explicit Agent(const AgentOptions& o)
      : o_(o),
        conn_(o_, self_),
        links_(o_, self_, conn_),
        membership_(o_, settings_, self_, conn_),
        leadership_(o_, settings_, self_, conn_, membership_),
        workers_(o_, self_, conn_),
        snapshots_(o_, settings_, self_, conn_, workers_),
        checkpoints_(settings_, self_, conn_, workers_),
        signals_(o_, settings_, self_, conn_, workers_),
        stop_watch_(o_.stop_signal, [this](int sig) { leave_outside_loop(sig); }) {}
  int run();

 private:
  // Start-up: the options checked, the policy and the job's settings, this
  // node's identity, the run directory and the snapshot area, the
  // rendezvous and the first lease.
  void setup();
  // Applies the round record; returns an exit code when the agent is done.
  std::optional<int> apply(const RoundRecord& round);
  // A member without workers, in a round whose members hold snapshots,
  // starts them before the restore is prepared, on the folder to come
  // (true when it did); finish_pending_restore() then prepares it (again
  // at the next pass after a store error) and links it, or starts the
  // workers again without one, or fails the round.
  bool start_ahead_of_restore(const RoundRecord& round, std::size_t index);
  void finish_pending_restore(const RoundRecord& round);
  // After the fence killed the workers: a new lease and a new registration.
  void rejoin_after_fence();
  int leave(int code);
  // Runs `step` (`what` names it in messages) until the store answers it:
  // a slow or unreachable store is tried again with back-off for up to
  // --store-timeout. nullopt when done, else the agent's exit status.
  std::optional<int> while_store_answers(const std::string& what,
                                         const std::function<void()>& step);
  // Waits up to the poll interval for the workers' output or exit, or a
  // stop signal.
  // Waits up to --poll-interval for the workers, or until a key under
  // `wake_on` changes (KeyValueStore::changes_fd).
  void wait_for_workers(const std::vector<std::string>& wake_on);
  // A stop signal in a stage the loop is not in (StopWatch): no worker
  // runs; the run directory goes, the process exits with 128 + sig.
  [[noreturn]] void leave_outside_loop(int sig);

  const AgentOptions& o_;
  std::optional<JobPolicy> policy_;
  RendezvousSettings settings_;
  NodeIdentity self_;
  // The parts, in the order they are made (and destroyed backwards: the
  // workers before the lease's keep-alive and the rendezvous' store).
  RendezvousConnection conn_;
  NodeLinks links_;  // to the leader: a lost node is known at once
  Membership membership_;
  Leadership leadership_;
  NodeWorkers workers_;
  NodeSnapshots snapshots_;
  Checkpoints checkpoints_;
  StopSignals signals_;
  StopWatch stop_watch_;  // last: its thread ends before the parts go
  // Too few nodes (a round without members): what this node waits for
  // and until when, as a line ("now": said at the start of the wait, else
  // a reminder).
  std::string short_of_nodes(bool now) const;
  std::chrono::milliseconds joined_job_at_{0};
  std::optional<std::chrono::milliseconds> outage_since_;
  // Since when this node waits in a round without members (too few nodes
  // for a valid size; from the agent's start when it never ran workers);
  // none in a round with members. --rdzv-conf join_timeout bounds it.
  std::optional<std::chrono::milliseconds> short_since_;
  std::chrono::milliseconds short_said_{0};  // when the wait was last reported
  // The live registrations the last pass saw (every one when leading, else
  // the kLeaderWindow oldest).
  std::size_t nodes_seen_ = 0;
  // The round whose workers started ahead of its restore, while it is
  // prepared (0: none), and this node's index in it.
  std::int64_t restore_pending_round_ = 0;
  std::size_t restore_pending_index_ = 0;
  // An agent that follows its own part of the job's keys: the round
  // record's revision and the time at its last read of the oldest
  // registrations.
  std::int64_t window_round_revision_ = -1;
  std::chrono::milliseconds window_read_at_{0};
  // The leader that read found (its node id and its key's create
  // revision; empty: none yet).
  std::string window_leader_;
  std::int64_t window_leader_revision_ = 0;
  // Whether `round_kv`'s round has the leader of the last read of the
  // oldest registrations (the same key) for its oldest member, and at
  // least kLeaderWindow members older than this agent: it is then not among
  // the oldest, and its leader is the same (a new round costs it no read
  // of them).
  bool behind_the_oldest(const std::optional<KeyValue>& round_kv);
  // Whether this node, its worker command a Python's, comes to a job whose
  // round runs and whose workers keep snapshots (one read; false when the
  // store cannot tell now): its workers, which the running ones will pause
  // for, then import ahead.
  bool joins_running_job();
};

}  // namespace ductile::agent
