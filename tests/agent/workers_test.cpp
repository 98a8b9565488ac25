// WorkerGroup without an agent: where output goes, teed lines split as
// torchrun's tail splits them, exit statuses, and stopping a group whose
// workers started children of their own.
#include <doctest/doctest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "agent_support.hpp"
#include "ductile/agent/workers.hpp"
#include "temp_dir.hpp"

using namespace ductile::agent;
using namespace ductile::test;

namespace {

WorkerSpec shell(std::int64_t rank, const std::string& script, const std::string& marker) {
  WorkerSpec spec{rank, rank, {"/bin/sh", "-c", script}, {marker, "PATH=/usr/bin:/bin"}};
  return spec;
}

void run_to_the_end(WorkerGroup& group) {
  REQUIRE(wait_until(
      [&] {
        group.pump(std::chrono::milliseconds(20));
        return !group.running();
      },
      30s));
}

// Runs `worker` (which exits 4) as a round to its end, then starts its
// spare for the next; returns what it printed.
std::string round_then_spare(WorkerGroup& group, const WorkerSpec& worker,
                             const SpareSetup& setup) {
  group.start({worker});
  run_to_the_end(group);
  REQUIRE(group.first_failure());
  CHECK(group.first_failure()->status == 4);
  group.start_spares({worker}, setup, std::chrono::milliseconds(0));
  return read_text(worker.stdout_file);
}

std::string split(const std::vector<std::string>& pieces) {
  LineSplitter splitter;
  std::string out;
  for (const auto& piece : pieces) splitter.feed(piece.data(), piece.size(), "[p]:", out);
  splitter.finish("[p]:", out);
  return out;
}

}  // namespace

TEST_CASE("workers: statuses, and the last lines of a failing worker from its log file") {
  TempDir dir;
  std::string marker = new_marker();
  WorkerGroup group;
  WorkerSpec failing = shell(1, "echo one; echo 'last words' >&2; exit 7", marker);
  failing.stdout_file = dir / "1" / "stdout.log";
  failing.stderr_file = dir / "1" / "stderr.log";
  failing.stdout_console = failing.stderr_console = false;
  group.start({shell(0, "echo zero; exit 0", marker), failing});
  run_to_the_end(group);
  CHECK_FALSE(group.all_succeeded());
  auto failure = group.first_failure();
  REQUIRE(failure);
  CHECK(failure->rank == 1);
  CHECK(failure->status == 7);
  // stderr's log file first.
  CHECK(failure->last_lines == std::vector<std::string>{"last words"});
  CHECK(read_text(dir / "1" / "stdout.log") == "one\n");
  group.stop(std::chrono::milliseconds(0));
  CHECK(group.empty());

  // Output on the console only: no lines to report (no pipe was read).
  WorkerGroup console;
  console.start({shell(0, "echo shown >&2; exit 3", marker)});
  run_to_the_end(console);
  REQUIRE(console.first_failure());
  CHECK(console.first_failure()->last_lines.empty());
}

TEST_CASE("workers: a console stream is the agent's own descriptor, not a pipe") {
  TempDir dir;
  const std::string marker = new_marker();
  char own[256] = {};
  REQUIRE(readlink("/proc/self/fd/2", own, sizeof own - 1) > 0);
  WorkerGroup group;
  WorkerSpec spec = shell(0, "readlink /proc/$$/fd/2 > " + (dir / "fd2").string(), marker);
  group.start({spec});
  run_to_the_end(group);
  CHECK(group.all_succeeded());
  CHECK(read_text(dir / "fd2") == std::string(own) + "\n");
}

TEST_CASE("workers: teed lines end as Python's universal newlines end them") {
  CHECK(split({"a\nb\rc\r\nd"}) == "[p]:a\n[p]:b\n[p]:c\n[p]:d\n");
  // "\r\n" split across two reads is one ending.
  CHECK(split({"a\r", "\nb\r", "", "c\n"}) == "[p]:a\n[p]:b\n[p]:c\n");
  CHECK(split({"\r\r"}) == "[p]:\n[p]:\n");
  // A line longer than the bound is shown in pieces; nothing more is held.
  const std::string long_line(kMaxTeedLineBytes + 10, 'x');
  LineSplitter splitter;
  std::string out;
  splitter.feed(long_line.data(), long_line.size(), "", out);
  CHECK(out == std::string(kMaxTeedLineBytes, 'x') + "\n");
  CHECK(splitter.held() == 10);
}

