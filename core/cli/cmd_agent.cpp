// ductile agent --config FILE --rdzv etcd://HOST:PORT --job-id ID --nproc-per-node N
//               [--min-nodes A --max-nodes B] [--max-restarts R] -- CMD ARGS...
// The elastic agent of one node (the logic is in libductile_agent; see
// docs/elastic-agent.md).
// Boost.DLL on std::filesystem (no Boost.Filesystem library to link), as in
// the core's registry.
#define BOOST_DLL_USE_STD_FS 1

#include <signal.h>

#include <atomic>
#include <cmath>

#include <fmt/format.h>
#include <boost/dll/shared_library.hpp>

#include "cli_common.hpp"
#include "ductile/agent/agent.hpp"

namespace ductile::cli {
namespace {

std::atomic<int> g_stop_signal{0};

void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
}

struct AgentCliOptions {
  agent::AgentOptions agent;
  std::vector<std::string> command;
  std::int64_t max_nodes = -1;  // -1: not given
  std::int64_t lease_ttl = 5;
  double poll_interval = 0.25, settle = 2, stop_grace = 5, store_timeout = 30;
  double min_time = -1, failure_grace = -1;
};

std::chrono::milliseconds seconds_option(const char* name, double value) {
  if (!std::isfinite(value) || value < 0 || value > 1e6)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("{} {} is invalid: give seconds between 0 and 1000000", name, value));
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(value * 1000)));
}

// libductile_agent, from the directory of libductile_core (build tree and
// install prefix alike; an absolute path, since a sanitizer runtime that
// intercepts dlopen hides the CLI's run path), kept loaded until exit.
decltype(&ductile_agent_run) load_agent() {
  static boost::dll::shared_library library;
  const auto file = core::PluginRegistry::core_library_dir() / DUCTILE_AGENT_LIBRARY;
  std::error_code ec;
  library.load(file, boost::dll::load_mode::rtld_now, ec);
  if (ec || !library.has(kDuctileAgentEntry))
    throw Error(ErrorKind::internal,
                fmt::format("cannot load the agent library {}: {}; is ductile installed "
                            "completely?",
                            file.string(), ec ? ec.message() : "no entry point"));
  return &library.get<int(const agent::AgentOptions*)>(kDuctileAgentEntry);
}

int run_agent_command(const CliContext& context, AgentCliOptions& o) {
  auto& a = o.agent;
  a.command = o.command;
  if (o.max_nodes != -1) a.max_nodes = o.max_nodes;
  a.lease_ttl = std::chrono::seconds(o.lease_ttl);
  a.poll_interval = seconds_option("--poll-interval", o.poll_interval);
  a.settle = seconds_option("--settle", o.settle);
  a.stop_grace = seconds_option("--stop-grace", o.stop_grace);
  a.store_timeout = seconds_option("--store-timeout", o.store_timeout);
  if (o.min_time != -1) a.min_time = seconds_option("--min-time", o.min_time);
  if (o.failure_grace != -1) a.failure_grace = seconds_option("--failure-grace", o.failure_grace);
  a.runtime = context.runtime_options();
  a.stop_signal = &g_stop_signal;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return load_agent()(&a);
}

}  // namespace

void register_agent_command(CLI::App& app, CliContext& context) {
  auto o = std::make_shared<AgentCliOptions>();
  auto* sub = app.add_subcommand(
      "agent",
      "Run this node's workers as part of an elastic job: rendezvous on etcd, world sizes "
      "chosen by the configuration's elasticity policy, restarts on membership changes and "
      "failures");
  sub->add_option("--config", o->agent.config,
                  "ductile TOML configuration with an [elasticity] section, or a DeepSpeed JSON "
                  "config with an \"elasticity\" block")
      ->required();
  sub->add_option("--rdzv", o->agent.rdzv, "etcd of the rendezvous: etcd://HOST:PORT")->required();
  sub->add_option("--job-id", o->agent.job_id, "The job's name in etcd, the same on every node")
      ->required();
  sub->add_option("--nproc-per-node", o->agent.nproc_per_node, "Workers on this node")->required();
  sub->add_option("--min-nodes", o->agent.min_nodes, "Fewest nodes the job runs on (default 1)");
  sub->add_option("--max-nodes", o->max_nodes,
                  "Most nodes the job runs on (default: as many as a valid world size can use)");
  sub->add_option("--max-restarts", o->agent.max_restarts,
                  "Group restarts after worker failures before the job fails (default 3)");
  sub->add_option("--node-addr", o->agent.node_addr,
                  "Address other nodes reach this one at, published as MASTER_ADDR when this "
                  "node leads (default: the host name)");
  sub->add_option("--node-id", o->agent.node_id, "This agent's name (default: host-pid-random)");
  sub->add_flag("--mpi-world", o->agent.mpi_world,
                "Workers form one MPI world without mpirun (ductile's cpu backend, zero3): "
                "each agent runs an ompi-server (Open MPI), workers get DUCTILE_MPI_JOIN and "
                "OMPI_MCA_pmix_server_uri");
  sub->add_option("--lease-ttl", o->lease_ttl,
                  "Seconds after which a dead agent's registration expires (default 5, >= 2)");
  sub->add_option("--poll-interval", o->poll_interval,
                  "Seconds between rendezvous reads (default 0.25)");
  sub->add_option("--settle", o->settle,
                  "Seconds without arrivals before a first or larger round forms (default 2)");
  sub->add_option("--stop-grace", o->stop_grace,
                  "Seconds between SIGTERM and SIGKILL when stopping workers (default 5)");
  sub->add_option("--store-timeout", o->store_timeout,
                  "Seconds etcd may stay unreachable before the agent stops (default 30)");
  sub->add_option("--min-time", o->min_time,
                  "Seconds before a scale-up after a (re)start; overrides the configuration's "
                  "min_time (minutes)");
  sub->add_option("--failure-grace", o->failure_grace,
                  "Seconds a worker failure waits for a lost node to explain it before it "
                  "counts as a restart (default: --lease-ttl)");
  sub->add_option("command", o->command, "The worker command, after '--'");
  set_action(sub, context, [&context, o] { return run_agent_command(context, *o); });
}

}  // namespace ductile::cli
