// `ductile zero` as a subprocess: a single process (no launcher, no MPI), and
// 2 ranks under mpirun as ./run.sh runs it; user errors exit with code 2.
#include <doctest/doctest.h>

#include <string>

#include "process.hpp"
#include "temp_dir.hpp"

using ductile::test::run_process;
using ductile::test::TempDir;

namespace {

std::string config(const std::string& zero_keys) {
  return std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR + "\"]\n[zero]\n" + zero_keys;
}

std::size_t count_of(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

const char* kLimits =
    "prefetch_bucket_size = 100000\nmax_live_parameters = 200000\nmax_reuse_distance = 1e5\n"
    "param_persistence_threshold = 1000\n";

}  // namespace

TEST_CASE("ductile zero runs passes of the synthetic model and checks every gathered parameter") {
  TempDir dir;
  auto file = dir.write("zero.toml", config(kLimits));
  auto r = run_process(
      {DUCTILE_CLI, "zero", "--config", file.string(), "--steps", "3", "--blocks", "4"});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("(cpu backend, 1 ranks)") != std::string::npos);
  CHECK(r.out.find("pass 1: trace record") != std::string::npos);
  CHECK(r.out.find("pass 2: trace complete") != std::string::npos);
  CHECK(r.out.find("pass 3: trace complete") != std::string::npos);
  // forward + backward over embedding, 4 blocks and the head: 12 modules, 52 parameter uses
  CHECK(count_of(r.out, "params checked 52 ok") == 3);
  CHECK(r.out.find("limit 200000") != std::string::npos);
}

TEST_CASE("ductile zero on 2 ranks under mpirun, as ./run.sh runs it") {
  TempDir dir;
  auto file = dir.write("zero.toml", config(kLimits));
  auto r = run_process({MPIEXEC_PROGRAM, "--allow-run-as-root", "--oversubscribe", "--mca", "btl",
                        "self,vader", "-np", "2", DUCTILE_CLI, "zero", "--config", file.string(),
                        "--steps", "2", "--blocks", "3", "--compute-us", "50"},
                       {"ASAN_OPTIONS=detect_leaks=0"});
  INFO(r.out << r.err);
  CHECK(r.exit_code == 0);
  CHECK(count_of(r.out, "== ductile zero") == 1);  // rank 0 prints
  CHECK(r.out.find("(cpu backend, 2 ranks)") != std::string::npos);
  CHECK(count_of(r.out, "ok\n") == 2);
}

TEST_CASE("ductile zero reports bad [zero] values and options with exit code 2") {
  TempDir dir;
  {
    auto file = dir.write("bad.toml", config("max_live_parameters = 1.5\n"));
    auto r = run_process({DUCTILE_CLI, "zero", "--config", file.string()});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("max_live_parameters = 1.5: expected a whole number of elements") !=
          std::string::npos);
  }
  {
    auto file = dir.write("negative.toml", config("prefetch_bucket_size = -1\n"));
    auto r = run_process({DUCTILE_CLI, "zero", "--config", file.string()});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("prefetch_bucket_size") != std::string::npos);
  }
  {
    auto file = dir.write("typo.toml", config("max_live_parameter = 10\n"));
    auto r = run_process({DUCTILE_CLI, "zero", "--config", file.string()});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("max_live_parameter") != std::string::npos);
  }
  {
    auto file = dir.write("ok.toml", config(""));
    auto r = run_process({DUCTILE_CLI, "zero", "--config", file.string(), "--steps", "0"});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--steps 0: expected a number of passes from 1 to 1000") != std::string::npos);
  }
  {
    auto file = dir.write("nozero.toml",
                          std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR + "\"]\n");
    auto r = run_process({DUCTILE_CLI, "zero", "--config", file.string()});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("no [zero] section") != std::string::npos);
  }
}