TEST_CASE("workers: a command that cannot run exits 127 - a signal is 128 + its number") {
  std::string marker = new_marker();
  WorkerGroup group;
  group.start(
      {WorkerSpec{0, 0, {"/nonexistent/worker"}, {marker}}, shell(1, "kill -9 $$", marker)});
  REQUIRE(wait_until(
      [&] {
        group.pump(std::chrono::milliseconds(20));
        return !group.running();
      },
      30s));
  auto failure = group.first_failure();
  REQUIRE(failure);
  // Either may be reaped first; both statuses are checked through the failure.
  CHECK((failure->status == 127 || failure->status == 128 + 9));
  group.stop(std::chrono::milliseconds(0));
}

TEST_CASE("workers: stop ends workers and the children they started") {
  std::string marker = new_marker();
  {
    WorkerGroup group;
    // The worker ignores SIGTERM and leaves a grandchild running.
    group.start({shell(0, "trap '' TERM; sleep 300 & sleep 300; wait", marker),
                 shell(1, "sleep 300 & wait", marker)});
    REQUIRE(wait_until([&] { return marked_processes(marker).size() >= 5; }, 30s));
    group.stop(std::chrono::milliseconds(300));
    CHECK(group.empty());
  }
  CHECK(no_marked_processes(marker));
}

TEST_CASE("workers: what a worker leaves in a process group of its own ends with it") {
  TempDir dir;
  const std::string marker = new_marker();
  WorkerGroup group;
  // The background job runs under setsid, in a process group of its own (no
  // group of the worker's holds it) and ignores SIGTERM: the guard's SIGKILL after the
  // grace ends it. The worker waits until the job runs before it exits.
  const auto pid_file = dir / "orphan.pid";
  group.start({shell(0,
                     "setsid sh -c 'trap \"\" TERM; echo $$ > " + pid_file.string() +
                         "; exec sleep 302' & while [ ! -s " + pid_file.string() +
                         " ]; do sleep 0.05; done; exit 0",
                     marker)},
              std::chrono::milliseconds(300));
  run_to_the_end(group);
  CHECK(group.all_succeeded());
  const int orphan = std::stoi(read_text(pid_file));
  // Reaped by the guard: no process, not even a zombie, has its pid.
  CHECK_FALSE(std::filesystem::exists("/proc/" + std::to_string(orphan)));
  CHECK(marked_processes(marker).empty());
}

TEST_CASE("workers: a stop signal before the workers start leaves them unstarted") {
  TempDir dir;
  const std::string marker = new_marker();
  std::atomic<int> stop{SIGTERM};
  WorkerGroup group;
  WorkerSpec spec = shell(0, "sleep 300", marker);
  spec.directory = dir / "attempt_0" / "0";
  CHECK_FALSE(group.start({spec, spec}, std::chrono::milliseconds(0), &stop));
  CHECK(group.empty());
  CHECK_FALSE(std::filesystem::exists(dir / "attempt_0"));
  // Without it: each worker's directory is made as it starts.
  stop = 0;
  CHECK(group.start({spec}, std::chrono::milliseconds(0), &stop));
  CHECK(std::filesystem::is_directory(spec.directory));
  group.stop(std::chrono::milliseconds(0));
  CHECK(no_marked_processes(marker));
}

