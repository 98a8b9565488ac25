// The agent's start-up: options, the policy, this node's key (one agent per
// node id) and the job's settings record. See agent_impl.hpp.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <random>
#include <set>
#include <system_error>
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

namespace {

// The numeric addresses `host` resolves to.
std::set<std::string> addresses_of(const std::string& host) {
  std::set<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return out;
  for (addrinfo* a = found; a; a = a->ai_next) {
    char text[NI_MAXHOST];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, text, sizeof text, nullptr, 0, NI_NUMERICHOST) == 0)
      out.insert(text);
  }
  freeaddrinfo(found);
  return out;
}

}  // namespace

std::string fully_qualified_host_name() {
  // As Python's getfqdn(): the host name's first address, its name and
  // aliases from the resolver; the first of them with a dot, else its name.
  const std::string name = host_name();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* found = nullptr;
  if (getaddrinfo(name.c_str(), nullptr, &hints, &found) != 0 || !found) return name;
  hostent entry{}, *result = nullptr;
  std::vector<char> buffer(16384);
  int error = 0;
  const void* address = nullptr;
  socklen_t length = 0;
  if (found->ai_family == AF_INET) {
    address = &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr;
    length = sizeof(in_addr);
  } else if (found->ai_family == AF_INET6) {
    address = &reinterpret_cast<sockaddr_in6*>(found->ai_addr)->sin6_addr;
    length = sizeof(in6_addr);
  }
  std::string fqdn = name;
  if (address &&
      gethostbyaddr_r(address, length, found->ai_family, &entry, buffer.data(), buffer.size(),
                      &result, &error) == 0 &&
      result && result->h_name) {
    fqdn = result->h_name;
    std::vector<std::string> names = {result->h_name};
    for (char** alias = result->h_aliases; alias && *alias; ++alias) names.push_back(*alias);
    for (const auto& n : names)
      if (n.find('.') != std::string::npos) {
        fqdn = n;
        break;
      }
  }
  freeaddrinfo(found);
  return fqdn;
}

bool names_this_machine(const std::string& host) {
  if (host == "localhost" || host == host_name() || host == fully_qualified_host_name())
    return true;
  in_addr v4{};
  in6_addr v6{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127) return true;
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  const std::set<std::string> wanted = addresses_of(host);
  if (wanted.empty()) return false;
  ifaddrs* interfaces = nullptr;
  if (getifaddrs(&interfaces) != 0) return false;
  bool mine = false;
  for (ifaddrs* i = interfaces; i && !mine; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6))
      continue;
    char text[NI_MAXHOST];
    socklen_t length =
        i->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (getnameinfo(i->ifa_addr, length, text, sizeof text, nullptr, 0, NI_NUMERICHOST) == 0)
      mine = wanted.count(text) > 0;
  }
  freeifaddrs(interfaces);
  return mine;
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
  if (!valid_node_id(o.role))
    bad(fmt::format("--role '{}' is invalid: use 1 to {} letters, digits, '.', '_' and '-'",
                    excerpt(o.role), kMaxNodeIdChars));
  std::string addr = o.node_addr.empty() ? fully_qualified_host_name() : o.node_addr;
  if (addr.empty() || addr.size() > kMaxAddrChars ||
      !std::all_of(addr.begin(), addr.end(), [](char c) {
        return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f;
      }))
    bad(fmt::format("--node-addr '{}' is invalid: give a host name or address", excerpt(addr)));
}

RunDir::RunDir(const std::string& job_id, const WorkerOutput& output) : kept_(output.any_file()) {
  const std::filesystem::path base =
      output.log_dir.empty() ? std::filesystem::temp_directory_path() : output.log_dir;
  if (!output.log_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(base, ec);
    if (ec)
      throw Error(ErrorKind::io, fmt::format("--log-dir '{}' cannot be made: {}; give a "
                                             "writable directory",
                                             base.string(), ec.message()));
  }
  std::string pattern =
      (base / (kept_ ? job_id + "_XXXXXX" : "ductile-agent-" + job_id + "-XXXXXX")).string();
  if (!mkdtemp(pattern.data()))
    throw Error(ErrorKind::io,
                fmt::format("cannot make a directory {} for the workers' error and log files: {}; "
                            "{}",
                            pattern, strerror(errno),
                            output.log_dir.empty() ? "set TMPDIR to a writable directory"
                                                   : "give --log-dir a writable directory"));
  path_ = pattern;
}

