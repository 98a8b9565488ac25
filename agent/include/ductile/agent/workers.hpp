// The worker processes of one node for one round.
//
// Each worker runs under a guard: a forked copy of the agent that leads the
// worker's process group, dies with the agent (PR_SET_PDEATHSIG) and then
// kills the whole group, so that neither workers nor their children outlive
// the agent, even when it is killed with SIGKILL. The worker itself also gets
// PR_SET_PDEATHSIG from its guard. The guard is a child subreaper: what the
// worker's children leave behind in other process groups or sessions (a
// daemon, a `setsid cmd &`) is re-parented to it; once the worker exited, or
// when the group is stopped, the guard ends those processes too (SIGTERM,
// SIGKILL after the group's grace) and reaps them before it exits itself. A
// process that outlives its guard (one SIGKILL left unkilled until the guard
// was killed) goes to the agent when the agent is a subreaper
// (make_subreaper()), and stop() ends it.
//
// Output, stream by stream, as torchrun 2.13 places it:
//  - on the console, no log file: the worker inherits the agent's stdout or
//    stderr itself (a terminal stays a terminal, nothing is prefixed);
//  - off the console, no log file: /dev/null;
//  - a log file, off the console (redirected): the worker writes the file;
//  - a log file and the console (teed): the worker writes a pipe; the agent
//    copies its bytes to the file and its lines, prefixed with the spec's
//    line_prefix ("[default0]:"), to its own stream. Lines end at '\n', '\r'
//    or "\r\n" (as Python's universal newlines, which torchrun's tail of
//    the log file reads with); a line longer than kMaxTeedLineBytes is
//    shown in pieces of that size.
// A failed worker's last lines come from its log files (stderr first).
//
// Spare workers (start_spares(), `ductile agent --warm-workers`): for each
// local rank, a Python interpreter started ahead of the next round under a
// guard of its own, with the worker's environment less the variables set
// for one round only (SpareSetup::is_round_variable), its output on
// /dev/null. It runs `python -m ductile._warm_start FD MODULES`: it
// imports MODULES, writes 'R' (ready) to FD, one end of a socket pair, and
// waits there for its launch record. start() activates the spare of a
// worker's local rank when it was started with the same interpreter words
// and the same environment less the round's variables, once it is ready
// (it waits up to kSpareReadyTimeout for the imports): it sends the
// worker's stdout and stderr (SCM_RIGHTS, the descriptors a cold worker
// would get) and a record (at most kMaxLaunchRecordBytes) of NUL-terminated
// fields: "ductile-warm-start-1", the working directory, the number of
// program words, the program words (the script or -m MODULE and its
// arguments), then the whole environment, "NAME=value" each. The spare then
// runs the program as `python` would have. Otherwise the worker starts cold
// and the spare is ended; start_log() says why.
//
// Threading: one thread drives a WorkerGroup (start, pump, stop).
// Errors: start() throws std::system_error when processes, pipes, log files
// or a worker's directory cannot be created (the workers started before
// stay in the group: stop() ends them); a command that cannot be executed
// is a worker exiting with 127.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
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
  // Put before each teed line on the console (torchrun's
  // "[{role}{local_rank}]:").
  std::string line_prefix{};
  // Made (with its parents) just before this worker starts, not before the
  // group does (torchrun's <attempt>/<local rank> directory); empty: none.
  std::filesystem::path directory{};
};

// Spare workers for the next round (see the top of this file).
struct SpareSetup {
  // How many words of a worker's argv are its Python and the Python's
  // options; the words after them (the script, or -m MODULE, and its
  // arguments) are the program the spare runs when activated.
  std::size_t interpreter_words = 0;
  std::vector<std::string> imports;  // modules the spare imports ahead
  // True for the variables set for one round only (RANK, MASTER_PORT,
  // ...): the others must be the spare's own for it to run the worker.
  std::function<bool(const std::string& name)> is_round_variable;
  // And those the program (the script, or -m MODULE) imports at its top
  // level (ductile._warm_start reads its source).
  bool program_imports = false;
};

// How long start() waits for a spare still importing; then, or when the
// spare exits first, the worker starts cold.
inline constexpr std::chrono::seconds kSpareReadyTimeout{30};
// Longest launch record start() sends a spare (argv and environment).
inline constexpr std::size_t kMaxLaunchRecordBytes = 4 << 20;

// Longest piece of a teed line the agent holds before it shows it.
inline constexpr std::size_t kMaxTeedLineBytes = 65536;
// Lines of a failed worker's log file kept for its failure report.
inline constexpr std::size_t kKeptLines = 20;

// Splits teed output into lines as Python's universal newlines do, in one
// pass over each piece and with at most kMaxTeedLineBytes held.
class LineSplitter {
 public:
  // Appends each complete line of `data` (without its ending) to `out`
  // as `prefix` + line + '\n'.
  void feed(const char* data, std::size_t n, const std::string& prefix, std::string& out);
  // The end of the stream: what is held, as a last line.
  void finish(const std::string& prefix, std::string& out);
  std::size_t held() const { return partial_.size(); }

 private:
  std::string partial_;
  bool after_cr_ = false;  // the last byte seen was '\r': a '\n' next ends nothing
};

// The last `count` lines of a file (read from its last 64 KiB at most).
std::vector<std::string> last_lines_of(const std::filesystem::path& file, std::size_t count);

