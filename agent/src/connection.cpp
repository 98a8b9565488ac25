// The agent's line to the rendezvous: the store of its kind, the lease and
// its keep-alive, the records it ignored. See connection.hpp.
#include "connection.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <algorithm>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "ductile/agent/etcd_store.hpp"
#include "ductile/error.hpp"
#include "store_mirror.hpp"

namespace ductile::agent {

using std::chrono::milliseconds;

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

// Bounds of the job's secret: a passphrase or a few random bytes in hex.
constexpr std::size_t kMaxSecretBytes = 4096;
// Ignored records logged line by line per kind; the others are counted.
constexpr std::size_t kIgnoredLoggedPerKind = 5;
// Keys remembered as ignored: past it the memory is cleared (the records
// are read again, and counted, not logged anew).
constexpr std::size_t kMaxIgnoredKeys = 100000;

Error bad_secret(const std::string& what) {
  return Error(ErrorKind::invalid_argument, what);
}

// The secret in DUCTILE_RDZV_SECRET_FILE's file: a regular file (no FIFO or
// device to block on) of at most kMaxSecretBytes, not empty; one trailing
// newline (\n or \r\n) is not part of it. Its permissions are the
// user's business: they are not checked.
std::string secret_from_file(const std::string& path) {
  const std::string variable = "DUCTILE_RDZV_SECRET_FILE=" + path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0)
    throw bad_secret(
        fmt::format("{}: cannot open it: {}; give a readable file that holds the "
                    "job's secret",
                    variable, std::strerror(errno)));
  struct stat st{};
  std::string secret;
  std::string problem;
  if (::fstat(fd, &st) != 0) {
    problem = fmt::format("cannot stat it: {}", std::strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    problem = "not a regular file";
  } else if (static_cast<std::uint64_t>(st.st_size) > kMaxSecretBytes + 2) {
    problem = fmt::format("{} bytes, more than a secret may have", st.st_size);
  } else {
    secret.resize(kMaxSecretBytes + 3);
    std::size_t got = 0;
    for (;;) {
      ssize_t n = ::read(fd, secret.data() + got, secret.size() - got);
      if (n > 0 && (got += static_cast<std::size_t>(n)) < secret.size()) continue;
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) problem = fmt::format("cannot read it: {}", std::strerror(errno));
      break;
    }
    secret.resize(got);
  }
  ::close(fd);
  if (problem.empty()) {
    if (secret.ends_with("\r\n"))
      secret.resize(secret.size() - 2);
    else if (secret.ends_with("\n"))
      secret.pop_back();
    if (secret.empty())
      problem = "it is empty";
    else if (secret.size() > kMaxSecretBytes)
      problem = fmt::format("{} bytes, more than a secret may have", secret.size());
  }
  if (!problem.empty())
    throw bad_secret(
        fmt::format("{}: {}; give a regular file of 1 to {} bytes that holds the "
                    "job's secret",
                    variable, problem, kMaxSecretBytes));
  return secret;
}

// The job's secret from the environment and where it came from; empty when
// neither variable is set.
std::pair<std::string, std::string> secret_from_environment() {
  const char* file = std::getenv("DUCTILE_RDZV_SECRET_FILE");
  const char* value = std::getenv("DUCTILE_RDZV_SECRET");
  if (file && value)
    throw bad_secret(
        "DUCTILE_RDZV_SECRET and DUCTILE_RDZV_SECRET_FILE are both set: set one of them");
  if (file) return {secret_from_file(file), "DUCTILE_RDZV_SECRET_FILE"};
  if (!value) return {};
  const std::size_t size = std::strlen(value);
  if (size == 0 || size > kMaxSecretBytes)
    throw bad_secret(
        fmt::format("DUCTILE_RDZV_SECRET has {} bytes; give 1 to {} bytes (or unset "
                    "it for a job without a secret)",
                    size, kMaxSecretBytes));
  return {value, "DUCTILE_RDZV_SECRET"};
}

}  // namespace

