// Worker processes under guards; see workers.hpp.
#include "ductile/agent/workers.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <system_error>

#include <fmt/format.h>

namespace ductile::agent {
namespace {

constexpr std::size_t kKeptLines = 20;

std::mutex& output_mutex() {
  static std::mutex m;
  return m;
}

std::string resolve_on_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  std::size_t begin = 0;
  while (begin <= dirs.size()) {
    auto end = dirs.find(':', begin);
    if (end == std::string::npos) end = dirs.size();
    std::string dir = dirs.substr(begin, end - begin);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
    begin = end + 1;
  }
  return name;  // execve fails with ENOENT; reported as exit 127
}

void write_all(int fd, const char* text, std::size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, text, n);
    if (w <= 0) return;
    text += w;
    n -= static_cast<std::size_t>(w);
  }
}

void write_all(int fd, const char* text) {
  write_all(fd, text, std::strlen(text));
}

int encode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

// The guard: runs in the forked child; only async-signal-safe calls from
// here on (the agent has other threads).
[[noreturn]] void run_guard(pid_t agent, const char* path, char* const* argv, char* const* envp,
                            int out_fd, int err_fd) {
  sigset_t guarded;
  sigemptyset(&guarded);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGCHLD, SIGUSR1, SIGQUIT}) sigaddset(&guarded, s);
  sigprocmask(SIG_BLOCK, &guarded, nullptr);
  setpgid(0, 0);  // not in the agent's group: a terminal's Ctrl-C goes to the agent only
  prctl(PR_SET_PDEATHSIG, SIGHUP);
  if (getppid() != agent) _exit(128 + SIGHUP);
  pid_t guard = getpid();
  pid_t worker = fork();
  if (worker < 0) {
    write_all(err_fd, "ductile agent: cannot fork a worker process\n");
    _exit(127);
  }
  if (worker == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != guard) _exit(128 + SIGKILL);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int s = 1; s < NSIG; ++s) sigaction(s, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) dup2(devnull, 0);
    dup2(out_fd, 1);
    dup2(err_fd, 2);
    execve(path, argv, envp);
    int e = errno;
    write_all(2, "ductile agent: cannot execute ");
    write_all(2, path);
    write_all(2, ": ");
    write_all(2, strerrordesc_np(e));
    write_all(2, "\n");
    _exit(127);
  }
  setpgid(worker, worker);
  close(out_fd);
  close(err_fd);
  timespec second{1, 0};
  for (;;) {
    siginfo_t info;
    int sig = sigtimedwait(&guarded, &info, &second);
    int status = 0;
    pid_t done = waitpid(worker, &status, WNOHANG);
    if (done == worker) {
      kill(-worker, SIGKILL);  // children the worker left behind
      _exit(encode_status(status));
    }
    if (sig == SIGTERM || sig == SIGINT) {
      kill(-worker, SIGTERM);
    } else if (sig == SIGHUP || sig == SIGUSR1 || sig == SIGQUIT || getppid() != agent) {
      kill(-worker, SIGKILL);
      while (waitpid(worker, &status, 0) < 0 && errno == EINTR) {
      }
      _exit(encode_status(status));
    }
  }
}

}  // namespace

int StreamsByRank::of(std::int64_t local_rank) const {
  if (by_rank.empty()) return all;
  auto it = by_rank.find(local_rank);
  return it == by_rank.end() ? kNoStreams : it->second;
}

void write_line(bool to_stderr, const std::string& line) {
  std::lock_guard lock(output_mutex());
  FILE* f = to_stderr ? stderr : stdout;
  std::fwrite(line.data(), 1, line.size(), f);
  std::fputc('\n', f);
  std::fflush(f);
}

WorkerGroup::~WorkerGroup() {
  stop(std::chrono::milliseconds(0));
}

void WorkerGroup::start(const std::vector<WorkerSpec>& specs) {
  stop(std::chrono::milliseconds(0));
  pid_t agent = getpid();
  for (const auto& spec : specs) {
    if (spec.argv.empty()) throw std::invalid_argument("worker command is empty");
    std::string path = resolve_on_path(spec.argv[0]);
    std::vector<std::string> argv_copy = spec.argv, env_copy = spec.env;
    std::vector<char*> argv, envp;
    for (auto& a : argv_copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env_copy) envp.push_back(e.data());
    envp.push_back(nullptr);
    // The log files first: a worker is started only once its output has
    // somewhere to go.
    int files[2] = {-1, -1};
    for (int i = 0; i < 2; ++i) {
      const auto& file = i == 0 ? spec.stdout_file : spec.stderr_file;
      if (file.empty()) continue;
      std::error_code ignored;
      std::filesystem::create_directories(file.parent_path(), ignored);
      files[i] = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (files[i] < 0) {
        const int e = errno;
        if (i == 1 && files[0] >= 0) close(files[0]);
        throw std::system_error(e, std::generic_category(), "cannot open " + file.string());
      }
    }
    auto close_files = [&] {
      for (int fd : files)
        if (fd >= 0) close(fd);
    };
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0) {
      const int e = errno;
      close_files();
      throw std::system_error(e, std::generic_category(), "pipe");
    }
    if (pipe2(err, O_CLOEXEC) != 0) {
      const int e = errno;
      close(out[0]);
      close(out[1]);
      close_files();
      throw std::system_error(e, std::generic_category(), "pipe");
    }
    pid_t guard = fork();
    if (guard < 0) {
      int e = errno;
      for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
      close_files();
      throw std::system_error(e, std::generic_category(), "fork");
    }
    if (guard == 0) run_guard(agent, path.c_str(), argv.data(), envp.data(), out[1], err[1]);
    setpgid(guard, guard);
    close(out[1]);
    close(err[1]);
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);
    Worker w;
    w.spec = spec;
    w.guard_pid = guard;
    w.out_fd = out[0];
    w.err_fd = err[0];
    w.out_file = files[0];
    w.err_file = files[1];
    workers_.push_back(std::move(w));
  }
}