RunDir::~RunDir() {
  if (kept_) return;  // the workers' log files, as torchrun keeps them
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

namespace {

// The agent's handle on a MemoryStore it shares with its other threads
// and its server.
class SharedStore final : public KeyValueStore {
 public:
  explicit SharedStore(std::shared_ptr<MemoryStore> store) : store_(std::move(store)) {}
  std::int64_t grant_lease(std::int64_t ttl) override { return store_->grant_lease(ttl); }
  bool keep_alive(std::int64_t lease) override { return store_->keep_alive(lease); }
  void revoke_lease(std::int64_t lease) override { store_->revoke_lease(lease); }
  std::int64_t lease_remaining(std::int64_t lease) override {
    return store_->lease_remaining(lease);
  }
  void put(const std::string& k, const std::string& v, std::int64_t lease) override {
    store_->put(k, v, lease);
  }
  std::optional<KeyValue> get(const std::string& k) override { return store_->get(k); }
  std::vector<KeyValue> get_prefix(const std::string& p) override { return store_->get_prefix(p); }
  std::vector<std::vector<KeyValue>> read(const std::vector<RangeRead>& r) override {
    return store_->read(r);
  }
  void erase(const std::string& k) override { store_->erase(k); }
  void erase_prefix(const std::string& p) override { store_->erase_prefix(p); }
  bool compare_and_swap(const std::string& k, std::int64_t rev, const std::string& v,
                        std::int64_t lease) override {
    return store_->compare_and_swap(k, rev, v, lease);
  }
  std::string describe() const override { return store_->describe(); }

 private:
  std::shared_ptr<MemoryStore> store_;
};

}  // namespace

void Agent::open_store() {
  auto share = [this](std::shared_ptr<MemoryStore> memory) {
    memory_ = std::move(memory);
    store_ = std::make_unique<SharedStore>(memory_);
    make_store_ = [memory = memory_](std::chrono::milliseconds) {
      return std::make_unique<SharedStore>(memory);
    };
  };
  switch (o_.rendezvous) {
    case RendezvousKind::etcd: {
      std::string endpoint = etcd_endpoint_from_url(o_.rdzv, "--rdzv");
      check_etcd_tls(o_.rdzv, o_.tls, {"--rdzv", "--rdzv-cacert", "--rdzv-cert", "--rdzv-key"});
      store_ = std::make_unique<EtcdStore>(endpoint, o_.request_timeout, o_.tls);
      make_store_ = [endpoint, tls = o_.tls](std::chrono::milliseconds timeout) {
        return std::make_unique<EtcdStore>(endpoint, timeout, tls);
      };
      return;
    }
    case RendezvousKind::embedded:
      share(std::make_shared<MemoryStore>("this agent's own rendezvous (one node)"));
      return;
    case RendezvousKind::hosted:
      break;
  }
  const std::string where = fmt::format("{}:{}", o_.rdzv_host, o_.rdzv_port);
  if (o_.hosting == Hosting::always ||
      (o_.hosting == Hosting::if_local && names_this_machine(o_.rdzv_host))) {
    auto memory = std::make_shared<MemoryStore>(
        fmt::format("the {} rendezvous at {} (hosted by this agent)", o_.rdzv_name, where));
    try {
      rdzv_server_ = std::make_unique<StoreServer>(o_.rdzv_port, memory);
      share(std::move(memory));
      log(fmt::format("hosting the {} rendezvous at port {}", o_.rdzv_name, o_.rdzv_port));
      return;
    } catch (const std::system_error& e) {
      // torchrun's c10d: an agent of this host holds the port already, so
      // this one joins it.
      if (o_.hosting == Hosting::always || e.code().value() != EADDRINUSE)
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("cannot serve the {} rendezvous at port {} of this host: {}; is "
                                "another job (or torchrun) using it? give another {}",
                                o_.rdzv_name, o_.rdzv_port, e.code().message(),
                                o_.rdzv_name == "static" ? "--master-port" : "--rdzv-endpoint"));
    }
  }
  const std::string description = fmt::format("the {} rendezvous at {} (hosted by the agent on {})",
                                              o_.rdzv_name, where, o_.rdzv_host);
  store_ = std::make_unique<RendezvousClient>(o_.rdzv_host, o_.rdzv_port, o_.request_timeout,
                                              description);
  make_store_ = [host = o_.rdzv_host, port = o_.rdzv_port,
                 description](std::chrono::milliseconds timeout) {
    return std::make_unique<RendezvousClient>(host, port, timeout, description);
  };
}