void RendezvousConnection::open() {
  auto share = [this](std::shared_ptr<MemoryStore> memory) {
    memory_ = std::move(memory);
    store_ = std::make_unique<SharedStore>(memory_);
    make_store_ = [memory = memory_](std::chrono::milliseconds) {
      return std::make_unique<SharedStore>(memory);
    };
  };
  // Every kind: the snapshot servers (snapshot_server.hpp) ask for it too.
  std::tie(secret_, secret_source_) = secret_from_environment();
  snapshot_auth_ = SnapshotAuth(secret_);
  switch (o_.rendezvous) {
    case RendezvousKind::etcd: {
      std::string endpoint = etcd_endpoint_from_url(o_.rdzv, "--rdzv");
      check_etcd_tls(o_.rdzv, o_.tls, {"--rdzv", "--rdzv-cacert", "--rdzv-cert", "--rdzv-key"});
      // A job over TLS copies its snapshots over TLS too, with the same
      // files (loaded now: a bad one stops the agent at its start); the
      // system's CAs verify the peers when no --rdzv-cacert is given, as
      // they verify the etcd then.
      if (endpoint.starts_with("https://") && !o_.tls.cert_file.empty()) {
        snapshot_auth_.tls = std::make_shared<const SnapshotTls>(
            o_.tls, std::vector<std::string>{"--rdzv-cacert", "--rdzv-cert", "--rdzv-key"});
        if (o_.tls.ca_file.empty())
          self_.log(
              "warning: the snapshot copies between agents run over TLS verified against the "
              "system's CAs (no --rdzv-cacert): give --rdzv-cacert with the CA that signed the "
              "agents' certificates if it is not one of them");
      } else if (endpoint.starts_with("https://")) {
        // Mutual TLS needs a certificate on each side: without one the
        // copies cannot be encrypted, and the user is told so.
        self_.log(fmt::format(
            "warning: the etcd is reached over TLS, but the snapshot copies between agents run "
            "over plain TCP ({}): give --rdzv-cert and --rdzv-key (with --rdzv-cacert) to copy "
            "them over TLS",
            secret_.empty() ? "readable by anyone who can reach the agents' snapshot ports: no "
                              "DUCTILE_RDZV_SECRET either"
                            : "authenticated by DUCTILE_RDZV_SECRET, not encrypted"));
      }
      // The job's keys are followed by a watch, not read at every pass
      // (store_mirror.hpp), from the registration on: its request reads
      // them.
      // A new agent follows its own part until it finds itself among the
      // oldest (agent.cpp).
      auto mirror = std::make_unique<MirroredStore>(
          std::make_unique<EtcdStore>(endpoint, o_.request_timeout, o_.tls),
          [endpoint, timeout = o_.request_timeout, tls = o_.tls] {
            return std::make_unique<EtcdStore>(endpoint, timeout, tls);
          },
          std::vector<KeyRange>{}, o_.request_timeout,
          [this](const std::string& line) { self_.log(line); });
      mirror->follow_with_next_swap(own_part());
      mirror_ = mirror.get();
      store_ = std::move(mirror);
      make_store_ = [endpoint, tls = o_.tls](std::chrono::milliseconds timeout) {
        // Each member in turn within `timeout`: a silent one leaves the
        // others time to answer.
        const auto members = 1 + std::count(endpoint.begin(), endpoint.end(), ',');
        return std::make_unique<EtcdStore>(endpoint, timeout / members, tls);
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
      rdzv_server_ =
          std::make_unique<StoreServer>(o_.rdzv_host, o_.rdzv_port, memory, StoreLimits{}, secret_);
      share(std::move(memory));
      self_.log(fmt::format("hosting the {} rendezvous at port {}", o_.rdzv_name, o_.rdzv_port));
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
                                              description, secret_);
  make_store_ = [host = o_.rdzv_host, port = o_.rdzv_port, description,
                 secret = secret_](std::chrono::milliseconds timeout) {
    return std::make_unique<RendezvousClient>(host, port, timeout, description, secret);
  };
}

void RendezvousConnection::grant_first_lease() {
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
    } catch (const StoreRefused& e) {
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("{} (this agent's secret: {})", e.what(),
                              secret_source_.empty() ? "none, neither DUCTILE_RDZV_SECRET nor "
                                                       "DUCTILE_RDZV_SECRET_FILE is set"
                                                     : "from " + secret_source_));
    } catch (const StoreUnavailable& e) {
      // An etcd that answers too slowly (overloaded by a job's agents
      // starting together, or stopped for a moment) is waited for as an
      // outage is, not taken for an address where none runs.
      const bool slow =
          dynamic_cast<const StoreTimeout*>(&e) != nullptr && o_.rendezvous == RendezvousKind::etcd;
      const auto budget = slow ? std::chrono::duration_cast<milliseconds>(o_.store_timeout)
                               : std::chrono::duration_cast<milliseconds>(patience);
      if (std::chrono::steady_clock::now() - started < budget) {
        if (!waiting) {
          std::string why = e.what();
          if (why.starts_with(store_->describe() + ": "))
            why = why.substr(store_->describe().size() + 2);
          self_.log(fmt::format("waiting for {} ({}); giving up after {} s", store_->describe(),
                                why,
                                std::chrono::duration_cast<std::chrono::seconds>(budget).count()));
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

void RendezvousConnection::ignore_record(const KeyValue& kv, const std::string& problem,
                                         const std::string& outcome) {
  if (ignored_.size() >= kMaxIgnoredKeys && !ignored_.count(kv.key)) ignored_.clear();
  auto [it, inserted] = ignored_.try_emplace(kv.key, kv.mod_revision);
  if (!inserted && it->second == kv.mod_revision) return;
  it->second = kv.mod_revision;
  // The kind: the key's directory under the job's prefix, else the key.
  std::string kind = kv.key;
  if (kind.starts_with(self_.prefix))
    if (auto slash = kind.find('/', self_.prefix.size()); slash != std::string::npos)
      kind.resize(slash + 1);
  IgnoredKind& k = ignored_kinds_[kind];
  if (k.logged < kIgnoredLoggedPerKind) {
    ++k.logged;
    self_.log(fmt::format("ignoring {} (revision {}): {}; {}{}", kv.key, kv.mod_revision, problem,
                          outcome,
                          k.logged == kIgnoredLoggedPerKind
                              ? fmt::format(" (more records under {} that are ignored are "
                                            "counted, not logged one by one)",
                                            kind)
                              : ""));
    return;
  }
  ++k.unlogged;
  k.last = fmt::format("{} (revision {}): {}; {}", kv.key, kv.mod_revision, problem, outcome);
}

bool RendezvousConnection::ignored(const KeyValue& kv) const {
  auto it = ignored_.find(kv.key);
  return it != ignored_.end() && it->second == kv.mod_revision;
}

void RendezvousConnection::report_ignored() {
  for (auto& [kind, k] : ignored_kinds_) {
    if (k.unlogged == 0) continue;
    self_.log(
        fmt::format("ignoring {} more record(s) under {}, the last {}", k.unlogged, kind, k.last));
    k.unlogged = 0;
  }
}

void RendezvousConnection::leave_fenced_lease() {
  // The lease may still be alive (the others then still count this node in
  // its round): revoking it removes this node's key. Said once the store
  // answered: while it does not, the caller's outage goes on.
  store_->revoke_lease(lease_);
  self_.log(fmt::format("{} reachable again after the fence: left the old lease, registering anew",
                        store_->describe()));
  renew_lease();
}

std::string RendezvousConnection::workers_during_outage() {
  if (keep_alive_ && keep_alive_->fenced())
    return "the fence stopped this node's workers (no lease renewal)";
  return "the workers keep running until the fence stops them (no lease renewal for 3/4 of the "
         "lease TTL)";
}

void RendezvousConnection::start_keep_alive() {
  keep_alive_ = std::make_shared<KeepAlive>(make_store_, lease_, o_.lease_ttl, granted_at_,
                                            [this](const std::string& line) { self_.log(line); });
}

void RendezvousConnection::renew_lease() {
  auto sent = KeepAlive::Clock::now();
  lease_ = store_->grant_lease(o_.lease_ttl.count());
  keep_alive_->set_lease(lease_, sent);
}

void RendezvousConnection::fence_workers(const std::vector<int>& guard_pids) {
  if (keep_alive_) keep_alive_->fence_workers(guard_pids);
}

void RendezvousConnection::close() {
  keep_alive_.reset();
  try {
    store_->revoke_lease(lease_);
  } catch (const StoreError&) {
    // etcd is gone: the lease expires on its own.
  }
}

std::vector<KeyRange> RendezvousConnection::own_part() const {
  // The keys sort as checkpoint/, done/, draining/, failure/, holdings/,
  // nodes/, restore/, round, saved/, settings, snapshots/: two ranges hold
  // every key an agent that does not lead acts on.
  return {KeyRange{self_.key("checkpoint/"), self_.key("holdings/")},
          KeyRange{self_.key("restore/"), self_.key("snapshots/")},
          single_key(self_.key("nodes/" + self_.id))};
}

void RendezvousConnection::follow_everything(bool everything) {
  if (!mirror_ || everything == following_everything_) return;
  following_everything_ = everything;
  if (!everything) return mirror_->follow(own_part());
  // Every key but the age index's, which only agents that follow their
  // own part read (from etcd: the first few keys of it), and which would
  // bring these each agent's registration twice.
  const KeyRange all = prefix_range(self_.prefix);
  mirror_->follow({KeyRange{all.key, self_.key("ages/")}, KeyRange{self_.key("ages0"), all.end}});
}

void RendezvousConnection::linger_as_host() {
  if (!rdzv_server_) return;
  // The others leave once they read the end (their keys go with their
  // leases); a killed one's key expires within the TTL.
  const auto deadline = std::chrono::steady_clock::now() + o_.lease_ttl + o_.poll_interval * 2;
  while (std::chrono::steady_clock::now() < deadline) {
    auto nodes = store_->get_prefix(self_.key("nodes/"));
    if (std::none_of(nodes.begin(), nodes.end(),
                     [&](const KeyValue& kv) { return kv.key != self_.key("nodes/" + self_.id); }))
      return;
    std::this_thread::sleep_for(o_.poll_interval / 2);
  }
}

}  // namespace ductile::agent
