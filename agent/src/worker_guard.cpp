// The guard of a worker: a process forked by the agent that starts the
// worker in a process group of its own, passes the agent's signals on, and
// ends what the worker leaves behind (a child subreaper). Everything here
// runs in a forked child of a multi-threaded process: async-signal-safe
// calls only. See worker_guard.hpp.
#include "worker_guard.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <initializer_list>

namespace ductile::agent {
namespace {

// Async-signal-safe helpers of the guard (the agent has other threads: a
// forked child may call nothing that takes a lock).

std::int64_t now_ms_raw() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<std::int64_t>(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}

// The parent of `pid` from /proc/<pid>/stat ("pid (comm) state ppid ..."),
// -1 when it is gone.
pid_t parent_of(const char* pid_text) {
  char path[64] = "/proc/";
  std::size_t at = 6;
  for (const char* c = pid_text; *c && at < sizeof path - 6; ++c) path[at++] = *c;
  std::memcpy(path + at, "/stat", 6);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char text[512];
  ssize_t n = read(fd, text, sizeof text - 1);
  close(fd);
  if (n <= 0) return -1;
  text[n] = '\0';
  // The command name may hold ')' itself: the last one ends it.
  const char* close_paren = nullptr;
  for (ssize_t i = 0; i < n; ++i)
    if (text[i] == ')') close_paren = text + i;
  if (!close_paren || close_paren + 4 >= text + n) return -1;
  const char* c = close_paren + 4;  // past ") S "
  pid_t parent = 0;
  while (*c >= '0' && *c <= '9') parent = parent * 10 + (*c++ - '0');
  return parent;
}

// Writes the decimal digits of `value` at `out`; returns the end.
char* put_number(char* out, long value) {
  char digits[24];
  int n = 0;
  do {
    digits[n++] = static_cast<char>('0' + value % 10);
    value /= 10;
  } while (value > 0);
  while (n > 0) *out++ = digits[--n];
  return out;
}

// Reads the pids `fd` lists, separated by spaces, into `out`.
std::size_t read_pid_list(int fd, pid_t* out, std::size_t max) {
  char text[16384];
  std::size_t size = 0;
  ssize_t n;
  while (size < sizeof text && (n = read(fd, text + size, sizeof text - size)) > 0)
    size += static_cast<std::size_t>(n);
  std::size_t found = 0;
  pid_t pid = 0;
  for (std::size_t i = 0; i <= size && found < max; ++i) {
    if (i < size && text[i] >= '0' && text[i] <= '9') {
      pid = pid * 10 + (text[i] - '0');
    } else if (pid > 0) {
      out[found++] = pid;
      pid = 0;
    }
  }
  return found;
}

}  // namespace

void write_all(int fd, const char* text, std::size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, text, n);
    if (w <= 0) return;
    text += w;
    n -= static_cast<std::size_t>(w);
  }
}

void write_all(int fd, std::initializer_list<const char*> texts) {
  for (const char* text : texts) write_all(fd, text, std::strlen(text));
}

int encode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

namespace {

// Appends the pids of `/proc/<self>/task/<task>/children` to `out` (up to
// `max` in all); false when the kernel keeps no such list
// (CONFIG_PROC_CHILDREN) or the task is gone.
bool read_task_children(pid_t self, pid_t task, pid_t* out, std::size_t max, std::size_t& found) {
  char path[96] = "/proc/";
  char* end = put_number(path + 6, self);
  std::memcpy(end, "/task/", 6);
  end = put_number(end + 6, task);
  std::memcpy(end, "/children", 10);
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  found += read_pid_list(fd, out + found, max - found);
  close(fd);
  return true;
}

constexpr std::size_t kMaxTasksListed = 512;

// Calls `visit(id, name)` for each entry of the directory `path` named by a
// positive number (/proc's processes, a process's tasks) until it returns
// false; false when the directory cannot be read.
template <typename Visit>
bool each_numbered_entry(const char* path, Visit&& visit) {
  const int dir = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return false;
  alignas(8) char buffer[16384];
  bool more = true;
  for (ssize_t got; more && (got = getdents64(dir, buffer, sizeof buffer)) > 0;) {
    for (ssize_t offset = 0; more && offset < got;) {
      const auto* entry = reinterpret_cast<const dirent64*>(buffer + offset);
      offset += entry->d_reclen;
      pid_t id = 0;
      const char* c = entry->d_name;
      if (*c < '1' || *c > '9') continue;
      while (*c >= '0' && *c <= '9') id = id * 10 + (*c++ - '0');
      if (*c == '\0') more = visit(id, entry->d_name);
    }
  }
  close(dir);
  return true;
}

// The tasks (threads) of `self` into `out`, in /proc's order; 0 when they
// cannot be read or are more than `max`.
std::size_t tasks_of(pid_t self, pid_t* out, std::size_t max) {
  char path[64] = "/proc/";
  std::memcpy(put_number(path + 6, self), "/task", 6);
  std::size_t found = 0;
  bool over = false;
  const bool read = each_numbered_entry(path, [&](pid_t tid, const char*) {
    over = found == max;
    if (!over) out[found++] = tid;
    return !over;
  });
  return read && !over ? found : 0;
}

}  // namespace

