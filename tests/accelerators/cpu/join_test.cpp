// Processes started without mpirun, each with RANK, WORLD_SIZE and
// DUCTILE_MPI_JOIN in its environment (as `ductile agent --mpi-world` starts
// workers), join one MPI world through a real ompi-server started by the
// test: the whole collective suite passes on such a world, ranks follow
// RANK whatever the start order, and every way a join can go wrong ends each
// process with a message naming the variable or the peer, within a bound.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ports.hpp"
#include "temp_dir.hpp"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::string read_text(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A child in its own process group with its output in `log`; killed (with
// its group) if the test ends first.
class Spawned {
 public:
  Spawned(std::vector<std::string> argv, const std::vector<std::string>& env_add, fs::path log)
      : log_(std::move(log)) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      std::string entry(*e);
      bool replaced = false;
      for (const auto& add : env_add)
        replaced |= entry.compare(0, add.find('=') + 1, add, 0, add.find('=') + 1) == 0;
      if (!replaced) env.push_back(entry);
    }
    env.insert(env.end(), env_add.begin(), env_add.end());
    std::vector<char*> args, envp;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t parent = getpid();
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(127);
      setpgid(0, 0);
      int fd = open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      execve(args[0], args.data(), envp.data());
      _exit(127);
    }
  }
  ~Spawned() {
    if (!exited_) {
      kill(-pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
  }
  Spawned(const Spawned&) = delete;
  Spawned& operator=(const Spawned&) = delete;

  // The exit status, or -1 when it did not end by `deadline` (then killed).
  int wait(Clock::time_point deadline) {
    while (true) {
      int status = 0;
      pid_t done = waitpid(pid_, &status, WNOHANG);
      if (done == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      if (Clock::now() > deadline) return -1;
      std::this_thread::sleep_for(20ms);
    }
  }
  std::string output() const { return read_text(log_); }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  bool exited_ = false;
};

// ompi-server, as `ductile agent --mpi-world` runs it: the rendezvous of
// Open MPI's dynamic-process calls between separately started processes.
class OmpiServer {
 public:
  explicit OmpiServer(const ductile::test::TempDir& dir)
      : server_({DUCTILE_OMPI_SERVER, "--no-daemonize", "--report-uri",
                 (dir / "ompi-server.uri").string()},
                {}, dir / "ompi-server.log") {
    auto deadline = Clock::now() + 30s;
    while (uri_.empty() && Clock::now() < deadline) {
      std::this_thread::sleep_for(20ms);
      uri_ = read_text(dir / "ompi-server.uri");
      if (!uri_.empty() && uri_.back() != '\n') uri_.clear();  // still being written
    }
    REQUIRE_MESSAGE(!uri_.empty(), "ompi-server did not report its address: " << server_.output());
    uri_.pop_back();
  }
  const std::string& uri() const { return uri_; }

 private:
  Spawned server_;
  std::string uri_;
};

struct RankRun {
  int status = -1;
  std::string output;
};

// Starts `program` once per entry of `envs` (each with its own RANK, ...),
// in the order given, and waits for all of them.
std::vector<RankRun> run_ranks(const ductile::test::TempDir& dir, const std::string& program,
                               const std::vector<std::vector<std::string>>& envs,
                               std::chrono::seconds bound = 240s) {
  static int runs_started = 0;  // log names stay unique within a test
  ++runs_started;
  std::vector<std::unique_ptr<Spawned>> ranks;
  for (std::size_t i = 0; i < envs.size(); ++i)
    ranks.push_back(std::make_unique<Spawned>(
        std::vector<std::string>{program}, envs[i],
        dir / ("run-" + std::to_string(runs_started) + "-" + std::to_string(i) + ".log")));
  auto deadline = Clock::now() + bound;
  std::vector<RankRun> runs;
  for (auto& rank : ranks) {
    RankRun run;
    run.status = rank->wait(deadline);
    run.output = rank->output();
    runs.push_back(std::move(run));
  }
  return runs;
}

std::vector<std::string> rank_env(int rank, int size, const std::string& join,
                                  const std::string& server_uri,
                                  const std::string& timeout = "120") {
  std::vector<std::string> env = {"RANK=" + std::to_string(rank),
                                  "WORLD_SIZE=" + std::to_string(size),
                                  "LOCAL_RANK=" + std::to_string(rank),
                                  "LOCAL_WORLD_SIZE=" + std::to_string(size),
                                  "DUCTILE_MPI_JOIN=" + join,
                                  "DUCTILE_MPI_JOIN_TIMEOUT=" + timeout,
                                  "OMPI_MCA_pmix_server_uri=" + server_uri};
  return env;
}

std::string join_address() {
  return "127.0.0.1:" + std::to_string(ductile::test::free_tcp_port());
}

}  // namespace

TEST_CASE("3 processes started without mpirun join one world: the collective suite passes") {
  ductile::test::TempDir dir;
  OmpiServer server(dir);
  std::string join = join_address();
  std::vector<std::vector<std::string>> envs;
  for (int rank : {2, 0, 1}) envs.push_back(rank_env(rank, 3, join, server.uri()));
  auto runs = run_ranks(dir, DUCTILE_COLLECTIVES_PROGRAM, envs);
  for (const auto& run : runs) {
    INFO(run.output);
    CHECK(run.status == 0);
    CHECK(run.output.find("Status: SUCCESS!") != std::string::npos);
  }
}

TEST_CASE("a joined world follows RANK, not the order the processes started in") {
  ductile::test::TempDir dir;
  OmpiServer server(dir);
  std::string join = join_address();
  auto runs = run_ranks(dir, DUCTILE_JOIN_PROGRAM,
                        {rank_env(3, 4, join, server.uri()), rank_env(1, 4, join, server.uri()),
                         rank_env(2, 4, join, server.uri()), rank_env(0, 4, join, server.uri())});
  const int expected_rank[] = {3, 1, 2, 0};
  for (std::size_t i = 0; i < runs.size(); ++i) {
    INFO(runs[i].output);
    CHECK(runs[i].status == 0);
    CHECK(runs[i].output.find("rank " + std::to_string(expected_rank[i]) + " of 4: sum 10") !=
          std::string::npos);
  }
}

TEST_CASE("join errors name the variable or the peer at fault and end every process") {
  ductile::test::TempDir dir;
  OmpiServer server(dir);
  auto one = [&](std::vector<std::string> env) {
    auto runs = run_ranks(dir, DUCTILE_JOIN_PROGRAM, {std::move(env)}, 120s);
    return runs.front();
  };

  SUBCASE("DUCTILE_MPI_JOIN that is not HOST:PORT") {
    RankRun run = one(rank_env(0, 2, "node0-no-port", server.uri()));
    CHECK(run.status == 2);
    CHECK(run.output.find("DUCTILE_MPI_JOIN='node0-no-port' is not HOST:PORT") !=
          std::string::npos);
  }
  SUBCASE("a bad DUCTILE_MPI_JOIN_TIMEOUT") {
    RankRun run = one(rank_env(0, 2, join_address(), server.uri(), "soon"));
    CHECK(run.status == 2);
    CHECK(run.output.find("DUCTILE_MPI_JOIN_TIMEOUT='soon' is not a number of seconds") !=
          std::string::npos);
  }
  SUBCASE("no ompi-server named") {
    auto env = rank_env(0, 2, join_address(), server.uri());
    env.back() = "OMPI_MCA_pmix_server_uri=";
    RankRun run = one(env);
    CHECK(run.status == 2);
    CHECK(run.output.find("OMPI_MCA_pmix_server_uri is not") != std::string::npos);
  }
  SUBCASE("rank 0 alone: the others never come") {
    RankRun run = one(rank_env(0, 2, join_address(), server.uri(), "2"));
    CHECK(run.status == 2);
    CHECK(run.output.find("1 of the 2 ranks did not reach rank 0") != std::string::npos);
  }
  SUBCASE("a joiner alone: rank 0 is not there") {
    RankRun run = one(rank_env(1, 2, join_address(), server.uri(), "2"));
    CHECK(run.status == 2);
    CHECK(run.output.find("rank 1 could not reach rank 0 at 127.0.0.1:") != std::string::npos);
  }
  SUBCASE("ranks that disagree on WORLD_SIZE") {
    std::string join = join_address();
    auto runs =
        run_ranks(dir, DUCTILE_JOIN_PROGRAM,
                  {rank_env(0, 2, join, server.uri()), rank_env(1, 3, join, server.uri())}, 120s);
    for (const auto& run : runs) {
      INFO(run.output);
      CHECK(run.status == 2);
      CHECK(run.output.find("a process with RANK=1 says WORLD_SIZE=3 where rank 0 has 2") !=
            std::string::npos);
    }
  }
}
