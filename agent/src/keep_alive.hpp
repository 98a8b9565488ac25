// The agent's lease keep-alive: a helper thread on its own etcd connection,
// so that a slow step of the main loop (stopping workers) never lets the
// lease expire. Internal to libductile_agent.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "ductile/agent/etcd_store.hpp"

namespace ductile::agent {

// Renews `lease` every `period` until destroyed; lost() tells when etcd said
// the lease no longer exists (the caller registers again).
class KeepAlive {
 public:
  KeepAlive(std::string endpoint, EtcdTls tls, std::int64_t lease, std::chrono::milliseconds period)
      : endpoint_(std::move(endpoint)), tls_(std::move(tls)), lease_(lease), period_(period) {
    thread_ = std::thread([this] { run(); });
  }
  ~KeepAlive() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void set_lease(std::int64_t lease) {
    std::lock_guard lock(mutex_);
    lease_ = lease;
    lost_ = false;
  }
  bool lost() {
    std::lock_guard lock(mutex_);
    return lost_;
  }

 private:
  void run() {
    EtcdStore store(endpoint_, std::min(period_, std::chrono::milliseconds(2000)), tls_);
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      std::int64_t lease = lease_;
      lock.unlock();
      bool alive = true;
      try {
        alive = store.keep_alive(lease);
      } catch (const StoreError&) {
        // Unreachable: the main loop notices and reports it.
      }
      lock.lock();
      if (!alive && lease == lease_) lost_ = true;
      wake_.wait_for(lock, period_, [this] { return stopping_; });
    }
  }
  std::string endpoint_;
  EtcdTls tls_;
  std::int64_t lease_;
  std::chrono::milliseconds period_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool lost_ = false;
  std::thread thread_;
};

}  // namespace ductile::agent
