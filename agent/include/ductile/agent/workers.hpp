// The worker processes of one node for one round.
//
// Each worker runs under a guard: a forked copy of the agent that leads the
// worker's process group, dies with the agent (PR_SET_PDEATHSIG) and then
// kills the whole group, so that neither workers nor their children outlive
// the agent, even when it is killed with SIGKILL. The worker itself also gets
// PR_SET_PDEATHSIG from its guard.
//
// Output: every line a worker writes is copied to the agent's stdout or stderr
// (as the worker wrote it) with the prefix "[rank R]: ", unless the spec
// keeps it off the console; each stream's bytes go to its log file when the
// spec names one; the last lines of each worker are kept for failure
// reports.
//
// Threading: one thread drives a WorkerGroup (start, pump, stop).
// Errors: start() throws std::system_error when processes, pipes or log
// files cannot be created; a command that cannot be executed is a worker
// exiting with 127.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace ductile::agent {

// Which of a worker's streams (torchrun's Std): none, stdout, stderr, both.
enum WorkerStreams : int { kNoStreams = 0, kStdout = 1, kStderr = 2, kBothStreams = 3 };

// Streams for every local rank ("3") or per local rank ("0:1,1:2": the
// others none), as torchrun's --redirects and --tee take them.
struct StreamsByRank {
  int all = kNoStreams;
  std::map<std::int64_t, int> by_rank;
  int of(std::int64_t local_rank) const;
};

// Where the workers' output goes (torchrun's --log-dir, --redirects, --tee,
// --local-ranks-filter). A stream redirected goes to its log file only; a
// stream teed, to its log file and the console; others to the console.
struct WorkerOutput {
  // The job's log files, under <log_dir>/<job id>_XXXXXX/; empty: a
  // directory of $TMPDIR (kept, as torchrun keeps its own).
  std::filesystem::path log_dir;
  StreamsByRank redirects;
  StreamsByRank tee;
  // Only these local ranks' lines reach the console (log files have all).
  std::optional<std::set<std::int64_t>> console_ranks;
  bool any_file() const {
    return !log_dir.empty() || redirects.all != 0 || !redirects.by_rank.empty() || tee.all != 0 ||
           !tee.by_rank.empty();
  }
};

struct WorkerSpec {
  std::int64_t rank = 0;
  std::int64_t local_rank = 0;
  std::vector<std::string> argv;  // argv[0] searched on PATH
  std::vector<std::string> env;   // complete environment, "NAME=value"
  // Files that get every byte of a stream (empty: none), and whether its
  // lines reach the agent's own stdout / stderr.
  std::filesystem::path stdout_file{}, stderr_file{};
  bool stdout_console = true, stderr_console = true;
};

struct WorkerExit {
  std::int64_t rank = 0;
  std::int64_t local_rank = 0;
  int status = 0;  // exit code, or 128 + signal number
  std::vector<std::string> last_lines;
};

class WorkerGroup {
 public:
  WorkerGroup() = default;
  ~WorkerGroup();  // stops the workers (grace 0)
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  void start(const std::vector<WorkerSpec>& workers);
  // Copies output and reaps exited workers, waiting up to `wait` for output.
  void pump(std::chrono::milliseconds wait);
  bool running() const;  // some worker has not exited yet
  // The guard processes of the workers not reaped yet (this process's
  // children: their pids stay theirs until pump() or stop() reaps them).
  std::vector<int> guard_pids() const;
  bool empty() const { return workers_.empty(); }
  // The first worker that exited with a non-zero status, if any.
  std::optional<WorkerExit> first_failure() const;
  // True when every worker exited with status 0.
  bool all_succeeded() const;
  // SIGTERM to every worker's process group, SIGKILL after `grace`; waits
  // for all of them and forgets them.
  void stop(std::chrono::milliseconds grace);

 private:
  struct Worker {
    WorkerSpec spec;
    int guard_pid = -1;  // also the process group id
    int out_fd = -1;
    int err_fd = -1;
    int out_file = -1, err_file = -1;  // the log files, when named
    std::string out_partial, err_partial;
    std::deque<std::string> last_lines;
    std::optional<int> status;
  };
  void read_output(Worker& w, int& fd, std::string& partial, bool is_err);
  void emit_line(Worker& w, const std::string& line, bool is_err);
  void reap();
  std::vector<Worker> workers_;
  std::optional<std::size_t> first_failed_;
};

// Lines written by the agent itself go through the same lock as worker lines
// so that lines never interleave mid-line.
void write_line(bool to_stderr, const std::string& line);

}  // namespace ductile::agent
