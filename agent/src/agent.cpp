// The agent's loop: register, read the rendezvous, lead when oldest, run this
// node's workers for the current round. See agent.hpp and rendezvous.hpp.
#include "ductile/agent/agent.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "ductile/agent/etcd_store.hpp"
#include "ductile/agent/job_policy.hpp"
#include "ductile/agent/rendezvous.hpp"
#include "ductile/agent/workers.hpp"
#include "ductile/error.hpp"
#include "keep_alive.hpp"
#include "ompi_server.hpp"

extern char** environ;

namespace ductile::agent {
namespace {

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

// The port `port` (0: any) when it can be bound now, else 0.
int bindable_port(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  socklen_t len = sizeof addr;
  int got = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0
                ? ntohs(addr.sin_port)
                : 0;
  close(fd);
  return got;
}

// A TCP port nobody holds now, other than `avoid` (the last round's). Taken
// below the kernel's ephemeral range when it can be: the workers bind it
// some time after the leader chose it, and meanwhile sockets bound to port
// 0 (MPI's daemons, a gloo store's clients) are never given such a port.
int free_port(int avoid) {
  int low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low;
  static std::mt19937 random(std::random_device{}());
  for (int attempt = 0; attempt < 200 && low > 10001; ++attempt) {
    int port = bindable_port(std::uniform_int_distribution<int>(10000, low - 1)(random));
    if (port != 0 && port != avoid) return port;
  }
  for (int attempt = 0; attempt < 16; ++attempt)
    if (int port = bindable_port(0); port != 0 && port != avoid) return port;
  throw std::runtime_error("cannot find a free TCP port for MASTER_PORT");
}

void check_options(const AgentOptions& o) {
  auto bad = [](const std::string& message) { throw Error(ErrorKind::invalid_argument, message); };
  if (o.job_id.empty() ||
      o.job_id.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnop"
                                 "qrstuvwxyz0123456789._-") != std::string::npos)
    bad(fmt::format("--job-id '{}' is invalid: use letters, digits, '.', '_' and '-'", o.job_id));
  if (o.node_id.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                                  "0123456789._-") != std::string::npos)
    bad(fmt::format("--node-id '{}' is invalid: use letters, digits, '.', '_' and '-'", o.node_id));
  if (o.nproc_per_node < 1)
    bad(
        fmt::format("--nproc-per-node {} is invalid: give the number of workers of this node "
                    "(>= 1)",
                    o.nproc_per_node));
  if (o.min_nodes < 1) bad(fmt::format("--min-nodes {} is invalid: give 1 or more", o.min_nodes));
  if (o.max_nodes && (*o.max_nodes < 1 || *o.max_nodes < o.min_nodes))
    bad(fmt::format("--max-nodes {} is invalid: it must be at least --min-nodes ({})", *o.max_nodes,
                    o.min_nodes));
  if (o.max_restarts < 0)
    bad(fmt::format("--max-restarts {} is invalid: give 0 or more", o.max_restarts));
  if (o.command.empty())
    bad("no worker command: give it after '--', e.g. ductile agent ... -- python3 train.py");
  if (o.lease_ttl < std::chrono::seconds(2))
    bad(fmt::format("--lease-ttl {} is invalid: etcd leases last at least 2 seconds",
                    o.lease_ttl.count()));
  if (o.poll_interval <= milliseconds(0) || o.stop_grace < milliseconds(0) ||
      o.settle < milliseconds(0) || o.store_timeout <= milliseconds(0))
    bad("--poll-interval and --store-timeout must be > 0, --settle and --stop-grace >= 0");
}

class Agent {
 public:
  explicit Agent(const AgentOptions& o) : o_(o) {}
  int run();

 private:
  void log(const std::string& message) const {
    write_line(true, fmt::format("ductile agent {}: {}", id_, message));
  }
  std::string key(const std::string& name) const { return prefix_ + name; }
  void setup();
  void register_node();
  void check_settings();
  void lead(const std::vector<NodeInfo>& alive, std::optional<KeyValue>& round_kv);
  std::optional<int> apply(const RoundRecord& round);
  void start_workers(const RoundRecord& round, std::size_t group_rank);
  void report_worker_exit();
  int leave(int code);

