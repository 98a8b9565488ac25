// `ductile agent`'s command line, ductile's options and torchrun's, and
// their reading into the agent's options (cmd_agent.cpp registers them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ductile/agent/agent.hpp"

namespace ductile::cli {

struct AgentCliOptions {
  agent::AgentOptions agent;
  std::string nproc_per_node = "1";  // N, or torchrun's cpu, gpu, auto
  std::int64_t min_nodes = -1;       // -1: not given
  std::int64_t max_nodes = -1;
  std::int64_t lease_ttl = -1;
  double poll_interval = -1, settle = -1, stop_grace = 5, store_timeout = 30;
  double min_time = -1, failure_grace = -1, checkpoint_timeout = 0;
  // torchrun's options.
  std::string nnodes, rdzv_backend, rdzv_endpoint, rdzv_id, rdzv_conf;
  std::string rdzv_protocol;  // --rdzv-conf protocol=http|https
  double monitor_interval = -1, shutdown_timeout = -1;
  bool no_python = false, module = false, run_path = false, standalone = false;
  bool is_host_given = false, is_host = false;  // --rdzv-conf is_host
  std::int64_t node_rank = 0;
  bool node_rank_given = false;
  std::string master_addr, local_addr;
  std::int64_t master_port = -1;
  std::string log_dir, redirects, tee, local_ranks_filter, start_method;
  // torchrun's options that cannot mean the same here (refused, with what
  // to use instead).
  std::string logs_specs, event_log_handler, numa_binding, duplicate_stdout, duplicate_stderr;
  bool virtual_local_rank = false;
};

// The agent's options from the command line's: torchrun's rendezvous,
// node count, output and worker-command options read as torchrun 2.13
// reads them, with ductile's. `rest`: what follows the options (the worker
// command after '--', or torchrun's training script and its arguments).
// Throws Error (invalid_argument) naming the option, the bad value and
// what is valid.
agent::AgentOptions agent_options(AgentCliOptions& o, const std::vector<std::string>& rest);

}  // namespace ductile::cli
