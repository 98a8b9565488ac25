// Helpers of the agent tests: an etcd server on loopback with its own data
// dir, and a scan of /proc for processes that carry a test's marker in their
// environment (processes themselves: child_process.hpp).
#pragma once

#include <dirent.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "child_process.hpp"
#include "ductile/agent/etcd_store.hpp"
#include "ports.hpp"

namespace ductile::test {

#ifdef DUCTILE_ETCD
// etcd on loopback with free client and peer ports and its own data dir.
class EtcdServer {
 public:
  explicit EtcdServer(std::filesystem::path dir)
      : dir_(std::move(dir)), client_port_(free_tcp_port()), peer_port_(free_tcp_port()) {
    start();
  }
  ~EtcdServer() { stop(); }

  std::string url() const { return "etcd://127.0.0.1:" + std::to_string(client_port_); }
  std::string endpoint() const { return "http://127.0.0.1:" + std::to_string(client_port_); }
  pid_t pid() const { return process_ ? process_->pid() : -1; }

  void start() {
    std::string client = endpoint();
    std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    process_ = std::make_unique<Child>(
        std::vector<std::string>{
            DUCTILE_ETCD, "--name", "test", "--data-dir", (dir_ / "etcd-data").string(),
            "--listen-client-urls", client, "--advertise-client-urls", client, "--listen-peer-urls",
            peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "test=" + peer},
        std::vector<std::string>{}, dir_ / "etcd.log");
    agent::EtcdStore probe(endpoint(), 500ms);
    bool up = wait_until(
        [&] {
          try {
            probe.get("/probe");
            return true;
          } catch (const agent::StoreError&) {
            return false;
          }
        },
        30s);
    if (!up) throw std::runtime_error("etcd did not start: " + read_text(dir_ / "etcd.log"));
  }
  void kill_hard() {
    process_->signal(SIGKILL);
    process_->wait(10s);
    process_.reset();
  }
  void stop() {
    if (!process_) return;
    process_->signal(SIGTERM);
    if (!process_->wait(10s)) process_->signal(SIGKILL);
    process_.reset();
  }

 private:
  std::filesystem::path dir_;
  int client_port_, peer_port_;
  std::unique_ptr<Child> process_;
};
#endif

// A unique marker: every process of a test's job has it in its environment.
inline std::string new_marker() {
  std::random_device random;
  return "DUCTILE_AGENT_TEST_MARKER=" + std::to_string(getpid()) + "-" + std::to_string(random());
}

// Processes (not zombies) whose environment holds `marker`.
inline std::vector<int> marked_processes(const std::string& marker) {
  std::vector<int> found;
  DIR* proc = opendir("/proc");
  if (!proc) return found;
  while (dirent* entry = readdir(proc)) {
    std::string name = entry->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string environ_text = read_text("/proc/" + name + "/environ");
    std::string needle = marker;
    needle.push_back('\0');
    if (environ_text.find(needle) != std::string::npos ||
        (environ_text.size() >= marker.size() &&
         environ_text.compare(environ_text.size() - marker.size(), marker.size(), marker) == 0))
      found.push_back(std::stoi(name));
  }
  closedir(proc);
  return found;
}

inline bool no_marked_processes(const std::string& marker, std::chrono::milliseconds limit = 10s) {
  return wait_until([&] { return marked_processes(marker).empty(); }, limit);
}

}  // namespace ductile::test
