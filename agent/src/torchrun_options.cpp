// torchrun's command line read into the agent's options (see
// torchrun_options.hpp and docs/elastic-agent.md, "torchrun's command line").
#include "ductile/agent/torchrun_options.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <random>
#include <thread>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "agent_common.hpp"
#include "ductile/agent/records.hpp"
#include "ductile/core/text.hpp"
#include "ductile/error.hpp"

namespace ductile::agent {
namespace {

using Defaults = TorchrunDefaults;

// What --rdzv-conf says besides the agent's options.
struct RdzvConf {
  std::string protocol;         // http or https
  std::optional<bool> is_host;  // c10d: this agent hosts the rendezvous
};

// Escaped: a value with a newline or an escape sequence stays on its line
// and acts on no terminal.
[[noreturn]] void bad(const std::string& message) {
  throw Error(ErrorKind::invalid_argument, core::printable(message, false));
}

std::chrono::milliseconds seconds_option(const std::string& name, double value) {
  if (!std::isfinite(value) || value < 0 || value > static_cast<double>(kMaxDuration.count()))
    bad(fmt::format("{} {} is invalid: give seconds from 0 to {}", name, value,
                    kMaxDuration.count()));
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::llround(value * 1000)));
}

// All of `text` read as a number (an integer when T is one), else nullopt.
template <class T>
std::optional<T> number(const std::string& text) {
  std::size_t used = 0;
  try {
    const T value = std::is_integral_v<T> ? static_cast<T>(std::stoll(text, &used))
                                          : static_cast<T>(std::stod(text, &used));
    if (used == text.size() && !text.empty()) return value;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

std::int64_t whole_number(const std::string& what, const std::string& text) {
  const auto value = number<std::int64_t>(text);
  if (!value || *value < 0) bad(fmt::format("{} '{}' is invalid: give a whole number", what, text));
  return *value;
}

double seconds_text(const std::string& what, const std::string& text) {
  const auto value = number<double>(text);
  if (!value || !std::isfinite(*value) || *value < 0 ||
      *value > static_cast<double>(kMaxDuration.count()))
    bad(fmt::format("{} '{}' is invalid: give seconds from 0 to {}", what, text,
                    kMaxDuration.count()));
  return *value;
}

// GPUs this process may use: CUDA_VISIBLE_DEVICES's entries, else the
// NVIDIA driver's.
std::int64_t visible_gpus() {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    std::string list = visible;
    if (list.empty()) return 0;
    return 1 + static_cast<std::int64_t>(std::count(list.begin(), list.end(), ','));
  }
  std::error_code ec;
  std::int64_t n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/driver/nvidia/gpus", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

// torchrun's --nproc-per-node: a number, cpu, gpu or auto.
std::int64_t workers_per_node(const std::string& text) {
  if (text == "cpu") return std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  if (text == "gpu") {
    if (std::int64_t gpus = visible_gpus(); gpus > 0) return gpus;
    bad("--nproc-per-node gpu: this node has no GPU (none in CUDA_VISIBLE_DEVICES or "
        "/proc/driver/nvidia/gpus); give a number or cpu");
  }
  if (text == "auto") {
    std::int64_t gpus = visible_gpus();
    return gpus > 0 ? gpus : std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  }
  const auto value = number<std::int64_t>(text);
  const std::int64_t cap = max_workers_per_node();
  if (!value || *value < 1 || *value > cap)
    bad(
        fmt::format("--nproc-per-node '{}' is invalid: give the number of workers of this node, "
                    "1 to {} (this machine's {} online cores x {}), or cpu, gpu or auto",
                    text, cap, cap / kWorkersPerCore, kWorkersPerCore));
  return *value;
}

// torchrun's --rdzv-conf: key=value pairs separated by commas.
void apply_rdzv_conf(const std::string& text, LaunchArguments& o, RdzvConf& rdzv) {
  std::map<std::string, std::string> conf;
  for (const auto& pair : split(text, ',')) {
    if (pair.empty()) continue;
    auto eq = pair.find('=');
    if (eq == std::string::npos || eq == 0)
      bad(fmt::format("--rdzv-conf '{}': '{}' is not key=value", text, pair));
    conf[pair.substr(0, eq)] = pair.substr(eq + 1);
  }
  std::optional<double> keep_alive_interval;
  std::optional<std::int64_t> keep_alive_attempts;
  for (const auto& [key, value] : conf) {
    std::string what = "--rdzv-conf " + key;
    if (key == "join_timeout" || key == "timeout") {
      o.agent.join_timeout = seconds_option(what, seconds_text(what, value));
    } else if (key == "last_call_timeout") {
      o.settle = seconds_text(what, value);
    } else if (key == "read_timeout") {
      o.agent.request_timeout = seconds_option(what, seconds_text(what, value));
      if (o.agent.request_timeout.count() == 0)
        bad(fmt::format("{}={} is invalid: give seconds > 0", what, value));
    } else if (key == "heartbeat") {
      const double given = seconds_text(what, value);
      if (o.heartbeat && *o.heartbeat != given)
        bad(fmt::format("{}={} and --heartbeat {} differ: give one of them", what, value,
                        *o.heartbeat));
      o.heartbeat = given;
    } else if (key == "keep_alive_interval") {
      keep_alive_interval = seconds_text(what, value);
    } else if (key == "keep_alive_max_attempt") {
      keep_alive_attempts = whole_number(what, value);
    } else if (key == "protocol") {
      if (value != "http" && value != "https")
        bad(fmt::format("{}={} is invalid: give http or https", what, value));
      rdzv.protocol = value;
    } else if (key == "is_host") {
      // torchrun's c10d: whether this agent hosts the rendezvous' store.
      std::string v = value;
      std::transform(v.begin(), v.end(), v.begin(),
                     [](unsigned char c) { return std::tolower(c); });
      if (v == "1" || v == "true" || v == "t" || v == "yes" || v == "y")
        rdzv.is_host = true;
      else if (v == "0" || v == "false" || v == "f" || v == "no" || v == "n")
        rdzv.is_host = false;
      else
        bad(fmt::format("{}={} is invalid: give true or false", what, value));
    } else if (key == "cacert" || key == "cert" || key == "key") {
      // torch's etcd rendezvous' names for the TLS files.
      std::string& file = key == "cacert" ? o.agent.tls.ca_file
                          : key == "cert" ? o.agent.tls.cert_file
                                          : o.agent.tls.key_file;
      if (!file.empty() && file != value)
        bad(fmt::format("{} and --rdzv-{} differ: give one of them", what, key));
      file = value;
    } else {
      bad(fmt::format(
          "--rdzv-conf key '{}' is not one ductile agent takes: give join_timeout "
          "(or timeout), last_call_timeout, read_timeout, heartbeat, "
          "keep_alive_interval, keep_alive_max_attempt, is_host, protocol, cacert, cert, key",
          key));
    }
  }
  if (keep_alive_interval || keep_alive_attempts) {
    // torchrun declares a node dead after interval x attempts without a
    // heartbeat; the agent's lease TTL means the same.
    double ttl =
        keep_alive_interval.value_or(Defaults::keep_alive_interval) *
        static_cast<double>(keep_alive_attempts.value_or(Defaults::keep_alive_max_attempt));
    if (ttl > static_cast<double>(kMaxDuration.count()))
      bad(
          fmt::format("--rdzv-conf keep_alive_interval x keep_alive_max_attempt is {} seconds: "
                      "give at most {} in all (it is the lease TTL, as --lease-ttl)",
                      ttl, kMaxDuration.count()));
    if (!o.lease_ttl)
      o.lease_ttl = std::max<std::int64_t>(kMinLeaseTtl.count(), std::llround(std::ceil(ttl)));
  }
}

// torchrun's --nnodes: N or MIN:MAX.
void apply_nnodes(const std::string& text, LaunchArguments& o) {
  auto colon = text.find(':');
  std::string low = text.substr(0, colon);
  std::string high = colon == std::string::npos ? low : text.substr(colon + 1);
  std::int64_t min = whole_number("--nnodes", low), max = whole_number("--nnodes", high);
  if (min < 1 || max < min || max > kMaxCount)
    bad(fmt::format("--nnodes '{}' is invalid: give N or MIN:MAX with 1 <= MIN <= MAX <= {}", text,
                    kMaxCount));
  if (o.min_nodes || o.max_nodes)
    bad("--nnodes and --min-nodes/--max-nodes say the same: give one of them");
  o.min_nodes = min;
  o.max_nodes = max;
}

// HOST[:PORT] (or [IPv6]:PORT), as torch's parse_rendezvous_endpoint reads
// it; `default_port` when the port is left out.
std::pair<std::string, int> host_and_port(const std::string& option, const std::string& endpoint,
                                          int default_port) {
  std::string host = endpoint, port_text;
  if (host.starts_with("[")) {
    auto close = host.find(']');
    if (close == std::string::npos)
      bad(fmt::format("{} '{}' is invalid: give HOST:PORT", option, endpoint));
    port_text = close + 1 < host.size() && host[close + 1] == ':' ? host.substr(close + 2) : "";
    host = host.substr(1, close - 1);
  } else if (auto colon = host.rfind(':'); colon != std::string::npos) {
    port_text = host.substr(colon + 1);
    host = host.substr(0, colon);
  }
  int port = default_port;
  if (!port_text.empty()) {
    const auto value = number<std::int64_t>(port_text);
    if (!value || *value < 0 || *value > 65535)
      bad(fmt::format("{} '{}' is invalid: the port must be 0 to 65535", option, endpoint));
    port = static_cast<int>(*value);
  }
  if (host.empty() || host.find_first_of(" /,@") != std::string::npos)
    bad(fmt::format("{} '{}' is invalid: give HOST:PORT", option, endpoint));
  return {host, port};
}

// A run id as torchrun makes one for --standalone (uuid4).
std::string random_run_id() {
  std::random_device random;
  std::uint32_t words[4] = {random(), random(), random(), random()};
  words[1] = (words[1] & 0xffff0fffu) | 0x00004000u;  // version 4
  words[2] = (words[2] & 0x3fffffffu) | 0x80000000u;  // variant 1
  return fmt::format("{:08x}-{:04x}-{:04x}-{:04x}-{:04x}{:08x}", words[0], words[1] >> 16,
                     words[1] & 0xffff, words[2] >> 16, words[2] & 0xffff, words[3]);
}

// torchrun's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the workers' store is
// rank 0's, not the agent's (its dynamic rendezvous backends).
bool agent_store_shared() {
  const char* disabled = std::getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE");
  return !(disabled && std::string(disabled) == "1");
}

// The rendezvous, from ductile's --rdzv etcd://HOST:PORT or torchrun's
// options, as torchrun 2.13 reads them (run.py's run() and
// config_from_args()).
void apply_rendezvous(LaunchArguments& o, const RdzvConf& rdzv) {
  auto& a = o.agent;
  const std::int64_t max_nodes =
      o.max_nodes ? *o.max_nodes : std::max<std::int64_t>(1, a.min_nodes);
  const bool torchrun_spelling = a.rdzv.empty();
  if (!a.rdzv.empty() && (!o.rdzv_endpoint.empty() || o.standalone ||
                          !(o.rdzv_backend.empty() || o.rdzv_backend.starts_with("etcd"))))
    bad("--rdzv (an etcd) and torchrun's --rdzv-endpoint, --rdzv-backend or --standalone say "
        "the same: give one of them");
  if (!o.rdzv_id.empty()) {
    if (!a.job_id.empty() && a.job_id != o.rdzv_id)
      bad(fmt::format("--job-id '{}' and --rdzv-id '{}' differ: give one of them", a.job_id,
                      o.rdzv_id));
    a.job_id = o.rdzv_id;
  }
  std::string backend = o.rdzv_backend.empty() ? Defaults::rdzv_backend : o.rdzv_backend;
  // One node without a rendezvous: torchrun makes it a standalone one.
  if (torchrun_spelling && backend == "static" && o.rdzv_endpoint.empty() && !o.master_port &&
      max_nodes == 1)
    o.standalone = true;
  const bool static_rdzv = torchrun_spelling && !o.standalone && backend == "static";
  if (!static_rdzv && o.node_rank && *o.node_rank != Defaults::node_rank)
    std::fprintf(stderr,
                 "ductile agent: --node-rank is used by a static rendezvous only (as torchrun "
                 "uses it); ignored: the rendezvous ranks the nodes\n");
  if (!static_rdzv && (!o.master_addr.empty() || o.master_port))
    std::fprintf(stderr,
                 "ductile agent: --master-addr and --master-port are used by a static "
                 "rendezvous only (as torchrun uses them); ignored: the leading agent publishes "
                 "MASTER_ADDR and MASTER_PORT\n");
  if (o.standalone) {
    // torchrun: c10d on localhost:0 with a new run id, whatever else is
    // given; here the agent's own store, nothing served for it.
    if (max_nodes != 1)
      bad(
          fmt::format("--standalone runs one node, and --nnodes asks for up to {}: leave "
                      "--nnodes out, or give a rendezvous every node reaches (--rdzv-backend "
                      "c10d --rdzv-endpoint HOST:PORT)",
                      max_nodes));
    a.rendezvous = RendezvousKind::embedded;
    a.job_id = random_run_id();
    a.agent_store = agent_store_shared();
    return;
  }
  if (a.job_id.empty() && torchrun_spelling) a.job_id = Defaults::rdzv_id;
  if (!a.rdzv.empty()) {
    a.rendezvous = RendezvousKind::etcd;
    a.agent_store = true;
    if (a.job_id.empty()) bad("no job id: give --job-id ID (or torchrun's --rdzv-id ID)");
    return;
  }
  if (backend == "static") {
    const std::string endpoint =
        !o.rdzv_endpoint.empty()
            ? o.rdzv_endpoint
            : fmt::format("{}:{}", o.master_addr.empty() ? Defaults::master_addr : o.master_addr,
                          o.master_port.value_or(Defaults::master_port));
    auto [host, port] = host_and_port(
        o.rdzv_endpoint.empty() ? "--master-addr/--master-port" : "--rdzv-endpoint", endpoint, -1);
    if (port <= 0)
      bad(
          fmt::format("a static rendezvous needs the port of node rank 0's store: give "
                      "--master-port (or --rdzv-endpoint {}:PORT)",
                      host));
    const std::int64_t node_rank = o.node_rank.value_or(Defaults::node_rank);
    if (node_rank < 0 || node_rank >= max_nodes)
      bad(fmt::format("--node-rank {} is invalid for --nnodes {}: give 0 to {}", node_rank,
                      max_nodes, max_nodes - 1));
    // torchrun's static rendezvous waits for --nnodes' maximum.
    a.min_nodes = a.max_nodes.emplace(max_nodes);
    a.agent_store = true;
    a.master_addr = host;
    a.master_port = port;
    if (max_nodes == 1) {
      a.rendezvous = RendezvousKind::embedded;
      return;
    }
    a.rendezvous = RendezvousKind::hosted;
    a.rdzv_name = "static";
    a.rdzv_host = host;
    a.rdzv_port = port;
    a.node_rank = node_rank;
    a.hosting = node_rank == 0 ? Hosting::always : Hosting::never;
    return;
  }
  if (backend == "c10d") {
    if (o.rdzv_endpoint.empty())
      bad("--rdzv-backend c10d needs the rendezvous' host: give --rdzv-endpoint HOST[:PORT] (a "
          "node every node reaches; its agent serves the rendezvous)");
    auto [host, port] = host_and_port("--rdzv-endpoint", o.rdzv_endpoint, Defaults::c10d_port);
    a.agent_store = agent_store_shared();
    if (port == 0) {
      // torchrun binds a free port: only this node can know it.
      if (max_nodes != 1)
        bad(
            fmt::format("--rdzv-endpoint '{}': port 0 (a free port) serves one node only, and "
                        "--nnodes asks for up to {}; give a port every node reaches",
                        o.rdzv_endpoint, max_nodes));
      a.rendezvous = RendezvousKind::embedded;
      return;
    }
    a.rendezvous = RendezvousKind::hosted;
    a.rdzv_name = "c10d";
    a.rdzv_host = host;
    a.rdzv_port = port;
    a.hosting = !rdzv.is_host   ? Hosting::if_local
                : *rdzv.is_host ? Hosting::always
                                : Hosting::never;
    return;
  }
  if (backend == "etcd" || backend == "etcd-v2" || backend == "etcd-v3") {
    if (o.rdzv_endpoint.empty())
      bad(fmt::format("--rdzv-backend {} needs the etcd: give --rdzv-endpoint HOST:PORT", backend));
    a.rendezvous = RendezvousKind::etcd;
    a.rdzv = o.rdzv_endpoint.find("://") == std::string::npos
                 ? (rdzv.protocol == "https" ? "https://" : "etcd://") + o.rdzv_endpoint
                 : o.rdzv_endpoint;
    if (!rdzv.protocol.empty() && a.rdzv.starts_with("https://") != (rdzv.protocol == "https"))
      bad(fmt::format("--rdzv-conf protocol={} and the endpoint {} differ: give one of them",
                      rdzv.protocol, a.rdzv));
    // torchrun's etcd handler leaves the store to rank 0's worker; its
    // etcd-v2 (a dynamic rendezvous) shares the agent's.
    a.agent_store = backend != "etcd" && agent_store_shared();
    return;
  }
  bad(
      fmt::format("--rdzv-backend '{}' is not one ductile agent takes: give c10d (an agent hosts "
                  "the rendezvous), static (with --node-rank, --master-addr, --master-port), "
                  "etcd or etcd-v2 (an etcd: survives the loss of any node), or --standalone",
                  o.rdzv_backend));
}

// torchrun's --redirects / --tee: 0-3 for every local rank, or
// LOCAL_RANK:STREAMS,... for some.
StreamsByRank streams_option(const std::string& option, const std::string& text) {
  StreamsByRank out;
  auto digit = [&](const std::string& v) {
    if (v.size() != 1 || v[0] < '0' || v[0] > '3')
      bad(
          fmt::format("{} '{}' is invalid: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both), "
                      "for every local rank or as LOCAL_RANK:N,... (e.g. 0:1,1:2)",
                      option, text));
    return v[0] - '0';
  };
  if (text.find(':') == std::string::npos) {
    out.all = digit(text);
    return out;
  }
  for (const auto& pair : split(text, ',')) {
    auto colon = pair.find(':');
    if (colon == std::string::npos) digit("");
    out.by_rank[whole_number(option + " local rank", pair.substr(0, colon))] =
        digit(pair.substr(colon + 1));
  }
  return out;
}

void apply_output_options(LaunchArguments& o) {
  auto& out = o.agent.output;
  out.log_dir = o.log_dir;
  if (!o.redirects.empty()) out.redirects = streams_option("--redirects", o.redirects);
  if (!o.tee.empty()) out.tee = streams_option("--tee", o.tee);
  if (!o.local_ranks_filter.empty()) {
    out.console_ranks.emplace();
    for (const auto& rank : split(o.local_ranks_filter, ','))
      out.console_ranks->insert(whole_number("--local-ranks-filter", rank));
  }
  // torchrun's options that have no meaning here: say what to use.
  if (!o.logs_specs.empty())
    bad(
        fmt::format("--logs-specs '{}' names a Python class torchrun loads; ductile agent writes "
                    "the workers' logs itself: use --log-dir with --redirects or --tee",
                    o.logs_specs));
  if (!o.event_log_handler.empty() && o.event_log_handler != "null")
    bad(
        fmt::format("--event-log-handler '{}' names a Python handler torchrun loads; ductile "
                    "agent logs its events to its stderr (leave the option out)",
                    o.event_log_handler));
  if (!o.numa_binding.empty())
    bad(
        fmt::format("--numa-binding {} is not available: run the workers under numactl "
                    "(--no-python numactl --cpunodebind=N python3 -u train.py)",
                    o.numa_binding));
  if (!o.duplicate_stdout.empty() || !o.duplicate_stderr.empty())
    bad("--duplicate-stdout-filters and --duplicate-stderr-filters are not available: use "
        "--tee with --log-dir and filter the log files");
  if (o.virtual_local_rank)
    bad("--virtual-local-rank is not available: the workers get their LOCAL_RANK; choose a GPU "
        "with it (torch.cuda.set_device(LOCAL_RANK))");
}

// The workers' Python, and why: $PYTHON_EXEC (as torchrun); else the
// interpreter of the environment whose `ductile` console script ran the
// agent (torchrun runs its own sys.executable); else an active virtual
// environment's bin/python; else python3 on PATH.
std::pair<std::string, std::string> workers_python() {
  if (const char* exec = std::getenv("PYTHON_EXEC"); exec && *exec) return {exec, "$PYTHON_EXEC"};
  if (const char* console = std::getenv("DUCTILE_CONSOLE_PYTHON"); console && *console)
    return {console, "the interpreter whose `ductile` console script ran the agent"};
  if (const char* venv = std::getenv("VIRTUAL_ENV"); venv && *venv) {
    const std::string python = (std::filesystem::path(venv) / "bin" / "python").string();
    if (runnable_file(python)) return {python, "the active virtual environment, $VIRTUAL_ENV"};
  }
  const char* path = std::getenv("PATH");
  const std::string dirs = path ? path : "";
  if (auto python = found_on_path("python3", dirs); !python.empty())
    return {python, "python3 on PATH"};
  bad(
      fmt::format("no Python for the workers: PYTHON_EXEC and VIRTUAL_ENV are unset and PATH "
                  "'{}' has no python3; set PYTHON_EXEC to the interpreter, run the agent with "
                  "the `ductile` of the training environment, or give --no-python",
                  dirs));
}

// The worker command: after '--' as given; else torchrun's training script
// and its arguments, run as torchrun runs them (the workers' Python, -u,
// -m for --module; as given with --no-python).
std::vector<std::string> worker_command(const std::vector<std::string>& rest,
                                        const LaunchArguments& o, std::string& interpreter_choice) {
  if (!rest.empty() && rest.front() == "--")
    return std::vector<std::string>(rest.begin() + 1, rest.end());
  if (!rest.empty() && rest.front().starts_with("-"))
    bad(
        fmt::format("'{}' is not an option of ductile agent (run 'ductile agent --help'); the "
                    "worker command goes after '--' or, as with torchrun, starts with the "
                    "training script",
                    rest.front()));
  if (rest.empty() || o.no_python) {
    if (o.module) bad("--no-python and --module cannot be given together (as with torchrun)");
    return rest;
  }
  auto [python, why] = workers_python();
  interpreter_choice = fmt::format("{} ({})", python, why);
  std::vector<std::string> command = {python, "-u"};
  if (o.module) command.push_back("-m");
  command.insert(command.end(), rest.begin(), rest.end());
  return command;
}

}  // namespace

AgentOptions agent_options(const LaunchArguments& arguments, const std::vector<std::string>& rest) {
  LaunchArguments o = arguments;
  auto& a = o.agent;
  RdzvConf rdzv;
  if (!o.nnodes.empty()) apply_nnodes(o.nnodes, o);
  if (!o.rdzv_conf.empty()) apply_rdzv_conf(o.rdzv_conf, o, rdzv);
  if (o.min_nodes) a.min_nodes = *o.min_nodes;
  if (o.max_nodes) a.max_nodes = *o.max_nodes;
  apply_rendezvous(o, rdzv);
  apply_output_options(o);
  if (o.nproc_per_node) a.nproc_per_node = workers_per_node(*o.nproc_per_node);
  if (!o.local_addr.empty()) {
    if (!a.node_addr.empty() && a.node_addr != o.local_addr)
      bad("--node-addr and --local-addr differ: give one of them");
    a.node_addr = o.local_addr;
  }
  a.command = worker_command(rest, o, a.interpreter_choice);
  if (o.lease_ttl) a.lease_ttl = std::chrono::seconds(*o.lease_ttl);
  if (o.poll_interval || o.monitor_interval) {
    a.poll_interval = seconds_option(o.monitor_interval ? "--monitor-interval" : "--poll-interval",
                                     o.poll_interval ? *o.poll_interval : *o.monitor_interval);
    if (a.poll_interval.count() == 0) bad("--poll-interval (--monitor-interval) must be > 0");
  }
  if (o.settle) a.settle = seconds_option("--settle", *o.settle);
  if (o.shutdown_timeout)
    a.stop_grace = seconds_option("--shutdown-timeout", *o.shutdown_timeout);
  else if (o.stop_grace)
    a.stop_grace = seconds_option("--stop-grace", *o.stop_grace);
  if (o.store_timeout) a.store_timeout = seconds_option("--store-timeout", *o.store_timeout);
  if (o.min_time) a.min_time = seconds_option("--min-time", *o.min_time);
  if (o.heartbeat) a.heartbeat = seconds_option("--heartbeat", *o.heartbeat);
  if (o.failure_grace) a.failure_grace = seconds_option("--failure-grace", *o.failure_grace);
  if (o.checkpoint_timeout)
    a.checkpoint_timeout = seconds_option("--checkpoint-timeout", *o.checkpoint_timeout);
  if (o.warm_workers || o.warm_imports) {
    a.warm_imports = split(o.warm_imports.value_or(kDefaultWarmImports), ',');
    // A list given is the whole list: a module that reads the round's
    // variables as it is imported can be kept out.
    a.warm_program_imports = !o.warm_imports;
  }
  return a;
}

}  // namespace ductile::agent
