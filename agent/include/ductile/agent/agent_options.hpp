// The agent's options (AgentOptions), each default stated once, here: the
// command line's help text and its torchrun translation (torchrun.hpp)
// read them from AgentOptions{}; and their check (check_options).
//
// Threading: plain values; check_options may be called from any thread.
// Errors: check_options throws ductile::Error (invalid_argument) naming
// the first bad option, its value and what is valid.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "ductile/agent/etcd_store.hpp"
#include "ductile/agent/workers.hpp"
#include "ductile/core/runtime.hpp"

namespace ductile::agent {

// How the agents of a job meet (torchrun's rendezvous backends).
enum class RendezvousKind {
  // An etcd (`rdzv`): torchrun's etcd and etcd-v2; survives any node.
  etcd,
  // A store one agent holds in its memory and serves at rdzv_host:rdzv_port
  // (StoreServer); the others join it: torchrun's c10d and static. The job
  // ends when that agent does.
  hosted,
  // One node: the store in this agent's memory, nothing served for it
  // (torchrun's --standalone, and one node without a rendezvous).
  embedded,
};

// Who hosts a `hosted` rendezvous.
enum class Hosting {
  if_local,  // c10d: an agent on the endpoint's host that can bind the port
  always,    // static, node rank 0
  never,     // static, other nodes
};

struct AgentOptions {
  // TOML with [elasticity], or DeepSpeed JSON; empty: any node count from
  // min_nodes to max_nodes is valid (torchrun's --nnodes MIN:MAX).
  std::filesystem::path config;
  RendezvousKind rendezvous = RendezvousKind::etcd;
  std::string rdzv;  // etcd: etcd://HOST:PORT, or https://HOST:PORT with `tls`
  EtcdTls tls;       // --rdzv-cacert, --rdzv-cert, --rdzv-key
  // hosted: the endpoint, and who hosts it; `rdzv_name` names it in
  // messages ("c10d", "static").
  std::string rdzv_host;
  int rdzv_port = 0;
  Hosting hosting = Hosting::if_local;
  std::string rdzv_name = "c10d";
  std::string job_id;  // letters, digits, '.', '_', '-'
  std::int64_t nproc_per_node = 1;
  std::int64_t min_nodes = 1;
  // Default: the most nodes any valid size uses; min_nodes without a config.
  std::optional<std::int64_t> max_nodes;
  std::int64_t max_restarts = 0;     // restarts after worker failures, job-wide
  std::vector<std::string> command;  // the worker command line
  // How the workers' Python was chosen ("/usr/bin/python3 (python3 on
  // PATH)"); empty when the command is not run by one the agent chose.
  std::string interpreter_choice;
  std::string role = "default";  // ROLE_NAME of the workers (torchrun's --role)
  // TORCHELASTIC_SIGNALS_TO_HANDLE of the workers; empty: the agent's own
  // environment's, else torchrun's default "SIGTERM,SIGINT,SIGHUP,SIGQUIT".
  std::string signals_to_handle;
  std::string node_addr;  // default: the host's fully qualified name
  std::string node_id;    // default: <host>-<pid>-<random>
  // A static job's node rank (torchrun's --node-rank): rounds order nodes
  // by it, and node rank 0 leads; -1: nodes are ordered by age.
  std::int64_t node_rank = -1;
  // The workers' store (TORCHELASTIC_USE_AGENT_STORE): true, the leading
  // agent serves it at MASTER_ADDR:MASTER_PORT (torchrun's c10d, etcd-v2,
  // static, standalone); false, rank 0's worker creates it there
  // (torchrun's etcd).
  bool agent_store = true;
  // With agent_store: the store at this fixed address and port (torchrun's
  // static --master-addr, --master-port), served by node rank 0's agent (by
  // the rendezvous' server when it hosts one there); port 0: a free port of
  // the leader's, new each round, at its node address.
  std::string master_addr;
  int master_port = 0;
  // Workers form one MPI world without mpirun: each agent runs an
  // ompi-server, and each round's workers get the leader's
  // (OMPI_MCA_pmix_server_uri) and DUCTILE_MPI_JOIN (see
  // accelerators/common/mpi_join.hpp). The same on every agent of a job.
  bool mpi_world = false;
  // The workers' output (torchrun's --log-dir, --redirects, --tee,
  // --local-ranks-filter); see workers.hpp.
  WorkerOutput output;
  // --warm-workers: the modules each local rank's spare worker imports
  // before its round (workers.hpp); empty: workers start cold. The worker
  // command must be Python running a script or -m MODULE.
  std::vector<std::string> warm_imports;
  // With warm_imports: the spares also import what the worker's script (or
  // -m module) imports at its top level, read from its source, less the
  // modules its own folder gives it (--warm-workers without
  // --warm-imports).
  bool warm_program_imports = false;

