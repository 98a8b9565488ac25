// Worker processes under guards; see workers.hpp.
#include "ductile/agent/workers.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "agent_common.hpp"
#include "ductile/core/text.hpp"
#include "worker_guard.hpp"

namespace ductile::agent {
namespace {

std::mutex& output_mutex() {
  static std::mutex m;
  return m;
}

std::string resolve_on_path(const std::string& name) {
  if (name.find('/') != std::string::npos) return name;
  const char* path = std::getenv("PATH");
  for (const auto& dir : split(path ? path : "/usr/local/bin:/usr/bin:/bin", ':')) {
    std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return name;  // execve fails with ENOENT; reported as exit 127
}

// Where a worker's stream goes: the agent's own descriptor (1, 2), a log
// file, /dev/null or a pipe the agent reads; fd_to_close: the agent's copy
// of it, closed once the guard has its own.
struct StreamTarget {
  int worker_fd = -1;
  int fd_to_close = -1;
  int pipe_read = -1;  // teed: the agent's end
  int teed_file = -1;  // teed: the log file the agent writes
};

// Closes each of `fds` that is open, and marks it closed.
void close_fds(std::initializer_list<int*> fds) {
  for (int* fd : fds)
    if (*fd >= 0) {
      close(*fd);
      *fd = -1;
    }
}

void close_target(StreamTarget& t) {
  close_fds({&t.fd_to_close, &t.pipe_read, &t.teed_file});
}

int open_log_file(const std::filesystem::path& file) {
  std::error_code ignored;
  std::filesystem::create_directories(file.parent_path(), ignored);
  int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0)
    throw std::system_error(errno, std::generic_category(), "cannot open " + file.string());
  return fd;
}

StreamTarget target_of(const std::filesystem::path& file, bool console, int own_fd) {
  StreamTarget t;
  if (file.empty()) {
    if (console) {
      t.worker_fd = own_fd;
    } else {
      t.fd_to_close = t.worker_fd = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
      if (t.worker_fd < 0)
        throw std::system_error(errno, std::generic_category(), "cannot open /dev/null");
    }
    return t;
  }
  if (!console) {
    t.fd_to_close = t.worker_fd = open_log_file(file);
    return t;
  }
  t.teed_file = open_log_file(file);
  int ends[2];
  if (pipe2(ends, O_CLOEXEC) != 0) {
    const int e = errno;
    close_target(t);
    throw std::system_error(e, std::generic_category(), "pipe");
  }
  t.pipe_read = ends[0];
  t.fd_to_close = t.worker_fd = ends[1];
  fcntl(t.pipe_read, F_SETFL, O_NONBLOCK);
  return t;
}

// Forks the guard of one process (a worker or a spare) and returns its pid;
// the guard leads a process group of its own.
pid_t fork_guard(pid_t agent, const std::vector<std::string>& argv_words,
                 const std::vector<std::string>& env, int out_fd, int err_fd, int launch_fd,
                 std::chrono::milliseconds grace) {
  // Built before fork: the guard may not allocate.
  std::string path = resolve_on_path(argv_words.front());
  std::vector<std::string> argv_copy = argv_words, env_copy = env;
  std::vector<char*> argv, envp;
  for (auto& a : argv_copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env_copy) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t guard = fork();
  if (guard < 0) throw std::system_error(errno, std::generic_category(), "fork");
  if (guard == 0)
    run_guard(agent, path.c_str(), argv.data(), envp.data(), out_fd, err_fd, launch_fd,
              grace.count());
  setpgid(guard, guard);
  return guard;
}

// The environment without the variables of one round, sorted: what a spare
// starts with, and what a round's worker must share with it.
std::vector<std::string> static_env_of(const std::vector<std::string>& env,
                                       const SpareSetup& setup) {
  std::vector<std::string> kept;
  for (const auto& entry : env)
    if (!setup.is_round_variable(entry.substr(0, entry.find('=')))) kept.push_back(entry);
  std::sort(kept.begin(), kept.end());
  return kept;
}

// The first variable set differently in two sorted environments.
std::string first_difference(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  auto [in_a, in_b] = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  const std::string& entry = in_a != a.end() ? *in_a : *in_b;
  return entry.substr(0, entry.find('='));
}

// A spare's launch record (workers.hpp): NUL-terminated fields.
std::string launch_record(const WorkerSpec& spec, std::size_t interpreter_words) {
  std::string record;
  auto field = [&](const std::string& text) {
    record += text;
    record += '\0';
  };
  field("ductile-warm-start-1");
  std::error_code ec;
  field(std::filesystem::current_path(ec).string());
  field(std::to_string(spec.argv.size() - interpreter_words));
  for (std::size_t i = interpreter_words; i < spec.argv.size(); ++i) field(spec.argv[i]);
  for (const auto& entry : spec.env) field(entry);
  return record;
}

// How long start() waits for a ready spare to take its launch record.
constexpr std::chrono::seconds kSpareSendTimeout{5};

// Sends `record` to a spare, the worker's stdout and stderr with its first
// bytes, then ends the stream. Returns 0, or the errno of the failure
// (ETIMEDOUT: not taken in time).
int send_launch(int fd, const std::string& record, int out_fd, int err_fd) {
  const int fds[2] = {out_fd, err_fd};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof fds)] = {};
  iovec piece{const_cast<char*>(record.data()), record.size()};
  msghdr message{};
  message.msg_iov = &piece;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof control;
  cmsghdr* rights = CMSG_FIRSTHDR(&message);
  rights->cmsg_level = SOL_SOCKET;
  rights->cmsg_type = SCM_RIGHTS;
  rights->cmsg_len = CMSG_LEN(sizeof fds);
  std::memcpy(CMSG_DATA(rights), fds, sizeof fds);
  const auto deadline = std::chrono::steady_clock::now() + kSpareSendTimeout;
  std::size_t sent = 0;
  while (sent < record.size()) {
    const ssize_t n = sent == 0 ? sendmsg(fd, &message, MSG_NOSIGNAL | MSG_DONTWAIT)
                                : send(fd, record.data() + sent, record.size() - sent,
                                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return ETIMEDOUT;
    pollfd writable{fd, POLLOUT, 0};
    poll(&writable, 1, static_cast<int>(left.count()));
  }
  return shutdown(fd, SHUT_WR) == 0 ? 0 : errno;
}

// The wait status of child `pid`, once it exited.
int wait_for_exit(pid_t pid) {
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return status;
}

void write_to_console(bool to_stderr, const std::string& text) {
  if (text.empty()) return;
  std::lock_guard lock(output_mutex());
  FILE* f = to_stderr ? stderr : stdout;
  std::fflush(f);
  write_all(to_stderr ? 2 : 1, text.data(), text.size());
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

void LineSplitter::feed(const char* data, std::size_t n, const std::string& prefix,
                        std::string& out) {
  std::size_t begin = 0;
  if (n > 0 && after_cr_ && data[0] == '\n') begin = 1;  // the rest of a "\r\n"
  after_cr_ = false;
  auto emit = [&](const char* text, std::size_t size) {
    out += prefix;
    out += partial_;
    out.append(text, size);
    out += '\n';
    partial_.clear();
  };
  while (begin < n) {
    // The scan starts where the last ended: each byte is looked at once (twice
    // when a line over the bound is cut).
    std::size_t end = begin;
    while (end < n && data[end] != '\n' && data[end] != '\r') ++end;
    // Cut at the bound: a line with its ending may fill it, a held piece
    // stays below it.
    if (partial_.size() + (end - begin) >= kMaxTeedLineBytes + (end < n ? 1 : 0)) {
      std::size_t take = kMaxTeedLineBytes - partial_.size();
      emit(data + begin, take);
      begin += take;
      continue;
    }
    if (end == n) {
      partial_.append(data + begin, end - begin);
      return;
    }
    emit(data + begin, end - begin);
    if (data[end] == '\r') {
      if (end + 1 == n) {
        after_cr_ = true;
      } else if (data[end + 1] == '\n') {
        ++end;
      }
    }
    begin = end + 1;
  }
}

void LineSplitter::finish(const std::string& prefix, std::string& out) {
  if (!partial_.empty()) {
    out += prefix;
    out += partial_;
    out += '\n';
  }
  partial_.clear();
  after_cr_ = false;
}

std::vector<std::string> last_lines_of(const std::filesystem::path& file, std::size_t count) {
  std::vector<std::string> lines;
  if (file.empty()) return lines;
  int fd = ::open(file.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return lines;
  struct stat info{};
  std::string text;
  constexpr off_t kTail = 65536;
  if (fstat(fd, &info) == 0 && S_ISREG(info.st_mode)) {
    const off_t from = info.st_size > kTail ? info.st_size - kTail : 0;
    text.resize(static_cast<std::size_t>(info.st_size - from));
    ssize_t n = pread(fd, text.data(), text.size(), from);
    text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
    // A cut first line is not one of the worker's.
    if (from > 0) text.erase(0, std::min(text.size(), text.find_first_of("\r\n") + 1));
  }
  close(fd);
  LineSplitter splitter;
  std::string joined;
  splitter.feed(text.data(), text.size(), "", joined);
  splitter.finish("", joined);
  lines = split(joined, '\n');
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  if (lines.size() > count) lines.erase(lines.begin(), lines.end() - static_cast<long>(count));
  return lines;
}

WorkerGroup::~WorkerGroup() {
  stop(std::chrono::milliseconds(0));
  stop_spares();
}

bool WorkerGroup::start(const std::vector<WorkerSpec>& specs, std::chrono::milliseconds grace,
                        const std::atomic<int>* stop_signal) {
  stop(std::chrono::milliseconds(0));
  start_log_.clear();
  pid_t agent = getpid();
  if (!children_before_) {
    children_before_.emplace();
    std::vector<pid_t> children(4096);
    const std::size_t n = children_of(agent, children.data(), children.size(), false);
    children_before_->insert(children.begin(), children.begin() + static_cast<long>(n));
  }
  for (const auto& spec : specs) {
    // A stop signal while many workers start: the rest are not started.
    if (stop_signal && stop_signal->load() != 0) return false;
    if (spec.argv.empty()) throw std::invalid_argument("worker command is empty");
    if (!spec.directory.empty()) {
      std::error_code ec;
      std::filesystem::create_directories(spec.directory, ec);
      if (ec) throw std::system_error(ec, "cannot make " + spec.directory.string());
    }
    // The log files first: a worker is started only once its output has
    // somewhere to go.
    StreamTarget out = target_of(spec.stdout_file, spec.stdout_console, 1);
    StreamTarget err;
    try {
      err = target_of(spec.stderr_file, spec.stderr_console, 2);
    } catch (...) {
      close_target(out);
      throw;
    }
    Worker w;
    w.spec = spec;
    if (auto spare = take_spare(spec, stop_signal)) {
      const std::string record = launch_record(spec, spare->setup.interpreter_words);
      const int failed = record.size() > kMaxLaunchRecordBytes
                             ? E2BIG
                             : send_launch(spare->launch_fd, record, out.worker_fd, err.worker_fd);
      if (failed == 0) {
        w.guard_pid = spare->guard_pid;
        w.exit_fd = spare->exit_fd;
        close(spare->launch_fd);
        start_log_.push_back(fmt::format("local rank {} started from its spare", spec.local_rank));
      } else {
        start_log_.push_back(
            fmt::format("local rank {} started cold: its spare did not take "
                        "the launch record ({})",
                        spec.local_rank, std::strerror(failed)));
        end_spare(*spare);
      }
    }
    if (w.guard_pid < 0) {
      try {
        w.guard_pid =
            fork_guard(agent, spec.argv, spec.env, out.worker_fd, err.worker_fd, -1, grace);
      } catch (...) {
        close_target(out);
        close_target(err);
        throw;
      }
      w.exit_fd = static_cast<int>(syscall(SYS_pidfd_open, w.guard_pid, 0));
    }
    close_fds({&out.fd_to_close, &err.fd_to_close});
    w.out_fd = out.pipe_read;
    w.err_fd = err.pipe_read;
    w.out_file = out.teed_file;
    w.err_file = err.teed_file;
    workers_.push_back(std::move(w));
  }
  return true;
}

std::optional<WorkerGroup::Spare> WorkerGroup::take_spare(const WorkerSpec& spec,
                                                          const std::atomic<int>* stop_signal) {
  auto found = spares_.find(spec.local_rank);
  if (found == spares_.end()) return std::nullopt;
  Spare spare = std::move(found->second);
  spares_.erase(found);
  std::string why;
  if (spec.argv.size() <= spare.interpreter.size() ||
      !std::equal(spare.interpreter.begin(), spare.interpreter.end(), spec.argv.begin())) {
    why = "its command does not start with its spare's interpreter";
  } else if (auto env = static_env_of(spec.env, spare.setup); env != spare.static_env) {
    why = fmt::format("its environment differs from its spare's in {}",
                      first_difference(env, spare.static_env));
  } else if (why = wait_until_ready(spare, stop_signal); why.empty()) {
    return spare;
  }
  start_log_.push_back(fmt::format("local rank {} started cold: {}", spec.local_rank, why));
  end_spare(spare);
  return std::nullopt;
}

std::vector<std::string> WorkerGroup::await_spares(const std::atomic<int>* stop_signal) {
  std::vector<std::string> ended;
  for (auto it = spares_.begin(); it != spares_.end();) {
    const std::string why = wait_until_ready(it->second, stop_signal);
    if (why.empty()) {
      ++it;
      continue;
    }
    if (stop_signal && stop_signal->load() != 0) break;
    ended.push_back(fmt::format("local rank {}: {}", it->first, why));
    end_spare(it->second);
    it = spares_.erase(it);
  }
  return ended;
}

std::string WorkerGroup::wait_until_ready(Spare& spare, const std::atomic<int>* stop_signal) {
  if (spare.ready) return "";
  const auto deadline = std::chrono::steady_clock::now() + kSpareReadyTimeout;
  pollfd ready{spare.launch_fd, POLLIN, 0};
  // In steps: a stop signal does not wait for a spare's imports.
  while (poll(&ready, 1, 100) <= 0) {
    if (stop_signal && stop_signal->load() != 0) return "a stop signal came";
    if (std::chrono::steady_clock::now() >= deadline)
      return fmt::format("its spare was not ready within {} s", kSpareReadyTimeout.count());
  }
  char byte = 0;
  if (recv(spare.launch_fd, &byte, 1, MSG_DONTWAIT) == 1 && byte == 'R') {
    spare.ready = true;
    return "";
  }
  // Its end closed: the spare is gone, and its guard about to be.
  const int status = wait_for_exit(spare.guard_pid);
  spare.guard_pid = -1;
  return fmt::format("its spare exited with status {} before it was ready", encode_status(status));
}

void WorkerGroup::end_spare(Spare& spare) {
  if (spare.guard_pid >= 0) {
    kill(spare.guard_pid, SIGUSR1);  // the guard kills the spare's process group
    wait_for_exit(spare.guard_pid);
    spare.guard_pid = -1;
  }
  close_fds({&spare.exit_fd, &spare.launch_fd});
}

// True when the worker's Python runs with a safe path (-P, -I, or
// PYTHONSAFEPATH): nothing is put first on its sys.path.
static bool job_python_has_safe_path(const std::vector<std::string>& interpreter,
                                     const std::vector<std::string>& env) {
  bool ignores_environment = false;  // -E: PYTHONSAFEPATH means nothing
  for (std::size_t i = 1; i < interpreter.size(); ++i) {
    const std::string& word = interpreter[i];
    if (!word.starts_with("-") || word.starts_with("--")) continue;
    // A cluster of one-letter options ("-uP"); -W and -X take the rest.
    for (std::size_t c = 1; c < word.size() && word[c] != 'W' && word[c] != 'X'; ++c) {
      if (word[c] == 'P' || word[c] == 'I') return true;
      ignores_environment = ignores_environment || word[c] == 'E';
    }
  }
  return !ignores_environment && std::any_of(env.begin(), env.end(), [](const std::string& entry) {
    return entry.starts_with("PYTHONSAFEPATH=") && entry.size() > 15;
  });
}

void WorkerGroup::start_spares(const std::vector<WorkerSpec>& specs, const SpareSetup& setup,
                               std::chrono::milliseconds grace) {
  const pid_t agent = getpid();
  for (const auto& spec : specs) {
    if (spares_.contains(spec.local_rank) || spec.argv.size() <= setup.interpreter_words) continue;
    Spare spare;
    spare.setup = setup;
    spare.interpreter.assign(spec.argv.begin(),
                             spec.argv.begin() + static_cast<long>(setup.interpreter_words));
    spare.static_env = static_env_of(spec.env, setup);
    // -P: `python -m` would put the agent's working directory first on
    // sys.path, where a planted torch/ would be imported ahead of the real
    // one; the spare puts the entry the job's own Python would have (the
    // script's folder) first when it becomes the worker, unless that
    // Python runs with a safe path itself.
    std::vector<std::string> argv = spare.interpreter;
    for (const char* word : {"-P", "-m", "ductile._warm_start"}) argv.emplace_back(word);
    argv.push_back(std::to_string(kSpareLaunchFd));
    argv.push_back(core::join(setup.imports, ","));
    argv.push_back(job_python_has_safe_path(spare.interpreter, spec.env) ? "safe-path"
                                                                         : "script-path");
    if (setup.program_imports) {
      // The program: its script, or -m and its module (-mMODULE split).
      const std::string& first = spec.argv[setup.interpreter_words];
      if (first == "-m" && spec.argv.size() > setup.interpreter_words + 1) {
        argv.push_back(first);
        argv.push_back(spec.argv[setup.interpreter_words + 1]);
      } else if (first.starts_with("-m") && first.size() > 2) {
        argv.push_back("-m");
        argv.push_back(first.substr(2));
      } else if (!first.starts_with("-")) {
        argv.push_back(first);
      }
    }
    int ends[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0)
      throw std::system_error(errno, std::generic_category(), "socketpair");
    StreamTarget quiet = target_of({}, false, 1);  // /dev/null until the round's streams come
    try {
      spare.guard_pid = fork_guard(agent, argv, spare.static_env, quiet.worker_fd, quiet.worker_fd,
                                   ends[1], grace);
    } catch (...) {
      close_target(quiet);
      close(ends[0]);
      close(ends[1]);
      throw;
    }
    close_target(quiet);
    close(ends[1]);
    spare.launch_fd = ends[0];
    spare.exit_fd = static_cast<int>(syscall(SYS_pidfd_open, spare.guard_pid, 0));
    spares_.emplace(spec.local_rank, std::move(spare));
  }
}

void WorkerGroup::stop_spares() {
  // Every guard told first: they end their spares at the same time.
  for (auto& [rank, spare] : spares_) kill(spare.guard_pid, SIGUSR1);
  for (auto& [rank, spare] : spares_) end_spare(spare);
  spares_.clear();
}

void WorkerGroup::read_output(Worker& w, bool is_err) {
  int& fd = is_err ? w.err_fd : w.out_fd;
  if (fd < 0) return;
  LineSplitter& lines = is_err ? w.err_lines : w.out_lines;
  char buffer[65536];
  // One buffer for every read: its capacity is kept, nothing is allocated
  // per piece.
  std::string& shown = console_buffer_;
  // At most a few pieces a call: the other workers' streams get their turn.
  for (int pieces = 0; pieces < 16; ++pieces) {
    ssize_t n = read(fd, buffer, sizeof buffer);
    if (n > 0) {
      if (int file = is_err ? w.err_file : w.out_file; file >= 0)
        write_all(file, buffer, static_cast<std::size_t>(n));
      shown.clear();
      lines.feed(buffer, static_cast<std::size_t>(n), w.spec.line_prefix, shown);
      write_to_console(is_err, shown);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // End of file (or an error): the worker and its children closed it.
    shown.clear();
    lines.finish(w.spec.line_prefix, shown);
    write_to_console(is_err, shown);
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
      for (int pieces = 0; pieces < 1024 && (w.out_fd >= 0 || w.err_fd >= 0); ++pieces) {
        const bool more_out = w.out_fd >= 0, more_err = w.err_fd >= 0;
        read_output(w, false);
        read_output(w, true);
        // A pipe still open after the guard's exit is held by a child the
        // worker left (killed with its group): what is buffered is shown.
        if (more_out == (w.out_fd >= 0) && more_err == (w.err_fd >= 0)) break;
      }
      close_fds({&w.exit_fd});
      w.status = encode_status(status);
      if (*w.status != 0 && !first_failed_) first_failed_ = i;
    }
  }
}

bool WorkerGroup::pump(std::chrono::milliseconds wait, int also) {
  std::vector<pollfd> fds;
  if (also >= 0) fds.push_back({also, POLLIN, 0});
  bool unwatched = false;  // a running worker without a pidfd
  for (auto& w : workers_) {
    if (w.out_fd >= 0) fds.push_back({w.out_fd, POLLIN, 0});
    if (w.err_fd >= 0) fds.push_back({w.err_fd, POLLIN, 0});
    if (w.exit_fd >= 0)
      fds.push_back({w.exit_fd, POLLIN, 0});
    else if (!w.status)
      unwatched = true;
  }
  // A worker's exit wakes the poll through its guard's pidfd; without one
  // (a kernel before 5.3) it is looked for in short steps.
  if (unwatched) wait = std::min<std::chrono::milliseconds>(wait, std::chrono::milliseconds(20));
  const int ready = poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
  for (auto& w : workers_) {
    read_output(w, false);
    read_output(w, true);
  }
  reap();
  return ready > 0;
}

bool WorkerGroup::running() const {
  return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return !w.status; });
}

bool WorkerGroup::all_running() const {
  return !workers_.empty() && std::none_of(workers_.begin(), workers_.end(),
                                           [](const Worker& w) { return w.status.has_value(); });
}

void WorkerGroup::renumber(const std::vector<std::int64_t>& ranks) {
  for (auto& w : workers_)
    if (w.spec.local_rank >= 0 && static_cast<std::size_t>(w.spec.local_rank) < ranks.size())
      w.spec.rank = ranks[static_cast<std::size_t>(w.spec.local_rank)];
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
  auto lines = last_lines_of(w.spec.stderr_file, kKeptLines);
  if (lines.empty()) lines = last_lines_of(w.spec.stdout_file, kKeptLines);
  return WorkerExit{w.spec.rank, w.spec.local_rank, *w.status, std::move(lines)};
}

bool WorkerGroup::all_succeeded() const {
  return !workers_.empty() && std::all_of(workers_.begin(), workers_.end(),
                                          [](const Worker& w) { return w.status == 0; });
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
    for (auto& w : workers_)
      if (!w.status) w.status = encode_status(wait_for_exit(w.guard_pid));
  }
  for (auto& w : workers_) {
    read_output(w, false);
    read_output(w, true);
    close_fds({&w.out_fd, &w.err_fd, &w.out_file, &w.err_file, &w.exit_fd});
  }
  workers_.clear();
  first_failed_.reset();
  end_adopted(grace);
}