// A task's list of children is kept by kernels with CONFIG_PROC_CHILDREN:
// a process's children are those of its tasks. Searching /proc instead
// reads every process's stat on the machine, which costs a host of many
// processes (and many agents on one host, as in a simulation) far more.
std::size_t children_of(pid_t self, pid_t* out, std::size_t max, bool one_thread) {
  if (one_thread) {
    std::size_t found = 0;
    if (read_task_children(self, self, out, max, found)) return found;
  } else {
    // A task that exits hands its children to another of the process's:
    // the lists are read again when the tasks changed meanwhile.
    pid_t tasks[kMaxTasksListed], after[kMaxTasksListed];
    std::size_t count = tasks_of(self, tasks, kMaxTasksListed);
    for (int attempt = 0; count > 0 && attempt < 3; ++attempt) {
      std::size_t found = 0;
      bool listed = true;
      for (std::size_t i = 0; i < count && listed; ++i)
        listed = read_task_children(self, tasks[i], out, max, found) || i > 0;
      if (!listed) break;  // no lists kept: /proc is searched
      const std::size_t now = tasks_of(self, after, kMaxTasksListed);
      if (now == count && std::memcmp(tasks, after, count * sizeof(pid_t)) == 0) return found;
      count = now;
      std::memcpy(tasks, after, now * sizeof(pid_t));
    }
  }
  std::size_t found = 0;
  each_numbered_entry("/proc", [&](pid_t pid, const char* name) {
    if (pid != self && found < max && parent_of(name) == self) out[found++] = pid;
    return true;
  });
  return found;
}

namespace {

// Reaps every exited child; the worker's status goes to *worker_status.
void reap_children(pid_t worker, bool& worker_done, int& worker_status) {
  int status = 0;
  pid_t done;
  while ((done = waitpid(-1, &status, WNOHANG)) > 0)
    if (done == worker) {
      worker_done = true;
      worker_status = status;
    }
}

// Ends what a worker left behind once it exited: the processes re-parented
// to the guard (a subreaper), each generation as the one above it dies.
// SIGTERM first, SIGKILL once `grace` passed or the agent asks for it
// (SIGUSR1, SIGHUP, SIGQUIT, or the agent gone); returns when the guard has
// no child left, or after a bound (a process that SIGKILL does not end
// goes to the agent, a subreaper too).
void end_left_behind(pid_t agent, const sigset_t& guarded, std::int64_t grace_ms) {
  const std::int64_t started = now_ms_raw();
  int sig = grace_ms > 0 ? SIGTERM : SIGKILL;
  pid_t children[1024];
  // SIGTERM once to each: a process that handles it is not interrupted by
  // another while it cleans up.
  pid_t terminated[1024];
  std::size_t terminated_count = 0;
  const timespec step{0, 20 * 1000 * 1000};
  bool unused_done = false;
  int unused_status = 0;
  for (;;) {
    reap_children(-1, unused_done, unused_status);
    const std::size_t n = children_of(getpid(), children, 1024, true);
    if (n == 0) return;
    const std::int64_t elapsed = now_ms_raw() - started;
    if (elapsed >= grace_ms + 10000) return;
    if (elapsed >= grace_ms || getppid() != agent) sig = SIGKILL;
    for (std::size_t i = 0; i < n; ++i) {
      if (sig == SIGTERM) {
        bool already = false;
        for (std::size_t t = 0; t < terminated_count && !already; ++t)
          already = terminated[t] == children[i];
        if (already || terminated_count == 1024) continue;
        terminated[terminated_count++] = children[i];
      }
      kill(children[i], sig);
    }
    siginfo_t info;
    const int got = sigtimedwait(&guarded, &info, &step);
    if (got == SIGUSR1 || got == SIGHUP || got == SIGQUIT) sig = SIGKILL;
  }
}

[[noreturn]] void guard_exit(pid_t agent, const sigset_t& guarded, pid_t worker, int status,
                             std::int64_t grace_ms) {
  kill(-worker, SIGKILL);  // children the worker left in its group
  end_left_behind(agent, guarded, grace_ms);
  _exit(encode_status(status));
}

struct WorkerStart {
  pid_t guard;
  const char* path;
  char* const* argv;
  char* const* envp;
  int out_fd, err_fd, launch_fd;
};

// The worker's side of the guard's clone, up to its execve. It shares the
// guard's memory (the guard is suspended): it writes nothing but its own
// stack, and its signals stay blocked (all of them, by the guard) until
// every handler is the default.
int exec_worker(void* arg) {
  const auto& start = *static_cast<const WorkerStart*>(arg);
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != start.guard) _exit(128 + SIGKILL);
  struct sigaction dfl{};
  dfl.sa_handler = SIG_DFL;
  for (int s = 1; s < NSIG; ++s) sigaction(s, &dfl, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
  // Above the descriptors dup2 is about to replace (out_fd may be 3).
  const int launch = start.launch_fd >= 0 ? fcntl(start.launch_fd, F_DUPFD_CLOEXEC, 10) : -1;
  const int devnull = open("/dev/null", O_RDONLY);
  if (devnull >= 0) dup2(devnull, 0);
  dup2(start.out_fd, 1);
  dup2(start.err_fd, 2);
  // The agent's own stdout and stderr, inherited as they are: dup2 onto
  // the same descriptor keeps a close-on-exec flag it may carry.
  fcntl(1, F_SETFD, 0);
  fcntl(2, F_SETFD, 0);
  if (launch >= 0) dup2(launch, kSpareLaunchFd);  // without close-on-exec
  execve(start.path, start.argv, start.envp);
  const int e = errno;
  write_all(2, {"ductile agent: cannot execute ", start.path, ": ", strerrordesc_np(e), "\n"});
  _exit(127);
}

}  // namespace