struct WorkerExit {
  std::int64_t rank = 0;
  std::int64_t local_rank = 0;
  int status = 0;  // exit code, or 128 + signal number
  // The last lines of its log files (stderr's, else stdout's); empty when
  // its output went to the console or /dev/null only.
  std::vector<std::string> last_lines;
};

class WorkerGroup {
 public:
  WorkerGroup() = default;
  ~WorkerGroup();  // stops the workers and the spares (grace 0)
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;

  // Starts the workers in order, each from the spare of its local rank when
  // one fits (see the top of this file), else cold. `grace`: what each
  // worker's guard gives the processes the worker left behind between
  // SIGTERM and SIGKILL. Returns false when *stop (a stop signal's number)
  // became non-zero meanwhile: the workers after it were not started.
  bool start(const std::vector<WorkerSpec>& workers,
             std::chrono::milliseconds grace = std::chrono::milliseconds(0),
             const std::atomic<int>* stop = nullptr);
  // Copies teed output and reaps exited workers, waiting up to `wait` for
  // output or a worker's exit (its guard's pidfd wakes it), or for `also`
  // to become readable (not read here; -1: none). Returns true when one of
  // those came before `wait` ended.
  bool pump(std::chrono::milliseconds wait, int also = -1);
  bool running() const;      // some worker has not exited yet
  bool all_running() const;  // every worker started has not exited yet
  // The workers go on in place in a new round (the agent's round notice):
  // each takes the rank `ranks` gives its local rank (ranks[local_rank]),
  // which its exit is reported with.
  void renumber(const std::vector<std::int64_t>& ranks);
  // The guard processes of the workers not reaped yet (this process's
  // children: their pids stay theirs until pump() or stop() reaps them).
  std::vector<int> guard_pids() const;
  bool empty() const { return workers_.empty(); }
  std::size_t size() const { return workers_.size(); }  // started, exited or not
  // The first worker that exited with a non-zero status, if any.
  std::optional<WorkerExit> first_failure() const;
  // True when every worker exited with status 0.
  bool all_succeeded() const;
  // SIGTERM to every worker's process group, SIGKILL after `grace`; waits
  // for all of them and forgets them. In a subreaper, then the same for the
  // processes re-parented to it since this group first started (what a
  // killed guard left). The spares stay.
  void stop(std::chrono::milliseconds grace);

  // Starts a spare for each of `specs`' local ranks that has none (see the
  // top of this file); throws std::system_error as start() does.
  void start_spares(const std::vector<WorkerSpec>& specs, const SpareSetup& setup,
                    std::chrono::milliseconds grace);
  // Waits until every spare said it is ready (its imports done); a spare
  // that exits first, or is not ready within its time, is ended (its
  // worker will start cold). Returns one line for each ended spare; a stop
  // signal ends the wait (the spares stay).
  std::vector<std::string> await_spares(const std::atomic<int>* stop_signal);
  // Ends the spares (their guards kill them at once) and reaps them.
  void stop_spares();
  std::size_t spares() const { return spares_.size(); }
  // What the last start() did with the spares, a line each: which workers
  // started from one, and why the others did not.
  const std::vector<std::string>& start_log() const { return start_log_; }

 private:
  struct Worker {
    WorkerSpec spec;
    int guard_pid = -1;  // also the process group id
    int exit_fd = -1;    // the guard's pidfd: readable once it exited
    int out_fd = -1;     // the pipes of teed streams
    int err_fd = -1;
    int out_file = -1, err_file = -1;  // the log files of teed streams
    LineSplitter out_lines, err_lines;
    std::optional<int> status;
  };
  struct Spare {
    int guard_pid = -1;
    int exit_fd = -1;                      // the guard's pidfd
    int launch_fd = -1;                    // the agent's end of the socket pair
    std::vector<std::string> interpreter;  // the argv words before the program
    std::vector<std::string> static_env;   // sorted
    SpareSetup setup;
    bool ready = false;  // its ready byte was read
  };
  void read_output(Worker& w, bool is_err);
  void reap();
  void end_adopted(std::chrono::milliseconds grace);
  // The spare of `spec`'s local rank, taken out of spares_, when it can run
  // the worker; else nullopt, the spare ended, and the reason in start_log_.
  std::optional<Spare> take_spare(const WorkerSpec& spec, const std::atomic<int>* stop_signal);
  // "" once `spare` said it is ready; else why not (it exited: reaped; a
  // stop signal came).
  static std::string wait_until_ready(Spare& spare, const std::atomic<int>* stop_signal);
  static void end_spare(Spare& spare);
  std::vector<Worker> workers_;
  std::map<std::int64_t, Spare> spares_;  // by local rank
  std::vector<std::string> start_log_;
  // This process's children before the group first started (an
  // ompi-server): not the workers', never ended by stop().
  std::optional<std::set<int>> children_before_;
  std::optional<std::size_t> first_failed_;
  std::string console_buffer_;  // teed lines on their way to the console
};

// Lines written by the agent itself go through the same lock as worker lines
// so that lines never interleave mid-line.
void write_line(bool to_stderr, const std::string& line);

// Makes this process a child subreaper (PR_SET_CHILD_SUBREAPER): the
// orphaned descendants of its workers are re-parented to it, not to init.
// Returns false when the kernel refuses.
bool make_subreaper();

}  // namespace ductile::agent
