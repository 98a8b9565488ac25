// The agent's options checked, each against what is valid (see
// agent_options.hpp).
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <string_view>

#include <fmt/format.h>

#include "agent_common.hpp"
#include "ductile/agent/agent_options.hpp"
#include "ductile/core/text.hpp"
#include "ductile/error.hpp"

namespace ductile::agent {

using std::chrono::milliseconds;

namespace {

std::string env_path() {
  // Unset: the worker's search path (workers.cpp).
  const char* path = std::getenv("PATH");
  return path ? path : "/usr/local/bin:/usr/bin:/bin";
}

// A Python module name: identifiers separated by dots.
bool module_name(const std::string& name) {
  bool start = true;
  for (char c : name) {
    if (c == '.') {
      if (start) return false;
      start = true;
      continue;
    }
    const bool letter = std::isalpha(static_cast<unsigned char>(c)) || c == '_';
    if (!letter && (start || !std::isdigit(static_cast<unsigned char>(c)))) return false;
    start = false;
  }
  return !start;
}

}  // namespace

bool runnable_file(const std::string& file) {
  std::error_code ec;
  return access(file.c_str(), X_OK) == 0 && std::filesystem::is_regular_file(file, ec);
}

std::string found_on_path(const std::string& name, const std::string& dirs) {
  for (const auto& dir : split(dirs, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (runnable_file(candidate)) return candidate;
  }
  return "";
}

std::size_t interpreter_words(const std::vector<std::string>& command, bool chosen) {
  auto refuse = [&](const std::string& why) {
    const std::string words = core::join(command, " ");
    throw Error(ErrorKind::invalid_argument,
                core::printable(fmt::format("--warm-workers: the worker command '{}' {}; give a "
                                            "Python script or -m MODULE (ductile agent "
                                            "--warm-workers train.py, or -- python3 -u train.py)",
                                            excerpt(words), why),
                                false));
  };
  const std::string program =
      command.empty() ? "" : std::filesystem::path(command.front()).filename().string();
  const bool python_name = program.starts_with("python") &&
                           std::all_of(program.begin() + 6, program.end(),
                                       [](char c) { return std::isdigit(c) || c == '.'; });
  if (!chosen && !python_name)
    refuse("does not start with a Python interpreter (python, python3 or python3.N)");
  // The interpreter's options a spare started with them takes as they are.
  constexpr std::string_view kFlags = "bBdEIOPqsSuv";
  for (std::size_t i = 1; i < command.size(); ++i) {
    const std::string& word = command[i];
    if (word == "-") refuse("reads the program from stdin");
    if (word[0] != '-' || word.starts_with("-m")) return i;  // the script, or -m MODULE
    if (word == "-X" || word == "-W") {
      ++i;  // its argument
      continue;
    }
    if (word.starts_with("-X") || word.starts_with("-W")) continue;
    for (char c : word.substr(1)) {
      if (c == 'c') refuse("runs -c code");
      if (kFlags.find(c) == std::string_view::npos)
        refuse(
            fmt::format("gives the Python option '{}', which a spare cannot take (valid: "
                        "-{}, -W ARG, -X OPT)",
                        excerpt(word), kFlags));
    }
  }
  refuse("names no script or -m MODULE");
  return 0;  // not reached
}

std::int64_t max_workers_per_node() {
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  return std::max<long>(cores, 1) * kWorkersPerCore;
}

void check_options(const AgentOptions& o) {
  // Escaped: a value with a newline or an escape sequence stays on its line
  // and acts on no terminal.
  auto bad = [](const std::string& message) {
    throw Error(ErrorKind::invalid_argument, core::printable(message, false));
  };
  auto id_option = [&](const char* option, const std::string& id) {
    if (!valid_node_id(id))
      bad(fmt::format("{} '{}' is invalid: use 1 to {} letters, digits, '.', '_' and '-'", option,
                      excerpt(id), kMaxNodeIdChars));
  };
  id_option("--job-id", o.job_id);
  if (!o.node_id.empty()) id_option("--node-id", o.node_id);
  if (const std::int64_t cap = max_workers_per_node();
      o.nproc_per_node < 1 || o.nproc_per_node > cap)
    bad(
        fmt::format("--nproc-per-node {} is invalid: give 1 to {} workers (this machine's {} "
                    "online cores x {})",
                    o.nproc_per_node, cap, cap / kWorkersPerCore, kWorkersPerCore));
  if (o.min_nodes < 1 || o.min_nodes > kMaxCount)
    bad(fmt::format("--min-nodes {} is invalid: give 1 to {}", o.min_nodes, kMaxCount));
  if (o.max_nodes && (*o.max_nodes < 1 || *o.max_nodes < o.min_nodes || *o.max_nodes > kMaxCount))
    bad(fmt::format("--max-nodes {} is invalid: give --min-nodes ({}) to {}", *o.max_nodes,
                    o.min_nodes, kMaxCount));
  if (o.max_restarts < 0 || o.max_restarts > kMaxCount)
    bad(fmt::format("--max-restarts {} is invalid: give 0 to {}", o.max_restarts, kMaxCount));
  if (o.command.empty())
    bad("no worker command: give it after '--', e.g. ductile agent ... -- python3 train.py");
  if (o.lease_ttl < kMinLeaseTtl || o.lease_ttl > kMaxDuration)
    bad(fmt::format(
        "--lease-ttl {} is invalid: give {} to {} seconds (etcd leases last at least "
        "{})",
        o.lease_ttl.count(), kMinLeaseTtl.count(), kMaxDuration.count(), kMinLeaseTtl.count()));
  // Each duration by the name the command line gives it; `positive`: 0 is
  // not valid either.
  auto duration = [&](const char* name, milliseconds value, bool positive) {
    if (value < milliseconds(positive ? 1 : 0) || value > kMaxDuration)
      bad(fmt::format("{} {} is invalid: give seconds from {} to {}", name,
                      std::chrono::duration<double>(value).count(), positive ? "0.001" : "0",
                      kMaxDuration.count()));
  };
  duration("--poll-interval", o.poll_interval, true);
  duration("--settle", o.settle, false);
  duration("--stop-grace", o.stop_grace, false);
  duration("--store-timeout", o.store_timeout, true);
  duration("--rdzv-conf read_timeout", o.request_timeout, true);
  duration("--checkpoint-timeout", o.checkpoint_timeout, false);
  if (o.join_timeout) duration("--rdzv-conf join_timeout", *o.join_timeout, true);
  if (o.heartbeat < kMinHeartbeat || o.heartbeat > kMaxHeartbeat)
    bad(fmt::format(
        "--heartbeat {} is invalid: give seconds from {} to {} (how long a node's link may stay "
        "silent before its lease is revoked; default 1)",
        std::chrono::duration<double>(o.heartbeat).count(),
        std::chrono::duration<double>(kMinHeartbeat).count(),
        std::chrono::duration<double>(kMaxHeartbeat).count()));
  if (o.min_time) duration("--min-time", *o.min_time, false);
  if (o.failure_grace) duration("--failure-grace", *o.failure_grace, false);
  if (o.rendezvous == RendezvousKind::hosted &&
      (o.rdzv_host.empty() || o.rdzv_port < 1 || o.rdzv_port > 65535))
    bad(fmt::format("the {} rendezvous' endpoint '{}:{}' is invalid: give HOST:PORT", o.rdzv_name,
                    o.rdzv_host, o.rdzv_port));
  if (o.node_rank >= 0 &&
      (!o.max_nodes || *o.max_nodes != o.min_nodes || o.node_rank >= *o.max_nodes))
    bad(
        fmt::format("--node-rank {} is invalid: a static rendezvous has a fixed node count "
                    "(--nnodes N) and ranks from 0 to N-1",
                    o.node_rank));
  if (o.master_port < 0 || o.master_port > 65535 || (o.master_port > 0 && o.master_addr.empty()))
    bad(
        fmt::format("--master-port {} is invalid: give a port from 1 to 65535 with "
                    "--master-addr",
                    o.master_port));
  // The workers' ROLE_NAME and the prefix of their teed lines: no control
  // character reaches either.
  id_option("--role", o.role);
  std::string addr = o.node_addr.empty() ? fully_qualified_host_name() : o.node_addr;
  if (addr.empty() || addr.size() > kMaxAddrChars ||
      !std::all_of(addr.begin(), addr.end(), [](char c) {
        return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f;
      }))
    bad(fmt::format("--node-addr '{}' is invalid: give a host name or address", excerpt(addr)));
  if (std::error_code ec;
      !o.snapshot_dir.empty() && !std::filesystem::is_directory(o.snapshot_dir, ec))
    bad(
        fmt::format("--snapshot-dir '{}' is not a directory: give an existing directory (default "
                    "/dev/shm)",
                    excerpt(o.snapshot_dir)));
  for (const auto& name : o.warm_imports)
    if (!module_name(name))
      bad(
          fmt::format("--warm-imports '{}' is invalid: give Python module names separated by "
                      "commas (default {})",
                      excerpt(name), kDefaultWarmImports));
  if (!o.warm_imports.empty()) interpreter_words(o.command, !o.interpreter_choice.empty());
  // The workers inherit this PATH: a command not found now would fail in
  // every round.
  const std::string& program = o.command.front();
  if (program.find('/') != std::string::npos ? !runnable_file(program)
                                             : found_on_path(program, env_path()).empty())
    bad(fmt::format("the worker command '{}' {}: give an executable file{}", excerpt(program),
                    program.find('/') != std::string::npos
                        ? "is not an executable file"
                        : fmt::format("is not on PATH '{}'", excerpt(env_path(), 400)),
                    program.find('/') != std::string::npos ? "" : " or a command on PATH"));
}

}  // namespace ductile::agent
