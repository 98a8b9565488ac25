// The agent's line to the rendezvous: the store of its kind, the lease and
// its keep-alive, the records it ignored. See connection.hpp.
#include "connection.hpp"

#include <cerrno>

#include <algorithm>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "ductile/agent/etcd_store.hpp"
#include "ductile/error.hpp"

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

}  // namespace

void RendezvousConnection::open() {
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
                                              description);
  make_store_ = [host = o_.rdzv_host, port = o_.rdzv_port,
                 description](std::chrono::milliseconds timeout) {
    return std::make_unique<RendezvousClient>(host, port, timeout, description);
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
    } catch (const StoreUnavailable& e) {
      if (std::chrono::steady_clock::now() - started < patience) {
        if (!waiting) {
          std::string why = e.what();
          if (why.starts_with(store_->describe() + ": "))
            why = why.substr(store_->describe().size() + 2);
          self_.log(
              fmt::format("waiting for {} ({}); giving up after {} s", store_->describe(), why,
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

void RendezvousConnection::ignore_record(const KeyValue& kv, const std::string& problem,
                                         const std::string& outcome) {
  auto [it, inserted] = ignored_.try_emplace(kv.key, kv.mod_revision);
  if (!inserted && it->second == kv.mod_revision) return;
  it->second = kv.mod_revision;
  self_.log(
      fmt::format("ignoring {} (revision {}): {}; {}", kv.key, kv.mod_revision, problem, outcome));
}

void RendezvousConnection::start_keep_alive() {
  keep_alive_ = std::make_unique<KeepAlive>(make_store_, lease_, o_.lease_ttl, granted_at_,
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