  const AgentOptions& o_;
  std::optional<JobPolicy> policy_;
  RendezvousSettings settings_;
  std::string endpoint_, prefix_, id_, addr_;
  std::unique_ptr<EtcdStore> store_;
  std::int64_t lease_ = 0;
  std::unique_ptr<KeepAlive> keep_alive_;
  std::unique_ptr<OmpiServer> mpi_server_;  // with --mpi-world
  WorkerGroup workers_;
  std::int64_t current_round_ = 0;
  bool member_ = false;
  bool reported_ = false;  // this round's worker exit is in the store
  std::optional<WorkerExit> local_failure_;
  int last_port_ = 0;
  std::vector<std::string> last_alive_;
  milliseconds last_membership_change_{0};
  std::map<std::int64_t, milliseconds> failure_seen_;
  std::optional<milliseconds> outage_since_;
  std::string settings_text_;
};

void Agent::setup() {
  check_options(o_);
  policy_ = JobPolicy::load(o_.config, o_.runtime);
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

  endpoint_ = etcd_endpoint_from_url(o_.rdzv, "--rdzv");
  prefix_ = "/ductile/agent/" + o_.job_id + "/";
  addr_ = o_.node_addr.empty() ? host_name() : o_.node_addr;
  if (o_.node_id.empty()) {
    std::random_device random;
    id_ = fmt::format("{}-{}-{:04x}", host_name(), getpid(), random() & 0xffff);
  } else {
    id_ = o_.node_id;
  }
  store_ = std::make_unique<EtcdStore>(endpoint_);
  try {
    lease_ = store_->grant_lease(o_.lease_ttl.count());
  } catch (const StoreError& e) {
    throw Error(ErrorKind::communication,
                fmt::format("cannot reach etcd for --rdzv {}: {}; start etcd there or give the "
                            "address of a running one",
                            o_.rdzv, e.what()));
  }
  if (o_.mpi_world) mpi_server_ = std::make_unique<OmpiServer>();
}

void Agent::register_node() {
  store_->put(key("nodes/" + id_), to_json(NodeInfo{id_, addr_, 0}), lease_);
}

void Agent::check_settings() {
  json mine = json::parse(policy_->settings_json());
  mine["nproc_per_node"] = o_.nproc_per_node;
  mine["mpi_world"] = o_.mpi_world;
  settings_text_ = mine.dump();
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto existing = store_->get(key("settings"));
    auto nodes = store_->get_prefix(key("nodes/"));
    bool others = std::any_of(nodes.begin(), nodes.end(),
                              [&](const KeyValue& kv) { return kv.key != key("nodes/" + id_); });
    if (!others) {
      // First agent of a (new) run: state a finished or crashed run left
      // behind is not this run's.
      store_->erase(key("round"));
      store_->erase_prefix(key("failure/"));
      store_->erase_prefix(key("done/"));
    }
    if (existing && existing->value == settings_text_) return;
    if (existing && others) {
      json theirs = json::parse(existing->value, nullptr, false);
      std::vector<std::string> differences;
      auto compare = [&](const std::string& name, const json& a, const json& b) {
        if (a != b)
          differences.push_back(fmt::format("{} is {} there, {} here", name, a.dump(), b.dump()));
      };
      if (theirs.is_object()) {
        compare("policy", theirs.value("policy", json()), mine["policy"]);
        compare("nproc_per_node", theirs.value("nproc_per_node", json()), mine["nproc_per_node"]);
        compare("--mpi-world", theirs.value("mpi_world", false), mine["mpi_world"]);
        json tp = theirs.value("params", json::object()), mp = mine["params"];
        for (auto it = mp.begin(); it != mp.end(); ++it)
          compare(it.key(), tp.value(it.key(), json()), it.value());
        for (auto it = tp.begin(); it != tp.end(); ++it)
          if (!mp.contains(it.key())) compare(it.key(), it.value(), json());
      }
      if (differences.empty()) differences.push_back("the settings record differs");
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
    if (store_->compare_and_swap(key("settings"), existing ? existing->mod_revision : 0,
                                 settings_text_))
      return;
  }
  throw std::runtime_error(
      "the job's settings record keeps changing; is another job starting "
      "with the same --job-id?");
}