TEST_CASE(
    "workers: a spare runs the next worker when its environment is the spare's, else the "
    "worker starts cold") {
  TempDir dir;
  const std::string marker = new_marker();
  const auto script = dir.write("worker.py",
                                "import os, sys\n"
                                "print(os.environ['RANK'], os.environ['SETTING'], 'json' in "
                                "sys.modules, sys.argv[1:])\n"
                                "sys.exit(4)\n");
  // RANK is set per round; SETTING is not.
  const SpareSetup setup{1, {"json"}, [](const std::string& name) { return name == "RANK"; }};
  auto spec = [&](const std::string& rank, const std::string& setting) {
    WorkerSpec s{0,
                 0,
                 {DUCTILE_PYTHON, script.string(), "--flag"},
                 {marker, "PATH=/usr/bin:/bin", "PYTHONPATH=" DUCTILE_PYTHON_SOURCES,
                  "SETTING=" + setting, "RANK=" + rank}};
    s.stdout_file = dir / ("out" + rank + ".log");
    s.stdout_console = s.stderr_console = false;
    return s;
  };
  WorkerGroup group;
  auto round = [&](const WorkerSpec& worker) {
    const std::string out = round_then_spare(group, worker, setup);
    CHECK(group.spares() == 1);
    return out;
  };
  CHECK(round(spec("0", "a")) == "0 a False ['--flag']\n");
  CHECK(group.start_log().empty());  // no spare yet
  // The spare imported json: the worker it became sees it loaded.
  CHECK(round(spec("1", "a")) == "1 a True ['--flag']\n");
  CHECK(group.start_log() == std::vector<std::string>{"local rank 0 started from its spare"});
  CHECK(round(spec("2", "b")) == "2 b False ['--flag']\n");
  CHECK(group.start_log() ==
        std::vector<std::string>{
            "local rank 0 started cold: its environment differs from its spare's in SETTING"});
  group.stop(std::chrono::milliseconds(0));
  CHECK(group.spares() == 1);  // a round's end leaves them
  group.stop_spares();
  CHECK(group.spares() == 0);
  CHECK(no_marked_processes(marker));
}

// A spare imports what the job's own Python would: a module planted in the
// agent's working directory (where `python -m` would look first) is never
// imported, the module of the job's path is; and the worker it becomes has
// its script's folder first on sys.path, as the same worker started cold.
TEST_CASE("workers: a spare imports nothing from the agent's working directory") {
  TempDir dir;
  const std::string marker = new_marker();
  const auto planted = dir / "planted-imported";
  std::filesystem::create_directories(dir / "agent");
  dir.write("agent/jobmodule.py", "open(" + std::string("'") + planted.string() +
                                      "', 'w').write('planted')\nWHERE = 'agent'\n");
  dir.write("lib/jobmodule.py", "WHERE = 'lib'\n");
  const auto script = dir.write(
      "job/worker.py",
      "import os, sys, jobmodule\n"
      "print(os.environ['RANK'], jobmodule.WHERE, sys.path[0] == os.path.dirname(__file__), "
      "'jobmodule' in sys.modules)\n"
      "sys.exit(4)\n");
  const SpareSetup setup{1, {"jobmodule"}, [](const std::string& name) { return name == "RANK"; }};
  auto spec = [&](const std::string& rank) {
    WorkerSpec s{
        0,
        0,
        {DUCTILE_PYTHON, script.string()},
        {marker, "PATH=/usr/bin:/bin",
         "PYTHONPATH=" DUCTILE_PYTHON_SOURCES ":" + (dir / "lib").string(), "RANK=" + rank}};
    s.stdout_file = dir / ("out" + rank + ".log");
    s.stdout_console = s.stderr_console = false;
    return s;
  };
  // The agent's working directory holds the planted module.
  const auto previous = std::filesystem::current_path();
  std::filesystem::current_path(dir / "agent");
  WorkerGroup group;
  CHECK(round_then_spare(group, spec("0"), setup) == "0 lib True True\n");  // cold
  CHECK(round_then_spare(group, spec("1"), setup) == "1 lib True True\n");  // from its spare
  CHECK(group.start_log() == std::vector<std::string>{"local rank 0 started from its spare"});
  group.stop(std::chrono::milliseconds(0));
  group.stop_spares();
  std::filesystem::current_path(previous);
  CHECK_FALSE(std::filesystem::exists(planted));
  CHECK(no_marked_processes(marker));
}
