// The guard process between the agent and each worker, and the
// async-signal-safe helpers it shares with WorkerGroup. Internal to
// libductile_agent.
//
// Threading and errors: every function here is async-signal-safe (raw
// system calls, no allocation, no lock), as a forked child of the
// multi-threaded agent requires; none throws. Failures of the calls they
// make are ignored where a guard can do nothing better (a write to a closed
// console), or end the guard with the worker's status.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

namespace ductile::agent {

// Writes all `n` bytes of `text` to `fd`, stopping at the first error.
void write_all(int fd, const char* text, std::size_t n);
void write_all(int fd, std::initializer_list<const char*> texts);  // NUL-terminated texts

// A wait status as a process exit code: the code, or 128 + the signal.
int encode_status(int status);

// The children of `self` (at most `max` of them) into `out`; returns how
// many. From the kernel's lists of each task's children where it keeps
// them (`one_thread`: `self` has no other thread, so its one task's list
// is complete; else every task's, read again if a task came or went
// meanwhile); else /proc is searched for the processes whose parent is
// `self`.
std::size_t children_of(pid_t self, pid_t* out, std::size_t max, bool one_thread);

// Runs in the child the agent forked: becomes a child subreaper, starts
// `path` with `argv` and `envp` in a process group of its own with `out_fd`
// and `err_fd` as its stdout and stderr, passes SIGTERM and SIGINT on,
// kills on SIGUSR1, SIGHUP or SIGQUIT or when the agent (`agent`) is gone,
// and once the worker exits ends what it left behind (SIGTERM, SIGKILL
// after `grace_ms`). `launch_fd` >= 0: the worker gets it as descriptor
// kSpareLaunchFd (a spare's end of its socket pair). Exits with the
// worker's encoded status.
[[noreturn]] void run_guard(pid_t agent, const char* path, char* const* argv, char* const* envp,
                            int out_fd, int err_fd, int launch_fd, std::int64_t grace_ms);

// The descriptor a spare worker reads its launch record from.
inline constexpr int kSpareLaunchFd = 3;

}  // namespace ductile::agent
