// The elastic agent of one node: joins the job's rendezvous (an etcd, a
// store one agent of the job serves, or, alone, its own), starts this node's
// workers for each round with the environment torchrun and DeepSpeed workers
// expect plus the batch plan of the round's world size, serves their
// TCPStore when it leads, watches them, and re-forms the group when a node
// leaves, a node arrives (and a larger valid world size becomes reachable)
// or a worker fails. See docs/elastic-agent.md.
//
// Threading: run_agent() blocks the calling thread until the job ends; it
// starts helper threads (the lease keep-alive and its fence; a store
// server's when it serves the rendezvous or the workers' store). It forks worker processes, so
// call it from a process whose other threads do not hold locks the children
// would need (the guards call only async-signal-safe functions).
// Errors: throws ductile::Error (a user error: exit code 2 in the CLI) for
// invalid options, an invalid configuration, an unreachable etcd at start, a
// port to host that is in use, a job id in use with other settings, or an
// nproc-per-node that no valid world size can use. Failures after the start
// are the return value.
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
  std::string role = "default";      // ROLE_NAME of the workers (torchrun's --role)
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
  // > 0: before a planned re-form (a scale-up, a node drained with SIGTERM)
  // the round's workers are asked to checkpoint (DUCTILE_CHECKPOINT_REQUEST,
  // ductile.torch.elastic) and waited for this long at most.
  std::chrono::milliseconds checkpoint_timeout{0};

  core::RuntimeOptions runtime;  // where the policy plugins are found
  // Set (to the signal number) by a signal handler to stop the agent.
  const std::atomic<int>* stop_signal = nullptr;
};

// Exit statuses of run_agent besides a worker's own status.
inline constexpr int kAgentOk = 0;
// etcd unreachable for store_timeout, or the agent hosting a c10d or
// static rendezvous gone.
inline constexpr int kAgentStoreLost = 1;

inline constexpr int kAgentJoinTimeout = 1;  // no round within join_timeout

// Runs the agent until the job ends. Returns 0 when the workers finished,
// the failing worker's exit status (128 + signal for a signal) when restarts
// are spent, kAgentStoreLost when etcd stayed unreachable, 128 + signal when
// stopped by *stop_signal.
int run_agent(const AgentOptions& options);

}  // namespace ductile::agent
