// The agent's start-up: options, the policy, this node's key (one agent per
// node id) and the job's settings record. See agent_impl.hpp.
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <random>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "agent_impl.hpp"
#include "ductile/error.hpp"

namespace ductile::agent {

using json = nlohmann::json;
using std::chrono::milliseconds;

milliseconds now_ms() {
  return std::chrono::duration_cast<milliseconds>(
      std::chrono::system_clock::now().time_since_epoch());
}

std::string host_name() {
  char buffer[256] = {};
  if (gethostname(buffer, sizeof buffer - 1) != 0) return "localhost";
  return buffer;
}

void check_options(const AgentOptions& o) {
  auto bad = [](const std::string& message) { throw Error(ErrorKind::invalid_argument, message); };
  if (!valid_node_id(o.job_id))
    bad(fmt::format("--job-id '{}' is invalid: use 1 to {} letters, digits, '.', '_' and '-'",
                    o.job_id, kMaxNodeIdChars));
  if (!o.node_id.empty() && !valid_node_id(o.node_id))
    bad(fmt::format("--node-id '{}' is invalid: use 1 to {} letters, digits, '.', '_' and '-'",
                    o.node_id, kMaxNodeIdChars));
  if (o.nproc_per_node < 1 || o.nproc_per_node > kMaxCount)
    bad(
        fmt::format("--nproc-per-node {} is invalid: give the number of workers of this node "
                    "(>= 1)",
                    o.nproc_per_node));
  if (o.min_nodes < 1 || o.min_nodes > kMaxCount)
    bad(fmt::format("--min-nodes {} is invalid: give 1 or more", o.min_nodes));
  if (o.max_nodes && (*o.max_nodes < 1 || *o.max_nodes < o.min_nodes || *o.max_nodes > kMaxCount))
    bad(fmt::format("--max-nodes {} is invalid: it must be at least --min-nodes ({})", *o.max_nodes,
                    o.min_nodes));
  if (o.max_restarts < 0 || o.max_restarts > kMaxCount)
    bad(fmt::format("--max-restarts {} is invalid: give 0 or more", o.max_restarts));
  if (o.command.empty())
    bad("no worker command: give it after '--', e.g. ductile agent ... -- python3 train.py");
  if (o.lease_ttl < std::chrono::seconds(2))
    bad(fmt::format("--lease-ttl {} is invalid: etcd leases last at least 2 seconds",
                    o.lease_ttl.count()));
  if (o.poll_interval <= milliseconds(0) || o.stop_grace < milliseconds(0) ||
      o.settle < milliseconds(0) || o.store_timeout <= milliseconds(0) ||
      o.request_timeout <= milliseconds(0) || o.checkpoint_timeout < milliseconds(0) ||
      (o.join_timeout && *o.join_timeout <= milliseconds(0)))
    bad("--poll-interval, --store-timeout and the rendezvous' read_timeout and join_timeout must "
        "be > 0, --settle, --stop-grace and --checkpoint-timeout >= 0");
  if (!valid_node_id(o.role))
    bad(fmt::format("--role '{}' is invalid: use 1 to {} letters, digits, '.', '_' and '-'",
                    excerpt(o.role), kMaxNodeIdChars));
  std::string addr = o.node_addr.empty() ? host_name() : o.node_addr;
  if (addr.empty() || addr.size() > kMaxAddrChars ||
      !std::all_of(addr.begin(), addr.end(), [](char c) {
        return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f;
      }))
    bad(fmt::format("--node-addr '{}' is invalid: give a host name or address", excerpt(addr)));
}

RunDir::RunDir(const std::string& job_id) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / ("ductile-agent-" + job_id + "-XXXXXX")).string();
  if (!mkdtemp(pattern.data()))
    throw Error(ErrorKind::io, fmt::format("cannot make a directory {} for the workers' error "
                                           "files: {}; set TMPDIR to a writable directory",
                                           pattern, strerror(errno)));
  path_ = pattern;
}

RunDir::~RunDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