void Agent::grant_first_lease() {
  const auto started = std::chrono::steady_clock::now();
  // A hosted rendezvous' host may start after this agent (torchrun's
  // TCPStore clients wait for theirs too): up to the join timeout.
  const auto patience = o_.rendezvous == RendezvousKind::hosted && !memory_
                            ? o_.join_timeout.value_or(std::chrono::seconds(600))
                            : milliseconds(0);
  for (bool waiting = false;;) {
    try {
      granted_at_ = KeepAlive::Clock::now();
      lease_ = store_->grant_lease(o_.lease_ttl.count());
      return;
    } catch (const StoreUnavailable& e) {
      if (std::chrono::steady_clock::now() - started < patience) {
        if (!waiting) {
          std::string why = e.what();
          if (why.starts_with(store_->describe() + ": "))
            why = why.substr(store_->describe().size() + 2);
          log(fmt::format("waiting for {} ({}); giving up after {} s", store_->describe(), why,
                          std::chrono::duration_cast<std::chrono::seconds>(patience).count()));
        }
        waiting = true;
        std::this_thread::sleep_for(o_.poll_interval);
        continue;
      }
      if (o_.rendezvous == RendezvousKind::hosted)
        throw Error(ErrorKind::communication,
                    fmt::format("cannot reach {}: {}; start the job's agent there (node rank 0 "
                                "for a static rendezvous) or give its address",
                                store_->describe(), e.what()));
      std::string hint =
          o_.rdzv.starts_with("https://")
              ? "; over TLS, check that etcd serves TLS there, that --rdzv-cacert is the CA of "
                "etcd's certificate, and that an etcd with --client-cert-auth gets a certificate "
                "of its CA (--rdzv-cert, --rdzv-key)"
              : "";
      throw Error(ErrorKind::communication,
                  fmt::format("cannot reach etcd for --rdzv {}: {}; start etcd there or give the "
                              "address of a running one{}",
                              o_.rdzv, e.what(), hint));
    } catch (const StoreError& e) {
      throw Error(ErrorKind::communication,
                  fmt::format("{} refused a lease: {}", store_->describe(), e.what()));
    }
  }
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

  prefix_ = "/ductile/agent/" + o_.job_id + "/";
  addr_ = o_.node_addr.empty() ? fully_qualified_host_name() : o_.node_addr;
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
  run_dir_.emplace(o_.job_id, o_.output);
  open_store();
  if (o_.rendezvous == RendezvousKind::embedded && o_.agent_store && o_.master_port != 0) {
    // One static node: its workers' store at the port asked.
    try {
      worker_store_ = std::make_unique<StoreServer>(o_.master_port, nullptr);
    } catch (const std::system_error& e) {
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("--master-port {} cannot be served on this host: {}; is another "
                              "job (or torchrun) using it? give another --master-port",
                              o_.master_port, e.code().message()));
    }
  }
  grant_first_lease();
  if (o_.mpi_world) mpi_server_ = std::make_unique<OmpiServer>();
}

Agent::Claim Agent::claim_node_key(std::optional<KeyValue>* holder) {
  const std::string k = key("nodes/" + id_), value = to_json(NodeInfo{id_, addr_, 0, o_.node_rank});
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

void Agent::withdraw(const Error& error) {
  keep_alive_.reset();
  try {
    store_->revoke_lease(lease_);
  } catch (const StoreError&) {
    // The lease expires on its own.
  }
  throw error;
}

void Agent::refuse_duplicate(const KeyValue& holder, const std::string& how) {
  std::string addr = "?";
  try {
    addr = node_from_json(holder.value, id_, 0).addr;
  } catch (const MalformedRecord&) {
  }
  withdraw(Error(ErrorKind::invalid_argument,
                 fmt::format("--node-id '{}' is in use: another agent of job '{}' on {} is "
                             "registered under it (address {}) and {}; give every agent its own "
                             "--node-id, or leave --node-id out for a generated one",
                             id_, o_.job_id, store_->describe(), addr, how)));
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
  if (o_.node_rank >= 0) mine["node_ranked"] = true;
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
  // A static rendezvous: one agent per node rank (the oldest keeps it).
  for (const auto& n : others_alive)
    if (o_.node_rank >= 0 && n.rank == o_.node_rank && n.create_revision < own_revision_) {
      withdraw(
          Error(ErrorKind::invalid_argument,
                fmt::format("--node-rank {} is in use: the agent '{}' (address {}) of job '{}' "
                            "on {} registered it first; give every node its own --node-rank "
                            "from 0 to {}",
                            o_.node_rank, n.id, n.addr, o_.job_id, store_->describe(),
                            settings_.max_nodes - 1)));
    }
  for (int attempt = 0; attempt < 5; ++attempt) {
    auto reads = store_->read({RangeRead{key("settings")}, RangeRead{key("round")}});
    std::optional<KeyValue> existing;
    if (!reads[0].empty()) existing = reads[0].front();
    if (existing && existing->value == settings_text_) return;
    // The settings of a run that ended before this agent registered are
    // that run's: this run writes its own (the round's end was written
    // after them).
    bool stale = false;
    if (existing && !reads[1].empty()) {
      try {
        RoundRecord round = round_from_json(reads[1].front().value);
        stale = previous_run(round, reads[1].front()) &&
                existing->mod_revision < reads[1].front().mod_revision;
      } catch (const MalformedRecord&) {
      }
    }
    if (existing && others && !stale) {
      std::vector<std::string> differences;
      try {
        differences = settings_differences(existing->value, settings_text_);
        if (differences.empty()) return;  // the same settings, written differently
      } catch (const MalformedRecord& e) {
        ignore_record(*existing, e.what(), "replaced by this agent's settings");
      }
      if (!differences.empty()) {
        withdraw(Error(ErrorKind::config,
                       fmt::format("job id '{}' is in use on {} with another configuration: {} ({} "
                                   "here); give another --job-id or the job's configuration",
                                   o_.job_id, store_->describe(), fmt::join(differences, "; "),
                                   o_.config.string())));
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
