// The agent of one node, as a class shared by agent.cpp (the loop, the
// leader's writes, the rounds' workers) and registration.cpp (start-up:
// options, the node's key, the job's settings). Internal to
// libductile_agent; see agent.hpp for the contract.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ductile/agent/agent.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "ductile/agent/job_policy.hpp"
#include "ductile/agent/memory_store.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "ductile/agent/store_server.hpp"
#include "ductile/agent/workers.hpp"
#include "ductile/error.hpp"
#include "keep_alive.hpp"
#include "ompi_server.hpp"

namespace ductile::agent {

// What a round's workers are started with (worker_env.cpp).
struct WorkerSetup {
  const AgentOptions& options;
  const JobPolicy& policy;
  const RoundRecord& round;
  std::size_t group_rank;
  const std::string& node_id;
  const std::filesystem::path& run_dir;  // the agent's directory of error files
};
std::vector<WorkerSpec> worker_specs(const WorkerSetup& setup);
// TORCHELASTIC_ERROR_FILE of a worker: <run_dir>/attempt_<round>/<local rank>/error.json.
std::filesystem::path error_file_of(const std::filesystem::path& run_dir, std::int64_t round,
                                    std::int64_t local_rank);
// DUCTILE_CHECKPOINT_REQUEST of a round's workers (the agent creates it when
// it asks them to save) and DUCTILE_CHECKPOINT_SAVED of one (the worker
// creates it when it saved).
std::filesystem::path checkpoint_request_of(const std::filesystem::path& run_dir,
                                            std::int64_t round);
std::filesystem::path checkpoint_saved_of(const std::filesystem::path& run_dir, std::int64_t round,
                                          std::int64_t local_rank);

// How many of the oldest registrations an agent reads each pass to find the
// leader (the oldest live one); the leader reads them all.
inline constexpr std::int64_t kLeaderWindow = 16;

std::chrono::milliseconds now_ms();
std::string host_name();
// This host's fully qualified name, as Python's socket.getfqdn() finds it
// (torchrun's default node address); the host name when it finds none.
std::string fully_qualified_host_name();
// True when `host` names this machine: localhost, a loopback address, its
// host name or an address of one of its interfaces (torchrun's test for
// the host of a c10d rendezvous).
bool names_this_machine(const std::string& host);
// Throws ductile::Error(invalid_argument) naming the first bad option.
void check_options(const AgentOptions& options);

// A directory of the agent's own for its workers' error files and log
// files: $TMPDIR/ductile-agent-<job>-XXXXXX, removed with its contents when
// destroyed; or, when the workers' output goes to files,
// <log dir or $TMPDIR>/<job>_XXXXXX, kept (torchrun's layout).
class RunDir {
 public:
  RunDir(const std::string& job_id, const WorkerOutput& output);
  ~RunDir();
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  bool kept() const { return kept_; }

 private:
  std::filesystem::path path_;
  bool kept_ = false;
};

class Agent {
 public:
  explicit Agent(const AgentOptions& o) : o_(o) {}
  int run();

 private:
  void log(const std::string& message) const {
    write_line(true, fmt::format("ductile agent {}: {}", id_, message));
  }
  std::string key(const std::string& name) const { return prefix_ + name; }

  // registration.cpp
  void setup();
  // The rendezvous store of this agent's kind (and, hosting one, its
  // server); store_ and make_store_ set.
  void open_store();
  // The first lease, waiting for a hosted rendezvous' host to come up.
  void grant_first_lease();
  enum class Claim { held, taken, retry };
  // One attempt to hold nodes/<id> on this agent's lease: held (written),
  // taken (a live registration of another lease; *holder set), retry (the
  // key changed meanwhile). A key without a lease, or with a record no
  // agent writes, is replaced.
  Claim claim_node_key(std::optional<KeyValue>* holder);
  // At start: claims the node's key, waiting for the registration of a
  // previous run of this node to expire; throws ductile::Error when another
  // live agent holds the id.
  void register_node();
  // In the loop: registers again when this node's key is gone or was
  // overwritten (a lost lease, a deletion, a hostile write).
  void reclaim_node_key(const std::string& why);
  void check_settings(const std::vector<NodeInfo>& others);
  [[noreturn]] void refuse_duplicate(const KeyValue& holder, const std::string& how);
  // Leaves the job before it joined (the lease revoked) and throws `error`.
  [[noreturn]] void withdraw(const Error& error);

