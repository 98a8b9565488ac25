#include "progress.hpp"

#include <pthread.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>

#include <fmt/format.h>

namespace ductile::cli {
namespace {

// The signals that end a bar's line before the process dies of them.
constexpr int kSignals[] = {SIGINT, SIGTERM};
constexpr std::size_t kSignalCount = sizeof(kSignals) / sizeof(kSignals[0]);

// Shared with the signal handler, hence lock-free atomics and plain arrays
// written before the handler is installed and read only by it.
std::atomic<int> g_open_line_fd{-1};  // a bar line drawn and not yet ended
struct sigaction g_previous[kSignalCount];
bool g_installed[kSignalCount] = {};
static_assert(std::atomic<int>::is_always_lock_free);

constexpr std::size_t kMaxBarWidth = 30;
constexpr std::size_t kMinBarWidth = 10;

// Writes all of `text`; a failure is dropped (see the header).
void write_all(int fd, std::string_view text) noexcept {
  while (!text.empty()) {
    const ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text.remove_prefix(static_cast<std::size_t>(n));
  }
}

// Ends the bar's line, puts the disposition that was there before back and
// raises the signal again: it acts as if no bar had been drawn (the default
// action ends the process) once this handler returns.
extern "C" void end_line_then_resignal(int signal_number) {
  const int saved_errno = errno;
  const int fd = g_open_line_fd.exchange(-1);
  if (fd >= 0) {
    const ssize_t ignored = ::write(fd, "\n", 1);
    (void)ignored;
  }
  for (std::size_t i = 0; i < kSignalCount; ++i)
    if (kSignals[i] == signal_number && g_installed[i]) {
      ::sigaction(signal_number, &g_previous[i], nullptr);
      g_installed[i] = false;
    }
  ::raise(signal_number);
  errno = saved_errno;
}

void install_signal_handlers() {
  for (std::size_t i = 0; i < kSignalCount; ++i) {
    struct sigaction previous {};
    if (::sigaction(kSignals[i], nullptr, &previous) != 0) continue;
    // An ignored signal (nohup, a background job) stays ignored.
    if (!(previous.sa_flags & SA_SIGINFO) && previous.sa_handler == SIG_IGN) continue;
    g_previous[i] = previous;
    struct sigaction action {};
    action.sa_handler = end_line_then_resignal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    g_installed[i] = true;
    if (::sigaction(kSignals[i], &action, nullptr) != 0) g_installed[i] = false;
  }
}

void restore_signal_handlers() {
  for (std::size_t i = 0; i < kSignalCount; ++i) {
    if (!g_installed[i]) continue;
    ::sigaction(kSignals[i], &g_previous[i], nullptr);
    g_installed[i] = false;
  }
}

std::size_t terminal_columns(int fd) {
  struct winsize size {};
  if (::ioctl(fd, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  return 80;  // a new pseudo-terminal reports 0
}

}  // namespace

std::string progress_line(const ProgressView& view) {
  const std::size_t limit = view.columns > 1 ? view.columns - 1 : 1;
  std::string line = fmt::format("{}: {}", view.label, view.stage);
  const std::string elapsed = fmt::format("{:.1f} s", view.seconds);
  if (view.total == 0) {
    line += "  " + elapsed;
  } else {
    const double fraction =
        static_cast<double>(std::min(view.done, view.total)) / static_cast<double>(view.total);
    const std::string tail =
        fmt::format(" {:3d}%  {}", static_cast<int>(fraction * 100.0), elapsed);
    const std::size_t fixed = line.size() + 3 + tail.size();  // " [" and "]"
    const std::size_t width = fixed < limit ? std::min(kMaxBarWidth, limit - fixed) : 0;
    if (width >= kMinBarWidth) {
      const auto filled = static_cast<std::size_t>(fraction * static_cast<double>(width));
      line += " [";
      line.append(filled, '#');
      line.append(width - filled, '.');
      line += "]";
    }
    line += tail;
  }
  if (line.size() > limit) line.resize(limit);
  return line;
}

ProgressBar::ProgressBar(std::string label, ProgressBarOptions options)
    : label_(std::move(label)),
      options_(options),
      enabled_(options.assume_terminal || ::isatty(options.fd) == 1),
      start_(std::chrono::steady_clock::now()) {
  if (!enabled_) return;
  install_signal_handlers();
  try {
    thread_ = std::thread([this] { run(); });
  } catch (...) {
    restore_signal_handlers();
    throw;
  }
}

ProgressBar::~ProgressBar() {
  if (!enabled_) return;
  stop_thread();
  {
    std::lock_guard lock(mutex_);
    if (on_screen_) {
      write_all(options_.fd, "\n");
      on_screen_ = false;
      g_open_line_fd.store(-1);
    }
  }
  restore_signal_handlers();
}

void ProgressBar::begin_stage(const char* name, std::uint64_t total) noexcept {
  // Total first, then done: a redraw in between sees at most a bar that
  // has not moved back yet, never more than 100%.
  total_.store(total, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  stage_.store(name, std::memory_order_relaxed);
}

void ProgressBar::advance(std::uint64_t done) noexcept {
  done_.store(done, std::memory_order_relaxed);
}

void ProgressBar::redraw() noexcept {
  if (!enabled_) return;
  std::lock_guard lock(mutex_);
  if (finished_ || std::chrono::steady_clock::now() - start_ < options_.delay) return;
  draw_locked(false);
}

void ProgressBar::finish() noexcept {
  if (!enabled_) return;
  stop_thread();
  std::lock_guard lock(mutex_);
  if (finished_) return;
  finished_ = true;
  if (on_screen_ || std::chrono::steady_clock::now() - start_ >= options_.delay) draw_locked(true);
}

void ProgressBar::draw_locked(bool final) noexcept {
  try {
    ProgressView view;
    view.label = label_;
    view.stage = final ? "done" : stage_.load(std::memory_order_relaxed);
    view.total = final ? 1 : total_.load(std::memory_order_relaxed);
    view.done = final ? 1 : done_.load(std::memory_order_relaxed);
    view.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    view.columns = terminal_columns(options_.fd);
    const std::string line = progress_line(view);
    // Spaces over what is left of a longer line drawn before.
    std::string text = "\r" + line;
    if (drawn_chars_ > line.size()) text.append(drawn_chars_ - line.size(), ' ');
    if (final) text += "\n";
    // The line counts as open before its first byte is out: a signal that
    // comes once the text is seen must find it so and end it.
    if (!final) g_open_line_fd.store(options_.fd);
    write_all(options_.fd, text);
    drawn_chars_ = line.size();
    on_screen_ = !final;
    if (final) g_open_line_fd.store(-1);
  } catch (const std::exception&) {
    // No memory for a line: this redraw is skipped.
  }
}

void ProgressBar::stop_thread() noexcept {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void ProgressBar::run() noexcept {
  // The signals go to the other threads: the handler then never interrupts
  // a redraw half written.
  sigset_t blocked;
  sigemptyset(&blocked);
  for (int signal_number : kSignals) sigaddset(&blocked, signal_number);
  pthread_sigmask(SIG_BLOCK, &blocked, nullptr);

  std::unique_lock lock(mutex_);
  auto next = start_ + options_.delay;
  while (!wake_.wait_until(lock, next, [this] { return stopping_; })) {
    draw_locked(false);
    next = std::chrono::steady_clock::now() + options_.interval;
  }
}

}  // namespace ductile::cli
