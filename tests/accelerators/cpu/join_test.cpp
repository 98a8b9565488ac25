// Processes started without mpirun, each with RANK, WORLD_SIZE and
// DUCTILE_MPI_JOIN in its environment (as `ductile agent --mpi-world` starts
// workers), join one MPI world through a real ompi-server started by the
// test: the whole collective suite passes on such a world, ranks follow
// RANK whatever the start order, and every way a join can go wrong ends each
// process with a message naming the variable or the peer, within a bound.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "child_process.hpp"
#include "ports.hpp"
#include "temp_dir.hpp"

namespace {

using namespace ductile::test;
namespace fs = std::filesystem;

// ompi-server, as `ductile agent --mpi-world` runs it: the rendezvous of
// Open MPI's dynamic-process calls between separately started processes.
class OmpiServer {
 public:
  explicit OmpiServer(const TempDir& dir)
      : server_({DUCTILE_OMPI_SERVER, "--no-daemonize", "--report-uri",
                 (dir / "ompi-server.uri").string()},
                {}, dir / "ompi-server.log") {
    // Complete once its line ends.
    wait_until(
        [&] {
          uri_ = read_text(dir / "ompi-server.uri");
          return !uri_.empty() && uri_.back() == '\n';
        },
        30s);
    REQUIRE_MESSAGE((!uri_.empty() && uri_.back() == '\n'),
                    "ompi-server did not report its address: " << server_.output());
    uri_.pop_back();
  }
  const std::string& uri() const { return uri_; }

 private:
  Child server_;
  std::string uri_;
};

struct RankRun {
  int status = -1;
  std::string output;
};

// Starts `program` once per entry of `envs` (each with its own RANK, ...),
// in the order given, and waits for all of them.
std::vector<RankRun> run_ranks(const TempDir& dir, const std::string& program,
                               const std::vector<std::vector<std::string>>& envs,
                               std::chrono::seconds bound = 240s) {
  static int runs_started = 0;  // log names stay unique within a test
  ++runs_started;
  std::vector<std::unique_ptr<Child>> ranks;
  for (std::size_t i = 0; i < envs.size(); ++i)
    ranks.push_back(std::make_unique<Child>(
        std::vector<std::string>{program}, envs[i],
        dir / ("run-" + std::to_string(runs_started) + "-" + std::to_string(i) + ".log")));
  auto deadline = Clock::now() + bound;
  std::vector<RankRun> runs;
  for (auto& rank : ranks) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    runs.push_back(
        {rank->wait(std::max(left, std::chrono::milliseconds(0))).value_or(-1), rank->output()});
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
  return "127.0.0.1:" + std::to_string(free_tcp_port());
}

}  // namespace

TEST_CASE("3 processes started without mpirun join one world: the collective suite passes") {
  TempDir dir;
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
  TempDir dir;
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
  TempDir dir;
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
