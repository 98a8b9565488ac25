// The CLI's progress bar (cli/progress.hpp): the line it draws, and what it
// writes to a descriptor when it finishes, is abandoned, or never shows.
// A terminal and the one-second delay are tested on the real CLI
// (tests/python/test_cli_progress.py); here a pipe stands for the terminal.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "progress.hpp"

using ductile::cli::progress_line;
using ductile::cli::ProgressBar;
using ductile::cli::ProgressBarOptions;
using ductile::cli::ProgressView;

namespace {

// A pipe standing for the terminal; read() returns what was written once
// the bar is gone.
class BarOutput {
 public:
  BarOutput() {
    if (::pipe2(fds_, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  }
  ~BarOutput() {
    for (int fd : fds_)
      if (fd >= 0) ::close(fd);
  }
  int fd() const { return fds_[1]; }
  std::string read() {
    ::close(fds_[1]);
    fds_[1] = -1;
    std::string text;
    char buffer[4096];
    ssize_t n;
    while ((n = ::read(fds_[0], buffer, sizeof buffer)) > 0)
      text.append(buffer, static_cast<std::size_t>(n));
    return text;
  }

 private:
  int fds_[2] = {-1, -1};
};

// Each "\r" starts a drawn line; the text before the first one must be empty.
std::vector<std::string> drawn_lines(const std::string& text) {
  std::vector<std::string> lines;
  REQUIRE(!text.empty());
  REQUIRE(text[0] == '\r');
  std::size_t begin = 1;
  while (begin <= text.size()) {
    std::size_t end = text.find('\r', begin);
    if (end == std::string::npos) end = text.size();
    lines.push_back(text.substr(begin, end - begin));
    begin = end + 1;
  }
  return lines;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

ProgressBarOptions drawn_at_once(int fd) {
  ProgressBarOptions options;
  options.fd = fd;
  options.assume_terminal = true;
  options.delay = std::chrono::milliseconds(0);
  // One draw by the thread at most (at the start): the others are the test's.
  options.interval = std::chrono::hours(1);
  return options;
}

}  // namespace

TEST_CASE("the bar's line: stage, bar, percentage and elapsed time within the width") {
  ProgressView view;
  view.label = "ductile pack";
  view.stage = "counting tokens";
  view.done = 45;
  view.total = 100;
  view.seconds = 2.34;
  CHECK(progress_line(view) ==
        "ductile pack: counting tokens [#############.................]  45%  2.3 s");

  // Unknown amount of work: the stage and the time it has taken.
  view.stage = "packing";
  view.total = 0;
  CHECK(progress_line(view) == "ductile pack: packing  2.3 s");

  // Never past 100%, and no overflow for totals near 2^64.
  view.total = 10;
  view.done = 11;
  CHECK(contains(progress_line(view), "[##############################] 100%"));
  view.total = std::uint64_t{1} << 63;
  view.done = view.total / 2;
  CHECK(contains(progress_line(view), "  50%"));

  // A narrow terminal: the bar goes first, then the line is cut, never
  // wrapped (a wrapped line cannot be redrawn in place).
  view.stage = "counting tokens";
  view.columns = 40;
  const std::string narrow = progress_line(view);
  CHECK(narrow.size() == 39);
  CHECK(!contains(narrow, "["));
  view.columns = 1;
  CHECK(progress_line(view).size() == 1);
}

TEST_CASE("finish draws the final 100% state and ends the line") {
  BarOutput output;
  {
    ProgressBar bar("test", drawn_at_once(output.fd()));
    REQUIRE(bar.sink() == &bar);
    bar.begin_stage("packing", 10);
    bar.advance(5);
    bar.redraw();
    bar.finish();
    bar.finish();  // once only
  }
  const std::string text = output.read();
  const auto lines = drawn_lines(text);
  REQUIRE(lines.size() >= 2);
  CHECK(contains(lines.back(), "test: done [##############################] 100%"));
  CHECK(lines.back().back() == '\n');
  bool half = false;
  for (std::size_t i = 0; i + 1 < lines.size(); ++i) {
    CHECK(!contains(lines[i], "\n"));
    half = half || contains(lines[i], "test: packing [###############...............]  50%");
  }
  CHECK(half);
}

TEST_CASE("a bar left without finish ends its line where it stopped") {
  BarOutput output;
  {
    ProgressBar bar("test", drawn_at_once(output.fd()));
    bar.begin_stage("writing JSON", 4);
    bar.advance(1);
    bar.redraw();
    // Leaving the scope without finish(): an error is on its way.
  }
  const std::string text = output.read();
  const auto lines = drawn_lines(text);
  CHECK(contains(lines.back(), "test: writing JSON ["));
  CHECK(contains(lines.back(), "25%"));
  CHECK(lines.back().back() == '\n');
  CHECK(!contains(text, "100%"));
  CHECK(text.find('\n') == text.size() - 1);
}

TEST_CASE("a bar draws nothing before its delay, nor on a descriptor that is no terminal") {
  SUBCASE("quick work") {
    BarOutput output;
    {
      ProgressBarOptions options;
      options.fd = output.fd();
      options.assume_terminal = true;
      options.delay = std::chrono::hours(1);
      ProgressBar bar("test", options);
      bar.begin_stage("packing", 10);
      bar.advance(10);
      bar.redraw();
      bar.finish();
    }
    CHECK(output.read().empty());
  }
  SUBCASE("a pipe") {
    BarOutput output;
    {
      ProgressBarOptions options = drawn_at_once(output.fd());
      options.assume_terminal = false;
      ProgressBar bar("test", options);
      // The pipeline gets no sink: it skips every report.
      CHECK(bar.sink() == nullptr);
      bar.begin_stage("packing", 10);
      bar.redraw();
      bar.finish();
    }
    CHECK(output.read().empty());
  }
}
