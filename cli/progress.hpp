// The progress bar of the long commands (`ductile pack`, `ductile elastic`):
// one line on standard error, redrawn in place ("\r") while the work runs,
// for a person watching a terminal. It implements the pipeline's
// ProgressSink, so the pipeline reports to it without knowing the CLI.
//
// When it shows: only when its file descriptor (stderr) is a terminal, and
// only once the work has run for `delay` (1 s): a quick command prints
// nothing, and output that a program reads (a pipe, a file, --json on
// stdout) never holds a bar byte. It redraws at most once per `interval`
// (100 ms) from a thread of its own, so a stage of unknown length (a
// plugin's call) still shows its elapsed time.
// How it ends: finish() draws the final state (100%) and ends the line;
// the destructor, reached without finish() (an error on its way to the
// user), ends the line where the bar stopped, so that the error message
// starts a line of its own; SIGINT and SIGTERM end the line before the
// process dies of them. Results are printed after finish(): stdout is
// often the same terminal.
//
// Ownership: a ProgressBar owns its drawing thread and the signal handlers
// it installs (restored on destruction); it does not own the descriptor.
// At most one ProgressBar may exist at a time (the handlers are
// process-wide).
// Threading: begin_stage() and advance() may be called from one working
// thread while the drawing thread runs (they store atomics, never block);
// finish(), redraw() and the destructor belong to the thread that made it.
// Errors: nothing throws after construction; a failed write to the terminal
// is dropped (a bar is not worth failing the command for). The constructor
// throws std::system_error when the drawing thread cannot start.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "ductile/pipeline/progress.hpp"

namespace ductile::cli {

// What one line of the bar shows.
struct ProgressView {
  std::string_view label;    // "ductile pack"
  std::string_view stage;    // "packing"; "done" when finished
  std::uint64_t done = 0;    // of total
  std::uint64_t total = 0;   // 0: not known (no bar, no percentage)
  double seconds = 0;        // since the bar was made
  std::size_t columns = 80;  // terminal width
};

// The line drawn for `view`, without "\r" or newline, at most columns - 1
// characters (a line that wraps could not be redrawn in place):
//   "ductile pack: counting tokens [#########...........]  45%  2.3 s"
//   "ductile pack: packing  2.3 s"  (total 0)
std::string progress_line(const ProgressView& view);

struct ProgressBarOptions {
  int fd = 2;  // standard error
  // Shown only when fd is a terminal (isatty); `assume_terminal` draws on
  // any descriptor (a pipe in tests).
  bool assume_terminal = false;
  std::chrono::milliseconds delay{1000};    // nothing is drawn before
  std::chrono::milliseconds interval{100};  // between two redraws
};

class ProgressBar final : public pipeline::ProgressSink {
 public:
  explicit ProgressBar(std::string label, ProgressBarOptions options = {});
  ~ProgressBar() override;
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  // This bar as the sink to hand to the pipeline, or nullptr when it never
  // shows (not a terminal): the pipeline then skips every report.
  pipeline::ProgressSink* sink() noexcept { return enabled_ ? this : nullptr; }

  void begin_stage(const char* name, std::uint64_t total) noexcept override;
  void advance(std::uint64_t done) noexcept override;

  // Draws the current state now if the delay has passed (the drawing
  // thread's step; callable from the owning thread too).
  void redraw() noexcept;
  // The work is done: a bar shown, or due (past the delay), is drawn at
  // 100% and its line ended. Later calls and the destructor draw nothing.
  void finish() noexcept;

 private:
  void draw_locked(bool final) noexcept;
  void stop_thread() noexcept;
  void run() noexcept;

  const std::string label_;
  const ProgressBarOptions options_;
  const bool enabled_;
  const std::chrono::steady_clock::time_point start_;

  std::atomic<const char*> stage_{""};
  std::atomic<std::uint64_t> total_{0};
  std::atomic<std::uint64_t> done_{0};

  std::mutex mutex_;  // guards the writes and the members below
  std::condition_variable wake_;
  bool stopping_ = false;
  bool finished_ = false;
  bool on_screen_ = false;       // a line is drawn and not yet ended
  std::size_t drawn_chars_ = 0;  // length of the line drawn last
  std::thread thread_;
};

}  // namespace ductile::cli
