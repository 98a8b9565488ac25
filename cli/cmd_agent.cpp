// ductile agent [--config FILE] --rdzv etcd://HOST:PORT --job-id ID --nproc-per-node N
//               [--min-nodes A --max-nodes B] [--max-restarts R] -- CMD ARGS...
// or any torchrun command line with the program name changed:
// ductile agent [--standalone] [--nnodes MIN:MAX] [--nproc-per-node N]
//               [--rdzv-backend c10d|static|etcd|etcd-v2 --rdzv-endpoint HOST:PORT]
//               [--node-rank R --master-addr A --master-port P] [--rdzv-id ID]
//               [--rdzv-conf K=V,...] [--log-dir D -r S -t S] ... SCRIPT.py ARGS...
// The elastic agent of one node: this file parses argv and nothing else; the
// logic, torchrun's command line read into AgentOptions included, is in
// libductile_agent (torchrun_options.hpp; see docs/elastic-agent.md). Built
// into the agent program, not into `ductile` (main.cpp says why).
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>

#include <fmt/format.h>

#include "agent_command.hpp"
#include "ductile/agent/agent.hpp"
#include "ductile/agent/torchrun_options.hpp"
#include "ductile/agent/workers.hpp"

namespace ductile::cli {
namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
}

// A duration as the command line gives it, in seconds ("0.25", "2").
std::string in_seconds(std::chrono::milliseconds duration) {
  return fmt::format("{}", std::chrono::duration<double>(duration).count());
}

int run_agent_command(const CliContext& context, const agent::LaunchArguments& arguments,
                      const std::vector<std::string>& rest) {
  agent::AgentOptions a = agent::agent_options(arguments, rest);
  // Which Python runs the workers is said first: a wrong one shows before
  // the job starts.
  if (!a.interpreter_choice.empty())
    agent::write_line(true, fmt::format("ductile agent: the workers run {}", a.interpreter_choice));
  a.runtime = context.runtime_options();
  a.stop_signal = &g_stop_signal;
  struct sigaction action{};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return agent::run_agent(a);
}

}  // namespace

