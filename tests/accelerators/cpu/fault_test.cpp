// Fault behaviour of the cpu accelerator: one rank of a 3-rank job leaves
// mid-run; the job must end with a non-zero status within a bound instead of
// hanging. Runs fault_program under mpirun as a subprocess and checks its
// exit status, output and elapsed time (a bound on termination, not a
// performance assertion: the bounds are far above the expected times).
#include <doctest/doctest.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <string>

namespace {

struct JobResult {
  int status = -1;  // exit status of mpirun
  double seconds = 0;
  std::string output;
};

JobResult run_job(const std::string& mode, int timeout_seconds) {
  // The job's processes run outside this test's sanitizer settings: Open MPI
  // leaks at exit by design.
  // `timeout` guards the test itself: a hung job is killed after 150 s and
  // then fails the elapsed-time bound instead of blocking the suite.
  std::string command = std::string("env ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 ") +
                        "timeout --kill-after=10 150 " + DUCTILE_TEST_MPIEXEC + " -np 3 " +
                        DUCTILE_FAULT_PROGRAM + " " + mode + " " + std::to_string(timeout_seconds) +
                        " 2>&1";
  auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  JobResult result;
  std::array<char, 4096> chunk;
  std::size_t n;
  while ((n = std::fread(chunk.data(), 1, chunk.size(), pipe)) > 0)
    result.output.append(chunk.data(), n);
  int raw = pclose(pipe);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
  return result;
}

std::size_t occurrences(const std::string& text, const std::string& needle) {
  std::size_t count = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1))
    ++count;
  return count;
}

}  // namespace

TEST_CASE("control: the same job without a fault ends with status 0") {
  JobResult job = run_job("none", 30);
  INFO(job.output);
  CHECK(job.status == 0);
  CHECK(occurrences(job.output, "all collectives done") == 3);
}

TEST_CASE("a rank that exits mid-run: the others fail by timeout and the job ends non-zero") {
  // Collective timeout 3 s; MPI_Finalize of the exiting rank is bounded by
  // the same timeout. The bound below leaves room for slow (sanitized)
  // start-up on a loaded machine.
  JobResult job = run_job("exit", 3);
  INFO(job.output);
  CHECK(job.status != 0);
  CHECK(job.seconds < 90);
  CHECK(occurrences(job.output, "two collectives done") == 3);
  CHECK(job.output.find("did not complete within the collective timeout") != std::string::npos);
  CHECK(job.output.find("(communication)") != std::string::npos);
  CHECK(job.output.find("sticky failure ok") != std::string::npos);
  CHECK(job.output.find("sticky failure MISSING") == std::string::npos);
  CHECK(job.output.find("all collectives done") == std::string::npos);
}

TEST_CASE("a rank killed mid-run: the job ends non-zero without waiting for the timeout") {
  // The collective timeout (600 s) is far above the bound: termination comes
  // from mpirun noticing the dead rank.
  JobResult job = run_job("kill", 600);
  INFO(job.output);
  CHECK(job.status != 0);
  CHECK(job.seconds < 90);
  CHECK(job.output.find("all collectives done") == std::string::npos);
}