  std::chrono::seconds lease_ttl{5};                       // a dead agent is noticed after this
  std::chrono::milliseconds poll_interval{250};            // rendezvous reads
  std::chrono::milliseconds settle{2000};                  // quiet time before forming
  std::chrono::milliseconds stop_grace{5000};              // SIGTERM -> SIGKILL
  std::chrono::milliseconds store_timeout{30000};          // give up when etcd is gone this long
  std::optional<std::chrono::milliseconds> min_time;       // overrides the config's min_time
  std::optional<std::chrono::milliseconds> failure_grace;  // default: lease_ttl
  // Give up (exit 1) when this agent's workers have not started in a round
  // this long after the agent started (torchrun's join_timeout); none: wait.
  std::optional<std::chrono::milliseconds> join_timeout;
  std::chrono::milliseconds request_timeout{2000};  // one etcd request
  // How long a node's link to the leader (or the leader's to it) may stay
  // silent before the other side revokes the node's lease (node_links.hpp);
  // heartbeats go every quarter of it.
  std::chrono::milliseconds heartbeat{1000};
  // > 0: before a planned re-form (a scale-up, a node drained with SIGTERM)
  // the round's workers are asked to checkpoint (DUCTILE_CHECKPOINT_REQUEST,
  // ductile.torch.elastic) and waited for this long at most.
  std::chrono::milliseconds checkpoint_timeout{0};
  // Where the agent makes its snapshot area (the workers' in-memory
  // snapshots and the replicas it keeps of other nodes'); empty: /dev/shm
  // when it is a directory, else the system's temporary directory.
  std::string snapshot_dir;

  core::RuntimeOptions runtime;  // where the policy plugins are found
  // Set (to the signal number) by a signal handler to stop the agent.
  const std::atomic<int>* stop_signal = nullptr;
};

// What --warm-workers pre-imports unless --warm-imports says otherwise:
// torch, and the torch._dynamo that torch.optim's first optimizer imports.
inline constexpr const char* kDefaultWarmImports = "torch,torch._dynamo";

// The shortest lease_ttl: etcd's leases last at least this long.
inline constexpr std::chrono::seconds kMinLeaseTtl{2};
// The longest duration any option takes (lease_ttl included): 1,000,000 s,
// about 11.6 days. Longer is a mistake, and a lease in nanoseconds would
// overflow long before a duration in milliseconds does.
inline constexpr std::chrono::seconds kMaxDuration{1000000};
// The shortest and longest --heartbeat: below 0.1 s a busy machine's
// scheduling alone could look like silence; above a minute the lease TTL
// notices a silent node about as soon.
inline constexpr std::chrono::milliseconds kMinHeartbeat{100};
inline constexpr std::chrono::milliseconds kMaxHeartbeat{60000};
// Workers one node may run, for each of its online cores: a worker is two
// processes (its guard and itself), and a node asked for more than this is
// asked for more than it can run.
inline constexpr std::int64_t kWorkersPerCore = 64;
// The most workers this machine may run: its online cores x kWorkersPerCore.
std::int64_t max_workers_per_node();

// Throws ductile::Error(invalid_argument) naming the first bad option (by
// its command-line name), its value and what is valid. run_agent() calls it.
void check_options(const AgentOptions& options);

}  // namespace ductile::agent
