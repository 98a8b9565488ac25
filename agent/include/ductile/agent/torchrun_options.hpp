// `ductile agent`'s command line, ductile's options and torchrun's, read
// into the agent's options as torchrun 2.13 reads its own: the rendezvous
// backends (c10d, static, etcd, etcd-v2, --standalone), --nnodes,
// --rdzv-conf, the output options and the worker command. A front end
// parses argv into LaunchArguments (an option left out stays empty) and
// calls agent_options(); see docs/elastic-agent.md, "torchrun's command
// line".
//
// Defaults: an agent option left out keeps AgentOptions' default (stated
// there once); torchrun's own defaults, which AgentOptions has no field
// for, are TorchrunDefaults below. Help texts read both.
// Threading: agent_options() reads the environment (PYTHON_EXEC,
// DUCTILE_CONSOLE_PYTHON, CUDA_VISIBLE_DEVICES,
// TORCH_DISABLE_SHARE_RDZV_TCP_STORE); call it before starting threads
// that change it. Errors: throws ductile::Error (invalid_argument) naming
// the option, the bad value and what is valid.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ductile/agent/agent_options.hpp"

namespace ductile::agent {

// torchrun's defaults for what its options name and AgentOptions does not.
struct TorchrunDefaults {
  static constexpr const char* rdzv_backend = "static";
  static constexpr const char* rdzv_id = "none";  // the job id
  // A static rendezvous: node rank 0's store.
  static constexpr const char* master_addr = "127.0.0.1";
  static constexpr int master_port = 29500;
  static constexpr std::int64_t node_rank = 0;
  static constexpr int c10d_port = 29400;  // --rdzv-endpoint HOST without a port
  // --rdzv-conf keep_alive_interval (seconds) x keep_alive_max_attempt: the
  // lease TTL when either is given.
  static constexpr double keep_alive_interval = 5;
  static constexpr std::int64_t keep_alive_max_attempt = 3;
};

// The options as a command line gives them: `agent` holds those that are
// the agent's own, as given (its defaults where left out); the others are
// empty when left out. Seconds are in seconds, as on the command line.
struct LaunchArguments {
  AgentOptions agent;
  std::optional<std::string> nproc_per_node;  // N, or torchrun's cpu, gpu, auto
  std::optional<std::int64_t> min_nodes, max_nodes;
  std::optional<std::int64_t> lease_ttl;
  std::optional<double> poll_interval, settle, stop_grace, store_timeout;
  std::optional<double> min_time, failure_grace, checkpoint_timeout;
  std::optional<double> heartbeat;  // --heartbeat, or --rdzv-conf heartbeat
  // --warm-workers, and the modules of --warm-imports (which implies it).
  bool warm_workers = false;
  std::optional<std::string> warm_imports;
  // torchrun's options.
  std::string nnodes, rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf;
  std::optional<double> monitor_interval, shutdown_timeout;
  bool no_python = false, module = false, run_path = false, standalone = false;
  std::optional<std::int64_t> node_rank;
  std::string master_addr, local_addr;
  std::optional<std::int64_t> master_port;
  std::string log_dir, redirects, tee, local_ranks_filter, start_method;
  // torchrun's options that cannot mean the same here (refused, saying
  // what to use instead).
  std::string logs_specs, event_log_handler, numa_binding, duplicate_stdout, duplicate_stderr;
  bool virtual_local_rank = false;
};

// The agent's options from the command line's. `rest`: what follows the
// options (the worker command after '--', or torchrun's training script and
// its arguments). The result still goes through check_options() in
// run_agent().
AgentOptions agent_options(const LaunchArguments& arguments, const std::vector<std::string>& rest);

}  // namespace ductile::agent
