// A snapshot base crowded with other files: a dead agent's area is found
// and removed however many other entries the base holds (the search passes
// over them by name), as /dev/shm may hold many.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../../agent/src/snapshot_area.hpp"
#include "temp_dir.hpp"

using namespace ductile::agent;
namespace fs = std::filesystem;

TEST_CASE("snapshot area: a dead agent's area is found among 150,006 other entries") {
  ductile::test::TempDir base;
  // The dead agent's area first, then the crowd: wherever the directory
  // lists it, the search must reach it.
  const fs::path record = base / "dead-area";
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    try {
      auto* area = new SnapshotArea(base.path().string(), "job", "node-dead");  // never destroyed
      std::ofstream(record) << area->root().string();
    } catch (...) {
      std::_Exit(3);
    }
    std::_Exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  std::ifstream in(record);
  const fs::path dead{std::string(std::istreambuf_iterator<char>(in), {})};
  REQUIRE(fs::is_directory(dead));
  for (int i = 0; i < 150006; ++i) {
    const std::string name = (base / ("other-" + std::to_string(i))).string();
    const int fd = ::open(name.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    ::close(fd);
  }
  SnapshotArea next(base.path().string(), "job", "node-next");
  CHECK(next.removed_stale() == std::vector<fs::path>{dead});
  CHECK(next.stale_search_complete());
  CHECK_FALSE(fs::exists(dead));
}