void Agent::setup() {
  check_options(o_);
  policy_ = o_.config.empty() ? JobPolicy::any_size(o_.nproc_per_node, o_.min_nodes,
                                                    o_.max_nodes.value_or(o_.min_nodes))
                              : JobPolicy::load(o_.config, o_.runtime);
  const auto& valid = policy_->valid_gpus();
  std::int64_t max_nodes = o_.max_nodes.value_or(
      std::max<std::int64_t>(o_.min_nodes, valid.empty() ? 0 : valid.back() / o_.nproc_per_node));
  if (admitted_nodes(valid, o_.nproc_per_node, o_.min_nodes, max_nodes, max_nodes) == 0) {
    std::vector<std::int64_t> usable;
    for (std::int64_t n = 1; n <= (valid.empty() ? 0 : valid.back()); ++n)
      if (admitted_nodes(valid, n, o_.min_nodes, max_nodes, max_nodes) > 0) usable.push_back(n);
    throw Error(ErrorKind::incompatible,
                fmt::format("--nproc-per-node {}: no world size of {} to {} nodes x {} is valid "
                            "for {} (policy '{}', valid GPU counts [{}]); nproc-per-node values "
                            "that fit: [{}]",
                            o_.nproc_per_node, o_.min_nodes, max_nodes, o_.nproc_per_node,
                            policy_->origin(), policy_->policy_name(), fmt::join(valid, ", "),
                            fmt::join(usable, ", ")));
  }
  settings_.valid_gpus = valid;
  settings_.nproc_per_node = o_.nproc_per_node;
  settings_.min_nodes = o_.min_nodes;
  settings_.max_nodes = max_nodes;
  settings_.max_restarts = o_.max_restarts;
  settings_.min_time = o_.min_time.value_or(policy_->min_time());
  settings_.settle = o_.settle;
  settings_.failure_grace = o_.failure_grace.value_or(milliseconds(o_.lease_ttl));
  settings_.checkpoint_timeout = o_.checkpoint_timeout;

  endpoint_ = etcd_endpoint_from_url(o_.rdzv, "--rdzv");
  check_etcd_tls(o_.rdzv, o_.tls, {"--rdzv", "--rdzv-cacert", "--rdzv-cert", "--rdzv-key"});
  prefix_ = "/ductile/agent/" + o_.job_id + "/";
  addr_ = o_.node_addr.empty() ? host_name() : o_.node_addr;
  if (o_.node_id.empty()) {
    std::random_device random;
    id_ = fmt::format("{}-{}-{:04x}", host_name(), getpid(), random() & 0xffff);
    // A host name may hold characters a node id may not.
    for (char& c : id_)
      if (!valid_node_id(std::string(1, c))) c = '_';
    if (id_.size() > kMaxNodeIdChars) id_ = id_.substr(id_.size() - kMaxNodeIdChars);
  } else {
    id_ = o_.node_id;
  }
  run_dir_.emplace(o_.job_id);
  store_ = std::make_unique<EtcdStore>(endpoint_, o_.request_timeout, o_.tls);
  try {
    granted_at_ = KeepAlive::Clock::now();
    lease_ = store_->grant_lease(o_.lease_ttl.count());
  } catch (const StoreError& e) {
    std::string hint =
        endpoint_.starts_with("https://")
            ? "; over TLS, check that etcd serves TLS there, that --rdzv-cacert is the CA of "
              "etcd's certificate, and that an etcd with --client-cert-auth gets a certificate of "
              "its CA (--rdzv-cert, --rdzv-key)"
            : "";
    throw Error(ErrorKind::communication,
                fmt::format("cannot reach etcd for --rdzv {}: {}; start etcd there or give the "
                            "address of a running one{}",
                            o_.rdzv, e.what(), hint));
  }
  if (o_.mpi_world) mpi_server_ = std::make_unique<OmpiServer>();
}

Agent::Claim Agent::claim_node_key(std::optional<KeyValue>* holder) {
  const std::string k = key("nodes/" + id_), value = to_json(NodeInfo{id_, addr_, 0});
  if (store_->compare_and_swap(k, 0, value, lease_)) return Claim::held;
  auto existing = store_->get(k);
  if (!existing) return Claim::retry;  // deleted or expired meanwhile
  bool ours = existing->lease == lease_;
  std::string problem;
  if (existing->lease == 0) {
    problem = "it has no lease, so no agent keeps it alive";
  } else if (!ours) {
    try {
      node_from_json(existing->value, id_, existing->create_revision);
    } catch (const MalformedRecord& e) {
      problem = e.what();
    }
  }
  if (ours || !problem.empty()) {
    if (!problem.empty())
      ignore_record(*existing, problem, "replaced by this agent's registration");
    return store_->compare_and_swap(k, existing->mod_revision, value, lease_) ? Claim::held
                                                                              : Claim::retry;
  }
  *holder = existing;
  return Claim::taken;
}

