// Processes a test starts and watches: a child with its output in a file,
// waiting with a bound, reading what it wrote.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

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

// A child process in its own process group with stdout and stderr in `log`
// (appended); `env_add` entries ("NAME=value") replace or extend the test's
// environment. It dies with the test (PR_SET_PDEATHSIG) and is killed with
// its group when the object goes first.
class Child {
 public:
  Child(const std::vector<std::string>& argv, const std::vector<std::string>& env_add,
        std::filesystem::path log)
      : log_(std::move(log)) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string entry(*e);
      bool replaced = false;
      for (const auto& add : env_add)
        replaced |= entry.compare(0, add.find('=') + 1, add, 0, add.find('=') + 1) == 0;
      if (!replaced) env.push_back(std::move(entry));
    }
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
      kill(-pid_, SIGKILL);
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

}  // namespace ductile::test