void Agent::lead(const std::vector<NodeInfo>& alive, std::optional<KeyValue>& round_kv) {
  Observation seen;
  seen.now = now_ms();
  seen.alive = alive;
  seen.last_membership_change = last_membership_change_;
  if (round_kv) seen.round = round_from_json(round_kv->value);
  if (seen.round && !seen.round->members.empty()) {
    std::string r = std::to_string(seen.round->round);
    if (auto f = store_->get(key("failure/" + r))) {
      seen.failure = failure_from_json(f->value);
      auto [it, inserted] = failure_seen_.try_emplace(seen.round->round, seen.now);
      seen.failure_seen = it->second;
    }
    auto done = store_->get_prefix(key("done/" + r + "/"));
    seen.all_done = std::all_of(
        seen.round->members.begin(), seen.round->members.end(), [&](const std::string& id) {
          return std::any_of(done.begin(), done.end(), [&](const KeyValue& kv) {
            return kv.key == key("done/" + r + "/" + id);
          });
        });
  }
  Decision d = decide(seen, settings_);
  if (d.action == Action::keep) return;
  RoundRecord next = seen.round.value_or(RoundRecord{});
  if (d.action == Action::new_round) {
    next.round += 1;
    next.members.clear();
    for (const auto& n : d.members) next.members.push_back(n.id);
    next.world_size = static_cast<std::int64_t>(d.members.size()) * o_.nproc_per_node;
    next.master_addr = d.members.empty() ? std::string() : d.members.front().addr;
    next.master_port = d.members.empty() ? 0 : free_port(last_port_);
    if (next.master_port) last_port_ = next.master_port;
    bool mpi = mpi_server_ && !d.members.empty();
    next.mpi_server_uri = mpi ? mpi_server_->uri() : std::string();
    next.mpi_join_port = mpi ? free_port(next.master_port) : 0;
    if (d.counts_as_restart) next.restarts += 1;
    next.started_ms = seen.now.count();
    next.state = RoundState::running;
    next.failure.reset();
  } else if (d.action == Action::succeed) {
    next.state = RoundState::succeeded;
  } else {
    next.state = RoundState::failed;
    next.failure = seen.failure;
  }
  next.reason = d.reason;
  std::string text = to_json(next);
  if (store_->compare_and_swap(key("round"), round_kv ? round_kv->mod_revision : 0, text)) {
    if (d.action == Action::new_round)
      log(fmt::format("leader: round {} formed: {}", next.round, d.reason));
    else
      log(fmt::format("leader: job {}: {}", to_string(next.state), d.reason));
    round_kv = store_->get(key("round"));
  }
}