[[noreturn]] void run_guard(pid_t agent, const char* path, char* const* argv, char* const* envp,
                            int out_fd, int err_fd, int launch_fd, std::int64_t grace_ms) {
  sigset_t guarded;
  sigemptyset(&guarded);
  for (int s : {SIGTERM, SIGINT, SIGHUP, SIGCHLD, SIGUSR1, SIGQUIT}) sigaddset(&guarded, s);
  sigprocmask(SIG_BLOCK, &guarded, nullptr);
  setpgid(0, 0);  // not in the agent's group: a terminal's Ctrl-C goes to the agent only
  prctl(PR_SET_PDEATHSIG, SIGHUP);
  if (getppid() != agent) _exit(128 + SIGHUP);
  // What the worker's children leave when their parent exits (a daemon, a
  // job started under setsid) comes to the guard, which ends it.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  pid_t guard = getpid();
  WorkerStart start{guard, path, argv, envp, out_fd, err_fd, launch_fd};
  // The worker shares the guard's memory until its execve (CLONE_VFORK:
  // the guard waits meanwhile), on a stack of its own: no copy of the
  // agent's page tables, which the guard holds, for a process that drops
  // them at once. The guard is single-threaded and a guard starts one
  // worker, so one static stack serves.
  // Every signal blocked across it: no handler the guard inherited from
  // the agent runs in the worker while they share memory.
  alignas(64) static char stack[64 * 1024];
  sigset_t all, before;
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &before);
  const pid_t worker =
      clone(exec_worker, stack + sizeof stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &start);
  sigprocmask(SIG_SETMASK, &before, nullptr);
  if (worker < 0) {
    const int e = errno;
    write_all(err_fd, {"ductile agent: cannot start a worker process: ", strerrordesc_np(e), "\n"});
    _exit(127);
  }
  setpgid(worker, worker);
  close(out_fd);
  close(err_fd);
  if (launch_fd >= 0) close(launch_fd);
  timespec second{1, 0};
  pid_t adopted[1024];
  for (;;) {
    siginfo_t info;
    int sig = sigtimedwait(&guarded, &info, &second);
    bool done = false;
    int status = 0;
    // The worker, and the exited processes re-parented to the guard.
    reap_children(worker, done, status);
    if (done) guard_exit(agent, guarded, worker, status, grace_ms);
    if (sig == SIGTERM || sig == SIGINT) {
      kill(-worker, SIGTERM);
      // And what the worker's children left in other groups.
      const std::size_t n = children_of(guard, adopted, 1024, true);
      for (std::size_t i = 0; i < n; ++i)
        if (adopted[i] != worker) kill(adopted[i], SIGTERM);
    } else if (sig == SIGHUP || sig == SIGUSR1 || sig == SIGQUIT || getppid() != agent) {
      kill(-worker, SIGKILL);
      while (waitpid(worker, &status, 0) < 0 && errno == EINTR) {
      }
      guard_exit(agent, guarded, worker, status, 0);
    }
  }
}

}  // namespace ductile::agent