void Agent::refuse_duplicate(const KeyValue& holder, const std::string& how) {
  std::string addr = "?";
  try {
    addr = node_from_json(holder.value, id_, 0).addr;
  } catch (const MalformedRecord&) {
  }
  keep_alive_.reset();
  try {
    store_->revoke_lease(lease_);
  } catch (const StoreError&) {
  }
  throw Error(ErrorKind::invalid_argument,
              fmt::format("--node-id '{}' is in use: another agent of job '{}' on {} is "
                          "registered under it (address {}) and {}; give every agent its own "
                          "--node-id, or leave --node-id out for a generated one",
                          id_, o_.job_id, store_->describe(), addr, how));
}

void Agent::register_node() {
  using clock = std::chrono::steady_clock;
  std::int64_t watched_lease = 0, last_remaining = 0;
  clock::time_point deadline{};
  for (int changes = 0;;) {
    std::optional<KeyValue> holder;
    Claim claim = claim_node_key(&holder);
    if (claim == Claim::held) return;
    if (claim == Claim::retry) {
      if (++changes > 100)
        throw std::runtime_error("this node's key keeps changing under " + key("nodes/" + id_));
      continue;
    }
    // A live registration of another lease: a previous run of this node
    // (killed before it could revoke its lease: the key goes when the lease
    // expires) or another agent started with the same id (it renews its
    // lease every TTL/3, so the lease outlives its time left, or the time
    // left goes up). etcd truncates the time left to whole seconds.
    std::int64_t remaining = store_->lease_remaining(holder->lease);
    if (remaining < 0) {
      // Expired: etcd deletes the key within moments.
    } else if (holder->lease != watched_lease) {
      watched_lease = holder->lease;
      deadline = clock::now() + std::chrono::seconds(remaining + 2);
      log(fmt::format(
          "node id '{}' is registered by another lease ({} s left): waiting for it to "
          "expire (a previous run of this node?) or be renewed (another agent with this id)",
          id_, remaining));
    } else if (remaining > last_remaining || clock::now() > deadline) {
      refuse_duplicate(*holder, "keeps its lease alive");
    }
    last_remaining = remaining;
    std::this_thread::sleep_for(o_.poll_interval);
  }
}

void Agent::reclaim_node_key(const std::string& why) {
  log(fmt::format("this node's registration {}; registering again", why));
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::optional<KeyValue> holder;
    Claim claim = claim_node_key(&holder);
    if (claim == Claim::held) return;
    if (claim == Claim::taken) {
      std::int64_t remaining = store_->lease_remaining(holder->lease);
      if (remaining >= 0) refuse_duplicate(*holder, "took this node's id while it was away");
    }
  }
  // The key keeps changing: the next pass tries again.
}

void Agent::check_settings(const std::vector<NodeInfo>& others_alive) {
  json mine = json::parse(policy_->settings_json());
  mine["nproc_per_node"] = o_.nproc_per_node;
  mine["mpi_world"] = o_.mpi_world;
  settings_text_ = mine.dump();
  bool others = !others_alive.empty();
  if (!others) {
    // First agent of a (new) run: state a finished or crashed run left
    // behind is not this run's.
    store_->erase(key("round"));
    store_->erase_prefix(key("failure/"));
    store_->erase_prefix(key("done/"));
    store_->erase_prefix(key("checkpoint/"));
    store_->erase_prefix(key("saved/"));
  }
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto existing = store_->get(key("settings"));
    if (existing && existing->value == settings_text_) return;
    if (existing && others) {
      std::vector<std::string> differences;
      try {
        differences = settings_differences(existing->value, settings_text_);
        if (differences.empty()) return;  // the same settings, written differently
      } catch (const MalformedRecord& e) {
        ignore_record(*existing, e.what(), "replaced by this agent's settings");
      }
      if (!differences.empty()) {
        keep_alive_.reset();
        try {
          store_->revoke_lease(lease_);
        } catch (const StoreError&) {
        }
        throw Error(ErrorKind::config,
                    fmt::format("job id '{}' is in use on {} with another configuration: {} ({} "
                                "here); give another --job-id or the job's configuration",
                                o_.job_id, store_->describe(), fmt::join(differences, "; "),
                                o_.config.string()));
      }
    }
    if (store_->compare_and_swap(key("settings"), existing ? existing->mod_revision : 0,
                                 settings_text_))
      return;
  }
  throw std::runtime_error(
      "the job's settings record keeps changing; is another job starting "
      "with the same --job-id?");
}

}  // namespace ductile::agent
