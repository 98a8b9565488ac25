// Helpers of the agent tests: an etcd server on loopback with its own data
// dir, `ductile agent` processes with their output in a file, and a scan of
// /proc for processes that carry a test's marker in their environment.
#pragma once

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ductile/agent/etcd_store.hpp"
#include "ports.hpp"

extern char** environ;

namespace ductile::test {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Waits until `done()` or `limit` passed; true when done. A liveness bound,
// not a timing assertion: limits are generous.
inline bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  auto deadline = Clock::now() + limit;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(50ms);
  }
  return true;
}

inline std::string read_text(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1))
    ++n;
  return n;
}

// A child process with stdout and stderr in `log`; killed with the test.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::vector<std::string>& env_add,
        std::filesystem::path log)
      : log_(std::move(log)) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) env.emplace_back(*e);
    env.insert(env.end(), env_add.begin(), env_add.end());
    std::vector<char*> args, envp;
    std::vector<std::string> argv_copy = argv;
    for (auto& a : argv_copy) args.push_back(a.data());
    args.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t parent = getpid();
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      setpgid(0, 0);
      int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      int devnull = open("/dev/null", O_RDONLY);
      dup2(devnull, 0);
      execve(args[0], args.data(), envp.data());
      _exit(127);
    }
  }
  ~Child() {
    if (!status_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  std::string output() const { return read_text(log_); }
  bool wait_for_output(const std::string& text, std::chrono::milliseconds limit,
                       std::size_t times = 1) const {
    return wait_until([&] { return count_of(output(), text) >= times; }, limit);
  }
  void signal(int sig) { kill(pid_, sig); }
  // The exit status (128 + signal when killed), or nullopt when still running.
  std::optional<int> poll() {
    if (status_) return status_;
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_)
      status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return status_;
  }
  std::optional<int> wait(std::chrono::milliseconds limit) {
    wait_until([&] { return poll().has_value(); }, limit);
    return poll();
  }

 private:
  std::filesystem::path log_;
  pid_t pid_ = -1;
  std::optional<int> status_;
};

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