void Agent::start_workers(const RoundRecord& round, std::size_t group_rank) {
  BatchPlan plan = policy_->plan(round.world_size);
  std::int64_t nodes = static_cast<std::int64_t>(round.members.size());
  std::vector<std::string> base;
  static const char* kSet[] = {"RANK",
                               "LOCAL_RANK",
                               "WORLD_SIZE",
                               "LOCAL_WORLD_SIZE",
                               "GROUP_RANK",
                               "GROUP_WORLD_SIZE",
                               "ROLE_RANK",
                               "ROLE_WORLD_SIZE",
                               "MASTER_ADDR",
                               "MASTER_PORT",
                               "TORCHELASTIC_RESTART_COUNT",
                               "TORCHELASTIC_MAX_RESTARTS",
                               "TORCHELASTIC_RUN_ID",
                               "DEEPSPEED_ELASTICITY_CONFIG",
                               "DUCTILE_GLOBAL_BATCH",
                               "DUCTILE_MICRO_BATCH",
                               "DUCTILE_GRADIENT_ACCUMULATION_STEPS",
                               "DUCTILE_ROUND",
                               "DUCTILE_AGENT_NODE_ID",
                               "DUCTILE_MPI_JOIN",
                               "OMPI_MCA_pmix_server_uri"};
  for (char** e = environ; *e; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    std::string name = entry.substr(0, eq);
    if (std::none_of(std::begin(kSet), std::end(kSet), [&](const char* s) { return name == s; }))
      base.push_back(entry);
  }
  std::vector<WorkerSpec> specs;
  for (std::int64_t local = 0; local < o_.nproc_per_node; ++local) {
    std::int64_t rank = static_cast<std::int64_t>(group_rank) * o_.nproc_per_node + local;
    WorkerSpec spec{rank, local, o_.command, base};
    auto set = [&](const char* name, const std::string& value) {
      spec.env.push_back(std::string(name) + "=" + value);
    };
    set("RANK", std::to_string(rank));
    set("LOCAL_RANK", std::to_string(local));
    set("WORLD_SIZE", std::to_string(round.world_size));
    set("LOCAL_WORLD_SIZE", std::to_string(o_.nproc_per_node));
    set("GROUP_RANK", std::to_string(group_rank));
    set("GROUP_WORLD_SIZE", std::to_string(nodes));
    set("ROLE_RANK", std::to_string(rank));
    set("ROLE_WORLD_SIZE", std::to_string(round.world_size));
    set("MASTER_ADDR", round.master_addr);
    set("MASTER_PORT", std::to_string(round.master_port));
    set("TORCHELASTIC_RESTART_COUNT", std::to_string(round.restarts));
    set("TORCHELASTIC_MAX_RESTARTS", std::to_string(o_.max_restarts));
    set("TORCHELASTIC_RUN_ID", o_.job_id);
    set("DEEPSPEED_ELASTICITY_CONFIG", policy_->scheduler_config_json());
    set("DUCTILE_GLOBAL_BATCH", std::to_string(plan.global_batch));
    set("DUCTILE_MICRO_BATCH", std::to_string(plan.micro_batch));
    set("DUCTILE_GRADIENT_ACCUMULATION_STEPS", std::to_string(plan.gradient_accumulation_steps));
    set("DUCTILE_ROUND", std::to_string(round.round));
    set("DUCTILE_AGENT_NODE_ID", id_);
    if (round.mpi_join_port != 0) {
      set("DUCTILE_MPI_JOIN", round.master_addr + ":" + std::to_string(round.mpi_join_port));
      set("OMPI_MCA_pmix_server_uri", round.mpi_server_uri);
    }
    specs.push_back(std::move(spec));
  }
  log(fmt::format(
      "round {} started: world size {} ({} nodes x {}), group rank {}, master {}:{}{}, "
      "global batch {} = micro {} x accumulation {} x {}, restarts {}, "
      "started_ms={} ({})",
      round.round, round.world_size, nodes, o_.nproc_per_node, group_rank, round.master_addr,
      round.master_port,
      round.mpi_join_port ? fmt::format(", MPI world joined at port {}", round.mpi_join_port) : "",
      plan.global_batch, plan.micro_batch, plan.gradient_accumulation_steps, round.world_size,
      round.restarts, round.started_ms, round.reason));
  workers_.start(specs);
}

// Applies the round record; returns an exit code when the agent is done.
std::optional<int> Agent::apply(const RoundRecord& round) {
  if (round.state == RoundState::failed) {
    workers_.stop(o_.stop_grace);
    const auto& f = round.failure;
    int status = f && f->exit_status != 0 ? f->exit_status : 1;
    if (f && f->node == id_) {
      std::string lines;
      for (const auto& l : f->last_lines) lines += "\n  | " + l;
      log(fmt::format(
          "job failed: worker rank {} (local rank {}) exited with status {} after {} "
          "restart(s) (max-restarts {}); its last lines:{}",
          f->rank, f->local_rank, f->exit_status, round.restarts, o_.max_restarts, lines));
    } else {
      log(fmt::format("job failed: {}", round.reason));
    }
    return status;
  }
  if (round.state == RoundState::succeeded) {
    if (workers_.running() && round.round == current_round_) return std::nullopt;
    if (local_failure_) return local_failure_->status;
    log("job finished");
    return kAgentOk;
  }
  if (round.round == current_round_) return std::nullopt;
  if (!workers_.empty()) {
    log(fmt::format("stopping the workers of round {} for round {}", current_round_, round.round));
    workers_.stop(o_.stop_grace);
  }
  current_round_ = round.round;
  reported_ = false;
  local_failure_.reset();
  auto it = std::find(round.members.begin(), round.members.end(), id_);
  member_ = it != round.members.end();
  if (member_) {
    start_workers(round, static_cast<std::size_t>(it - round.members.begin()));
  } else if (round.members.empty()) {
    log(fmt::format("round {}: waiting for nodes ({})", round.round, round.reason));
  } else {
    log(
        fmt::format("round {}: standby; world size {} uses {} node(s), a larger valid size is "
                    "not reachable yet",
                    round.round, round.world_size, round.members.size()));
  }
  return std::nullopt;
}

