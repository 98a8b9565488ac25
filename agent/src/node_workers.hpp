// This node's workers in the current round: started for a round that lists
// this node, stopped (and taken off the lease's fence) for the next, their
// exits and the error files they wrote reported to the rendezvous, their
// directory of error, log and checkpoint files. Internal to
// libductile_agent; owned by Agent (agent_impl.hpp).
//
// Threading: the agent's thread only. Errors: StoreError from the store
// (report_exit); ductile::Error when the run directory cannot be made or
// the workers cannot be started.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>

#include "agent_common.hpp"
#include "connection.hpp"

namespace ductile::agent {

class NodeWorkers {
 public:
  NodeWorkers(const AgentOptions& options, const NodeIdentity& self, RendezvousConnection& conn)
      : o_(options), self_(self), conn_(conn) {}

  // Makes the directory of the workers' error and log files.
  void make_run_dir() { run_dir_.emplace(o_.job_id, o_.output); }
  const std::filesystem::path& run_dir() const { return run_dir_->path(); }
  // The run directory removed now, unless kept (RunDir): the agent leaves
  // before any worker ran.
  void discard_run_dir() { run_dir_.reset(); }

  // A new round: what this node's workers did in the last one is dropped;
  // `member`: this node runs workers in it.
  void enter_round(std::int64_t round, bool member);
  // Every round's workers write their snapshots there
  // (DUCTILE_SNAPSHOT_DIR).
  void set_snapshot_dir(std::filesystem::path dir) { snapshot_dir_ = std::move(dir); }
  // Starts this node's workers for `round`, resuming from the snapshot
  // folder `restore` when not empty (DUCTILE_SNAPSHOT_RESTORE; with
  // `restore_wait` > 0 a folder still to come, which they wait for); a stop
  // signal meanwhile leaves the rest unstarted (the agent's loop then
  // stops those started). Throws ductile::Error (io) when the machine
  // cannot start one (fork's EAGAIN: its process limit), having stopped
  // those started.
  void start(const RoundRecord& round, std::size_t group_rank, const JobPolicy& policy,
             const std::filesystem::path& restore = {},
             std::chrono::milliseconds restore_wait = std::chrono::milliseconds(0));
  // The spares of the first round this node joins, started before it
  // registers, and waited for: a node joins once its workers can start
  // warm, so that a running job, which pauses for it, does not wait for
  // their imports. With --warm-workers always (the later rounds' are
  // started with each round's workers); without, only when
  // `joins_running_job` (a running round whose workers keep snapshots),
  // with torch's imports, and for that round alone.
  void start_first_spares(const JobPolicy& policy, bool joins_running_job);
  // Why this node's workers cannot go on in place into `next`, "" when
  // they can: every local worker of the current round still runs and said
  // it takes round notices (round_notice_ready_of), and that it can pause
  // at an optimizer update when `next` only grows; the leading agent serves
  // the workers' store; and no checkpoint is asked of them (their request
  // files are the round's).
  std::string in_place_refusal(const RoundRecord& next) const;
  // No node of the workers' round is missing from `next` (nodes join):
  // the workers train on meanwhile, so they pause first (hold()).
  bool growing(const RoundRecord& next) const;
  // Asks the workers to pause at their next optimizer update for `next`
  // (<notice>.hold, once), then says whether all did (<notice>.held):
  // waiting, held, or late (not within max(5 s, 2 x --lease-ttl), or the
  // request could not be written: hold_refusal() says which; the caller
  // then restarts them).
  enum class Hold { waiting, held, late };
  Hold hold(const RoundRecord& next);
  const std::string& hold_refusal() const { return hold_refusal_; }
  // After continue_in_place(): why the workers must start again, once they
  // did not say they joined the round (<notice>.joined) within max(30 s,
  // 4 x --lease-ttl) (a collective of the old round waiting on a silent
  // peer, whose connections their engine could not shut); nullopt while
  // they may still, or once they did.
  std::optional<std::string> join_overdue();
  // Then: stops the workers and starts them again in the round they did
  // not join, from the same snapshot (they meet the others, joined in
  // place or waiting for them, as a newcomer does).
  void restart_in_round(const JobPolicy& policy);
  // The workers go on in place in `round` (after enter_round): each local
  // worker's round notice is written (its rank at `group_rank`, the
  // snapshot folder `restore` its ranks load), and the worker rejoins the
  // round without a restart (engine.rejoin). Throws ductile::Error (io)
  // when a notice cannot be written (the caller then restarts them).
  void continue_in_place(const RoundRecord& round, std::size_t group_rank, const JobPolicy& policy,
                         const std::filesystem::path& restore);
  // Stops the workers and takes them off the fence.
  void stop(std::chrono::milliseconds grace);
  // Says why the current round ends (round_end_of(), for its workers),
  // then stops them; nothing is written when none runs.
  void end_round(const std::string& why, std::chrono::milliseconds grace);
  bool pump(std::chrono::milliseconds wait, int also = -1) { return group_.pump(wait, also); }
  // When the lease's fence killed the workers: stops what is left of them
  // (not a failure of the round); fenced() until rejoined().
  void notice_fence();
  bool fenced() const { return fenced_; }
  void rejoined() { fenced_ = false; }
  // Writes this round's worker exit to the store once: the first failure
  // (failure/<round>) or the workers' success (done/<round>/<id>).
  void report_exit();
  // Every local worker of the round saved its checkpoint.
  bool all_saved() const;