void register_agent_command(CLI::App& app, CliContext& context) {
  auto o = std::make_shared<agent::LaunchArguments>();
  // The defaults the help states: AgentOptions' and torchrun's, each stated
  // once (agent_options.hpp, torchrun_options.hpp).
  const agent::AgentOptions defaults;
  using Torchrun = agent::TorchrunDefaults;
  auto* sub = app.add_subcommand("agent", kAgentDescription);
  sub->add_option("--config", o->agent.config,
                  "ductile TOML configuration with an [elasticity] section, or a DeepSpeed JSON "
                  "config with an \"elasticity\" block (without: any node count of --nnodes, "
                  "as torchrun)");
  sub->add_option("--rdzv", o->agent.rdzv,
                  "etcd of the rendezvous: etcd://HOST:PORT, or https://HOST:PORT (TLS)");
  sub->add_option("--job-id", o->agent.job_id, "The job's name in etcd, the same on every node");
  sub->add_option("--rdzv-cacert", o->agent.tls.ca_file,
                  "TLS to etcd (--rdzv https://HOST:PORT): the CA that signed etcd's certificate "
                  "(PEM; default: the system's)");
  sub->add_option("--rdzv-cert", o->agent.tls.cert_file,
                  "TLS to etcd: this client's certificate (PEM), for etcd's --client-cert-auth");
  sub->add_option("--rdzv-key", o->agent.tls.key_file, "TLS to etcd: the client certificate's key");
  sub->add_option(
      "--nproc-per-node,--nproc_per_node", o->nproc_per_node,
      fmt::format("Workers on this node: a number, or cpu, gpu, auto (as torchrun; default {}); "
                  "at most {} (this machine's online cores x {})",
                  defaults.nproc_per_node, agent::max_workers_per_node(), agent::kWorkersPerCore));
  sub->add_option("--min-nodes", o->min_nodes,
                  fmt::format("Fewest nodes the job runs on (default {})", defaults.min_nodes));
  sub->add_option("--max-nodes", o->max_nodes,
                  "Most nodes the job runs on (default: as many as a valid world size can use)");
  sub->add_option("--max-restarts,--max_restarts", o->agent.max_restarts,
                  fmt::format("Group restarts after worker failures before the job fails, counted "
                              "for the whole job (default {}, as torchrun)",
                              defaults.max_restarts));
  sub->add_option("--node-addr", o->agent.node_addr,
                  "Address other nodes reach this one at, published as MASTER_ADDR when this "
                  "node leads (default: the host's fully qualified name, as torchrun)");
  sub->add_option("--node-id", o->agent.node_id, "This agent's name (default: host-pid-random)");
  sub->add_option("--snapshot-dir", o->agent.snapshot_dir,
                  "Directory where the agent keeps its workers' in-memory snapshots and the "
                  "replicas of other nodes' (default: /dev/shm when it is a directory, else the "
                  "system's temporary directory)");
  sub->add_flag("--mpi-world", o->agent.mpi_world,
                "Workers form one MPI world without mpirun (ductile's cpu backend, zero3): "
                "each agent runs an ompi-server (Open MPI), workers get DUCTILE_MPI_JOIN and "
                "OMPI_MCA_pmix_server_uri");
  sub->add_option("--lease-ttl", o->lease_ttl,
                  fmt::format("Seconds after which a dead agent's registration expires (default "
                              "{}; {} to {}). Every duration option takes 0 to {} seconds",
                              defaults.lease_ttl.count(), agent::kMinLeaseTtl.count(),
                              agent::kMaxDuration.count(), agent::kMaxDuration.count()));
  sub->add_option("--poll-interval", o->poll_interval,
                  fmt::format("Seconds between rendezvous reads (default {})",
                              in_seconds(defaults.poll_interval)));
  sub->add_option("--settle", o->settle,
                  fmt::format("Seconds without arrivals before a first or larger round forms "
                              "(default {})",
                              in_seconds(defaults.settle)));
  sub->add_option("--stop-grace", o->stop_grace,
                  fmt::format("Seconds between SIGTERM and SIGKILL when stopping workers (default "
                              "{})",
                              in_seconds(defaults.stop_grace)));
  sub->add_option("--store-timeout", o->store_timeout,
                  fmt::format("Seconds etcd may stay unreachable before the agent stops (default "
                              "{})",
                              in_seconds(defaults.store_timeout)));
  sub->add_option("--heartbeat", o->heartbeat,
                  fmt::format("Seconds a node's link to the leader may stay silent before its "
                              "lease is revoked and the others re-form without it (default {}; "
                              "{} to {}); a link that closes is acted on at once",
                              in_seconds(defaults.heartbeat), in_seconds(agent::kMinHeartbeat),
                              in_seconds(agent::kMaxHeartbeat)));
  sub->add_option("--min-time", o->min_time,
                  "Seconds before a scale-up after a (re)start; overrides the configuration's "
                  "min_time (minutes)");
  sub->add_option("--failure-grace", o->failure_grace,
                  "Seconds a worker failure waits for a lost node to explain it before it "
                  "counts as a restart (default: --lease-ttl; 0 with --standalone)");
  sub->add_option("--checkpoint-timeout", o->checkpoint_timeout,
                  fmt::format("Seconds the workers get to save before a planned re-form (a "
                              "scale-up, a node drained with SIGTERM; default {}); 0: re-form at "
                              "once. Workers see the request with "
                              "ductile.torch.elastic.should_checkpoint()",
                              in_seconds(defaults.checkpoint_timeout)));
  sub->add_flag("--warm-workers", o->warm_workers,
                "Keep a spare Python per local rank that has imported torch, torch._dynamo and "
                "the modules the script imports at its top level (read, not run; not those of "
                "the script's own folder) ahead of the next round, so that a restarted worker "
                "starts without those imports (the worker command must be a Python script or "
                "-m MODULE)");
  sub->add_option("--warm-imports", o->warm_imports,
                  fmt::format("Modules the spares import, separated by commas (default {} "
                              "and the script's top-level imports); given, only these; implies "
                              "--warm-workers",
                              agent::kDefaultWarmImports));
  // torchrun's options (docs/elastic-agent.md, "torchrun's command line").
  sub->add_option("--nnodes", o->nnodes, "torchrun: N or MIN:MAX nodes");
  sub->add_option("--rdzv-backend,--rdzv_backend", o->rdzv_backend,
                  fmt::format("torchrun: c10d (the agent on the endpoint's host serves the "
                              "rendezvous), static (--node-rank, --master-addr, --master-port), "
                              "etcd or etcd-v2 (an etcd: survives the loss of any node); default "
                              "{}",
                              Torchrun::rdzv_backend));
  sub->add_option("--rdzv-endpoint,--rdzv_endpoint", o->rdzv_endpoint,
                  fmt::format("torchrun: HOST[:PORT] of the rendezvous (c10d: default port {}; "
                              "etcd: the etcd's, as --rdzv etcd://HOST:PORT)",
                              Torchrun::c10d_port));
  sub->add_option(
      "--rdzv-id,--rdzv_id", o->rdzv_id,
      fmt::format("torchrun: the job id (as --job-id; default '{}')", Torchrun::rdzv_id));
  sub->add_option(
      "--rdzv-conf,--rdzv_conf", o->rdzv_conf,
      fmt::format("torchrun: key=value,...: join_timeout=S (or timeout; exit 1 when no round "
                  "took this node within S seconds, or when it waited S seconds with too few "
                  "nodes; default: wait without end), last_call_timeout (as --settle), "
                  "read_timeout, heartbeat (as --heartbeat), keep_alive_interval and "
                  "keep_alive_max_attempt "
                  "(their product, torchrun's time to declare a node dead, is the lease TTL, "
                  "as --lease-ttl; either alone takes torchrun's default for the other, {} s or "
                  "{} attempts; neither: --lease-ttl's default), protocol=https, cacert, cert, "
                  "key (as --rdzv-cacert ...)",
                  Torchrun::keep_alive_interval, Torchrun::keep_alive_max_attempt));
  sub->add_option("--monitor-interval,--monitor_interval", o->monitor_interval,
                  "torchrun: seconds between checks of the workers (as --poll-interval)");
  sub->add_option("--shutdown-timeout,--shutdown_timeout", o->shutdown_timeout,
                  "torchrun: seconds between SIGTERM and SIGKILL (as --stop-grace)");
  sub->add_option("--role", o->agent.role,
                  fmt::format("torchrun: the workers' ROLE_NAME (default '{}')", defaults.role));
  sub->add_option("--local-addr,--local_addr", o->local_addr, "torchrun: as --node-addr");
  sub->add_option("--signals-to-handle,--signals_to_handle", o->agent.signals_to_handle,
                  "torchrun: the workers' TORCHELASTIC_SIGNALS_TO_HANDLE");
  sub->add_flag("--no-python,--no_python", o->no_python,
                "torchrun: run the training script as is, not with Python. Without it the "
                "script runs under $PYTHON_EXEC; else the interpreter of the environment whose "
                "`ductile` console script ran the agent; else $VIRTUAL_ENV/bin/python; else "
                "python3 on PATH (the agent's first line names the one chosen, and why)");
  sub->add_flag("-m,--module", o->module, "torchrun: the training script is a Python module");
  sub->add_flag("--run-path,--run_path", o->run_path,
                "torchrun: run the script with python (the default here)");
  sub->add_flag("--standalone", o->standalone,
                "torchrun: one node with its own rendezvous (nothing else started)");
  sub->add_option("--node-rank,--node_rank", o->node_rank,
                  fmt::format("torchrun's static rendezvous: this node's rank (0 hosts the store; "
                              "default {})",
                              Torchrun::node_rank));
  sub->add_option("--master-addr,--master_addr", o->master_addr,
                  fmt::format("torchrun's static rendezvous: node rank 0's address (default {})",
                              Torchrun::master_addr));
  sub->add_option("--master-port,--master_port", o->master_port,
                  fmt::format("torchrun's static rendezvous: the port of node rank 0's store "
                              "(default {})",
                              Torchrun::master_port));
  sub->add_option("--log-dir,--log_dir", o->log_dir,
                  "torchrun: the workers' log files go to DIR/<rdzv-id>_XXXXXX/attempt_<restart "
                  "count>/<local rank>/ (with their error files)");
  sub->add_option("-r,--redirects", o->redirects,
                  "torchrun: streams to the log files only: 0 none, 1 stdout, 2 stderr, 3 both; "
                  "or per local rank, e.g. 0:1,1:2");
  sub->add_option("-t,--tee", o->tee,
                  "torchrun: streams to the log files and the console, each line prefixed "
                  "\"[<role><local rank>]:\" (as --redirects). Without --tee and --redirects "
                  "the workers write the agent's own stdout and stderr (a terminal stays one)");
  sub->add_option("--local-ranks-filter,--local_ranks_filter", o->local_ranks_filter,
                  "torchrun: only these local ranks' lines on the console, e.g. 0,1");
  sub->add_option("--start-method,--start_method", o->start_method,
                  "torchrun: spawn, fork or forkserver; a script is started as its own process "
                  "whatever the method (as torchrun starts one)")
      ->check(CLI::IsMember({"spawn", "fork", "forkserver"}));
  sub->add_option("--logs-specs,--logs_specs", o->logs_specs, "torchrun's: not available");
  sub->add_option("--event-log-handler,--event_log_handler", o->event_log_handler,
                  "torchrun's: only 'null'");
  sub->add_option("--numa-binding,--numa_binding", o->numa_binding, "torchrun's: not available");
  sub->add_option("--duplicate-stdout-filters,--duplicate_stdout_filters", o->duplicate_stdout,
                  "torchrun's: not available");
  sub->add_option("--duplicate-stderr-filters,--duplicate_stderr_filters", o->duplicate_stderr,
                  "torchrun's: not available");
  sub->add_flag("--virtual-local-rank,--virtual_local_rank", o->virtual_local_rank,
                "torchrun's: not available");
  // The worker command. CLI11 stops at the first word that is not an
  // option (prefix_command): what follows is the command, untouched, even
  // words that look like this command's options (a script's --config).
  // The positional is never filled (its check refuses every value); it
  // keeps '--' in this command, where remaining() shows it.
  sub->add_option("command",
                  "The worker command after '--', or the training script and its "
                  "arguments (as torchrun)")
      ->check(CLI::Validator([](std::string&) { return std::string("not an option"); }, "", ""));
  sub->validate_positionals();
  sub->prefix_command();
  sub->fallthrough(false);
  set_action(sub, context,
             [&context, o, sub] { return run_agent_command(context, *o, sub->remaining()); });
}

}  // namespace ductile::cli