  // agent.cpp
  // The live agents' registrations: leased keys holding valid records (or
  // a valid record before it was overwritten), sorted by age. Sets *own_ok
  // when this agent's own key holds its own record on its lease. every_key:
  // kvs are every registration (else some: the others' last valid records
  // are kept).
  std::vector<NodeInfo> live_nodes(const std::vector<KeyValue>& kvs, bool* own_ok, bool every_key);
  // This agent's key holds its own record on its lease (and own_revision_
  // is that key's create revision).
  bool own_registration_ok(const std::vector<KeyValue>& own);
  // The round record, when it is one that fits this job.
  std::optional<RoundRecord> read_round(const std::optional<KeyValue>& kv);
  // A round that ended (succeeded or failed) before this agent first
  // registered: a previous run's, not this one's.
  bool previous_run(const RoundRecord& round, const KeyValue& kv) const;
  // The leader starts a new run over a previous run's last round: the old
  // run's records are removed first.
  void clear_previous_run();
  // Writes draining/<id> (this node leaves after its round's checkpoint).
  void mark_draining();
  // The round's members whose mark (done/ or saved/<round>/<id>) is theirs:
  // the record an agent writes, on the lease of the member's registration.
  std::vector<std::string> marked(const std::string& what, const RoundRecord& round,
                                  const std::vector<NodeInfo>& alive);
  // The live nodes' drain marks (draining/<id>), checked as marked() does.
  std::vector<std::string> draining(const std::vector<NodeInfo>& alive);
  // Where the round's workers find their store (MASTER_ADDR, MASTER_PORT),
  // serving it when this agent does; `server` receives a new one.
  void place_worker_store(RoundRecord& next, const NodeInfo& rank0,
                          std::unique_ptr<StoreServer>& server);
  // Hosting a rendezvous: before leaving, until the other agents left or
  // their leases could have expired, so that every one reads the end.
  void linger_as_host();
  // Logs a record that is ignored, once per key and revision.
  void ignore_record(const KeyValue& kv, const std::string& problem, const std::string& outcome);
  void lead(const std::vector<NodeInfo>& alive, std::optional<KeyValue>& round_kv,
            std::optional<RoundRecord>& round);
  std::optional<int> apply(const RoundRecord& round);
  // Stops the workers and takes them off the fence.
  void stop_workers(std::chrono::milliseconds grace);
  // After the fence killed the workers: a new lease and a new registration.
  void rejoin_after_fence();
  void start_workers(const RoundRecord& round, std::size_t group_rank);
  // What the worker of `local_rank` wrote to its TORCHELASTIC_ERROR_FILE in
  // the current round, if it wrote torch's format.
  std::optional<WorkerError> read_worker_error(std::int64_t local_rank);
  void report_worker_exit();
  // With checkpoints on: passes the round's checkpoint request to this
  // node's workers and reports when all of them saved.
  void follow_checkpoint();
  bool workers_saved() const;  // every local worker of the round saved
  // SIGTERM/SIGINT: leave now, or (a member, checkpoints on) ask the round
  // to checkpoint first; the exit code once it is time to leave.
  std::optional<int> on_stop_signal(int sig);
  int leave(int code);

  const AgentOptions& o_;
  std::optional<JobPolicy> policy_;
  RendezvousSettings settings_;
  std::string prefix_, id_, addr_;
  std::unique_ptr<KeyValueStore> store_;
  KeepAlive::StoreFactory make_store_;  // a store for the keep-alive thread
  // Hosting or embedding the rendezvous: its store, and (hosting) its
  // server, which may also serve the workers' store (static).
  std::shared_ptr<MemoryStore> memory_;
  std::unique_ptr<StoreServer> rdzv_server_;
  // The workers' store this agent serves (TORCHELASTIC_USE_AGENT_STORE):
  // the current round's, when it leads with a free port each round; the
  // fixed one of a single static node.
  std::unique_ptr<StoreServer> worker_store_;
  std::int64_t lease_ = 0;
  KeepAlive::Clock::time_point granted_at_;  // when the first lease's grant was sent
  bool fenced_ = false;                      // the fence killed the workers
  std::unique_ptr<KeepAlive> keep_alive_;
  std::unique_ptr<OmpiServer> mpi_server_;  // with --mpi-world
  std::optional<RunDir> run_dir_;           // before workers_: outlives them
  WorkerGroup workers_;
  std::int64_t current_round_ = 0;
  std::int64_t highest_round_ = 0;              // the highest round number seen
  std::optional<RoundRecord> last_good_round_;  // the last valid round record seen
  bool member_ = false;
  // The create revision of this agent's registration: a round lists it for
  // each member, and a round that lists this node's id with another one was
  // formed for an earlier run of the node.
  std::int64_t own_revision_ = 0;
  // The revision of this agent's first registration: a round that ended
  // before it was a previous run's.
  std::int64_t first_revision_ = 0;
  std::int64_t previous_run_logged_ = 0;  // the round record's revision logged
  bool reported_ = false;                 // this round's worker exit is in the store
  std::optional<WorkerExit> local_failure_;
  std::optional<WorkerError> local_error_;  // its TORCHELASTIC_ERROR_FILE
  bool joined_ = false;                     // this node's workers ran in some round
  bool checkpoint_asked_ = false;           // this round's workers were asked to save
  bool saved_reported_ = false;             // ... and saved/<round>/<id> is written
  struct Drain {
    std::int64_t round;
    std::chrono::steady_clock::time_point deadline;
  };
  std::optional<Drain> drain_;  // leaving after the round's checkpoint
  std::chrono::milliseconds joined_job_at_{0};
  int last_port_ = 0;
  std::vector<std::string> last_alive_;
  std::chrono::milliseconds last_membership_change_{0};
  std::map<std::int64_t, std::chrono::milliseconds> failure_seen_;
  std::optional<std::chrono::milliseconds> outage_since_;
  std::map<std::string, std::int64_t> ignored_;  // key -> mod revision logged
  std::map<std::string, NodeInfo> known_nodes_;  // key -> its last valid record
  std::string settings_text_;
};

}  // namespace ductile::agent