void WorkerGroup::end_adopted(std::chrono::milliseconds grace) {
  int subreaper = 0;
  if (!children_before_ || prctl(PR_GET_CHILD_SUBREAPER, &subreaper) != 0 || subreaper == 0) return;
  using clock = std::chrono::steady_clock;
  const auto started = clock::now();
  std::vector<pid_t> children(4096);
  std::set<pid_t> terminated;  // SIGTERM once to each
  for (int sig = grace.count() > 0 ? SIGTERM : SIGKILL;;) {
    std::size_t n = children_of(getpid(), children.data(), children.size(), false);
    std::size_t adopted = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (children_before_->contains(children[i]) ||
          std::any_of(spares_.begin(), spares_.end(),
                      [&](const auto& spare) { return spare.second.guard_pid == children[i]; }))
        continue;
      ++adopted;
      // Exited: reaped; else signalled.
      if (waitpid(children[i], nullptr, WNOHANG) == children[i]) continue;
      if (sig == SIGKILL || terminated.insert(children[i]).second) kill(children[i], sig);
    }
    if (adopted == 0) return;
    const auto elapsed = clock::now() - started;
    // A process in uninterruptible sleep may outlast SIGKILL: not waited
    // for forever.
    if (elapsed > grace + std::chrono::seconds(10)) return;
    if (elapsed >= grace) sig = SIGKILL;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

bool make_subreaper() {
  return prctl(PR_SET_CHILD_SUBREAPER, 1) == 0;
}

}  // namespace ductile::agent