void Agent::report_worker_exit() {
  if (reported_ || workers_.empty()) return;
  if (auto failure = workers_.first_failure()) {
    if (!local_failure_) {
      local_failure_ = failure;
      log(fmt::format("worker rank {} exited with status {}; stopping this node's workers",
                      failure->rank, failure->status));
      workers_.stop(o_.stop_grace);
    }
    FailureReport report{id_, local_failure_->rank, local_failure_->local_rank,
                         local_failure_->status, local_failure_->last_lines};
    store_->compare_and_swap(key("failure/" + std::to_string(current_round_)), 0, to_json(report));
    reported_ = true;
  } else if (workers_.all_succeeded()) {
    store_->put(key("done/" + std::to_string(current_round_) + "/" + id_), "{}");
    log(fmt::format("round {}: this node's workers finished", current_round_));
    reported_ = true;
  }
}

int Agent::leave(int code) {
  workers_.stop(o_.stop_grace);
  mpi_server_.reset();
  keep_alive_.reset();
  try {
    store_->revoke_lease(lease_);
  } catch (const StoreError&) {
    // etcd is gone: the lease expires on its own.
  }
  return code;
}

int Agent::run() {
  setup();
  register_node();
  check_settings();
  keep_alive_ = std::make_unique<KeepAlive>(
      endpoint_, lease_, std::max(milliseconds(o_.lease_ttl) / 3, milliseconds(200)));
  log(fmt::format(
      "joined job '{}' on {} (address {}, {} worker(s), nodes {}..{}, valid GPU "
      "counts [{}], min_time {} ms)",
      o_.job_id, store_->describe(), addr_, o_.nproc_per_node, settings_.min_nodes,
      settings_.max_nodes, fmt::join(settings_.valid_gpus, ", "), settings_.min_time.count()));
  last_membership_change_ = now_ms();
  for (;;) {
    if (o_.stop_signal && o_.stop_signal->load() != 0) {
      int sig = o_.stop_signal->load();
      log(fmt::format("signal {}: stopping the workers and leaving the job", sig));
      return leave(128 + sig);
    }
    workers_.pump(o_.poll_interval);
    try {
      report_worker_exit();
      if (keep_alive_->lost()) {
        log("lease expired (etcd was unreachable too long?); registering again");
        lease_ = store_->grant_lease(o_.lease_ttl.count());
        keep_alive_->set_lease(lease_);
        register_node();
      }
      auto node_kvs = store_->get_prefix(key("nodes/"));
      auto round_kv = store_->get(key("round"));
      if (outage_since_) {
        log(fmt::format("{} reachable again after {} ms", store_->describe(),
                        (now_ms() - *outage_since_).count()));
        outage_since_.reset();
      }
      std::vector<NodeInfo> alive;
      for (const auto& kv : node_kvs) alive.push_back(node_from_json(kv.value, kv.create_revision));
      std::sort(alive.begin(), alive.end(), [](const NodeInfo& a, const NodeInfo& b) {
        return a.create_revision < b.create_revision;
      });
      std::vector<std::string> ids;
      for (const auto& n : alive) ids.push_back(n.id);
      if (ids != last_alive_) {
        last_alive_ = ids;
        last_membership_change_ = now_ms();
      }
      if (!alive.empty() && alive.front().id == id_) lead(alive, round_kv);
      if (round_kv)
        if (auto code = apply(round_from_json(round_kv->value))) return leave(*code);
    } catch (const StoreUnavailable& e) {
      auto now = now_ms();
      if (!outage_since_) {
        outage_since_ = now;
        log(fmt::format("{}; the workers keep running, giving up after {} ms", e.what(),
                        o_.store_timeout.count()));
      }
      if (now - *outage_since_ >= o_.store_timeout) {
        log(fmt::format("error: {} unreachable for {} ms (last error: {}); stopping the workers",
                        store_->describe(), (now - *outage_since_).count(), e.what()));
        return leave(kAgentStoreLost);
      }
    }
  }
}

}  // namespace

int run_agent(const AgentOptions& options) {
  Agent agent(options);
  return agent.run();
}

}  // namespace ductile::agent

extern "C" int ductile_agent_run(const ductile::agent::AgentOptions* options) {
  return ductile::agent::run_agent(*options);
}