  std::int64_t current_round() const { return current_round_; }
  bool member() const { return member_; }
  bool running() const { return group_.running(); }
  bool empty() const { return group_.empty(); }
  bool joined() const { return joined_; }  // this node's workers ran in some round
  const std::optional<WorkerExit>& local_failure() const { return local_failure_; }

 private:
  // --warm-workers: the spares of `specs`' local ranks (those missing).
  void start_spares(const std::vector<WorkerSpec>& specs);
  void start_spares(const std::vector<WorkerSpec>& specs, const SpareSetup& setup);
  // The spares' setup for this node's worker command (a Python's).
  SpareSetup spare_setup(std::vector<std::string> imports, bool program_imports) const;
  // What the worker of `local_rank` wrote to its TORCHELASTIC_ERROR_FILE in
  // the current round, if it wrote torch's format.
  std::optional<WorkerError> read_error(std::int64_t local_rank);

  const AgentOptions& o_;
  const NodeIdentity& self_;
  RendezvousConnection& conn_;
  std::optional<RunDir> run_dir_;  // before group_: outlives the workers
  std::filesystem::path snapshot_dir_;
  WorkerGroup group_;
  std::int64_t current_round_ = 0;
  std::vector<std::string> members_;  // the nodes of the running workers' round
  std::int64_t restarts_ = 0;         // the restart count of the workers' round
  // The round the workers were told to join, until they did, and since when.
  std::int64_t joining_round_ = 0;
  std::chrono::milliseconds joining_since_{0};
  struct Joining {
    RoundRecord round;
    std::size_t group_rank;
    std::filesystem::path restore;
  };
  std::optional<Joining> joining_;              // what to start them in when they did not join
  std::int64_t hold_round_ = 0;                 // the round the workers were asked to pause for
  std::chrono::milliseconds hold_asked_at_{0};  // when (now_ms())
  std::string hold_refusal_;
  std::int64_t attempt_ = 0;  // the restart count the running workers' files are under
  bool member_ = false;
  bool reported_ = false;  // this round's worker exit is in the store
  std::optional<WorkerExit> local_failure_;
  std::optional<WorkerError> local_error_;  // its TORCHELASTIC_ERROR_FILE
  bool joined_ = false;
  bool fenced_ = false;  // the fence killed the workers
};

}  // namespace ductile::agent