void WorkerGroup::emit_line(Worker& w, const std::string& line, bool is_err) {
  if (is_err ? w.spec.stderr_console : w.spec.stdout_console)
    write_line(is_err, fmt::format("[rank {}]: {}", w.spec.rank, line));
  w.last_lines.push_back(line);
  if (w.last_lines.size() > kKeptLines) w.last_lines.pop_front();
}

void WorkerGroup::read_output(Worker& w, int& fd, std::string& partial, bool is_err) {
  if (fd < 0) return;
  char buffer[16384];
  for (;;) {
    ssize_t n = read(fd, buffer, sizeof buffer);
    if (n > 0) {
      if (int file = is_err ? w.err_file : w.out_file; file >= 0)
        write_all(file, buffer, static_cast<std::size_t>(n));
      partial.append(buffer, static_cast<std::size_t>(n));
      std::size_t pos;
      while ((pos = partial.find('\n')) != std::string::npos) {
        emit_line(w, partial.substr(0, pos), is_err);
        partial.erase(0, pos + 1);
      }
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // End of file (or an error): the worker and its children closed it.
    if (!partial.empty()) emit_line(w, partial, is_err);
    partial.clear();
    close(fd);
    fd = -1;
    return;
  }
}

void WorkerGroup::reap() {
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    auto& w = workers_[i];
    if (w.status) continue;
    int status = 0;
    pid_t r = waitpid(w.guard_pid, &status, WNOHANG);
    if (r == w.guard_pid) {
      // Output written just before the exit is still in the pipe.
      read_output(w, w.out_fd, w.out_partial, false);
      read_output(w, w.err_fd, w.err_partial, true);
      w.status = encode_status(status);
      if (*w.status != 0 && !first_failed_) first_failed_ = i;
    }
  }
}

void WorkerGroup::pump(std::chrono::milliseconds wait) {
  std::vector<pollfd> fds;
  for (auto& w : workers_) {
    if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0});
    if (w.err_fd >= 0) fds.push_back({w.err_fd, POLLIN, 0});
  }
  if (fds.empty()) {
    if (wait.count() > 0) usleep(static_cast<useconds_t>(wait.count() * 1000));
  } else {
    int rc = poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
    (void)rc;
  }
  for (auto& w : workers_) {
    read_output(w, w.out_fd, w.out_partial, false);
    read_output(w, w.err_fd, w.err_partial, true);
  }
  reap();
}

bool WorkerGroup::running() const {
  for (const auto& w : workers_)
    if (!w.status) return true;
  return false;
}

std::vector<int> WorkerGroup::guard_pids() const {
  std::vector<int> pids;
  for (const auto& w : workers_)
    if (!w.status) pids.push_back(w.guard_pid);
  return pids;
}

std::optional<WorkerExit> WorkerGroup::first_failure() const {
  if (!first_failed_) return std::nullopt;
  const auto& w = workers_[*first_failed_];
  return WorkerExit{w.spec.rank, w.spec.local_rank, *w.status,
                    std::vector<std::string>(w.last_lines.begin(), w.last_lines.end())};
}

bool WorkerGroup::all_succeeded() const {
  if (workers_.empty()) return false;
  for (const auto& w : workers_)
    if (!w.status || *w.status != 0) return false;
  return true;
}

void WorkerGroup::stop(std::chrono::milliseconds grace) {
  if (workers_.empty()) return;
  using clock = std::chrono::steady_clock;
  auto signal_all = [&](int sig) {
    for (auto& w : workers_)
      if (!w.status) kill(w.guard_pid, sig);
  };
  signal_all(SIGTERM);
  auto deadline = clock::now() + grace;
  while (running() && clock::now() < deadline) pump(std::chrono::milliseconds(20));
  if (running()) {
    signal_all(SIGUSR1);  // the guard kills the worker's process group
    deadline = clock::now() + std::chrono::seconds(2);
    while (running() && clock::now() < deadline) pump(std::chrono::milliseconds(20));
  }
  if (running()) {
    signal_all(SIGKILL);
    for (auto& w : workers_) {
      if (w.status) continue;
      int status = 0;
      while (waitpid(w.guard_pid, &status, 0) < 0 && errno == EINTR) {
      }
      w.status = encode_status(status);
    }
  }
  for (auto& w : workers_) {
    read_output(w, w.out_fd, w.out_partial, false);
    read_output(w, w.err_fd, w.err_partial, true);
    for (int* fd : {&w.out_fd, &w.err_fd, &w.out_file, &w.err_file})
      if (*fd >= 0) {
        close(*fd);
        *fd = -1;
      }
  }
  workers_.clear();
  first_failed_.reset();
}

}  // namespace ductile::agent
