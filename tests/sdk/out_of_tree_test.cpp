// A plugin author's path end to end: install ductile, build a plugin out of
// tree against the installed SDK, load it through the CLI and the embedding API.
#include <doctest/doctest.h>

#include "ductile/core/runtime.hpp"
#include "ductile/lr_scaling_rule.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using ductile::test::run_process;

TEST_CASE("a sample plugin builds against the installed SDK and loads through the CLI") {
  ductile::test::TempDir tmp;
  const fs::path prefix = tmp / "prefix";
  const fs::path build = tmp / "build";

  auto install = run_process(
      {CMAKE_COMMAND_PATH, "--install", DUCTILE_BINARY_DIR, "--prefix", prefix.string()});
  REQUIRE_MESSAGE(install.exit_code == 0, install.out << install.err);
  CHECK(fs::exists(prefix / "include/ductile/plugin.hpp"));
  CHECK(fs::exists(prefix / "lib/cmake/ductile/ductileConfig.cmake"));

  auto configure = run_process(
      {CMAKE_COMMAND_PATH, "-S", DUCTILE_SOURCE_DIR "/samples/power_lr_rule", "-B", build.string(),
       "-DCMAKE_PREFIX_PATH=" + prefix.string(), "-DCMAKE_CXX_COMPILER=" CXX_COMPILER_PATH,
       "-DCMAKE_CXX_FLAGS=" OUT_OF_TREE_CXX_FLAGS});
  REQUIRE_MESSAGE(configure.exit_code == 0, configure.out << configure.err);
  auto compile = run_process({CMAKE_COMMAND_PATH, "--build", build.string()});
  REQUIRE_MESSAGE(compile.exit_code == 0, compile.out << compile.err);
  const fs::path plugin = build / "libductile_lr_power.so";
  REQUIRE(fs::exists(plugin));

  // Only the entry symbol is exported.
  auto symbols = run_process({"nm", "-D", "--defined-only", plugin.string()});
  REQUIRE(symbols.exit_code == 0);
  CHECK(symbols.out.find("ductile_plugin_entry") != std::string::npos);
  CHECK(symbols.out.find("PowerRule") == std::string::npos);

  const std::string cli = (prefix / "bin/ductile").string();
  std::vector<std::string> env = {"DUCTILE_PLUGIN_PATH=" + build.string()};
  auto describe = run_process({cli, "plugins", "describe", "power"}, env);
  CHECK_MESSAGE(describe.exit_code == 0, describe.err);
  CHECK(describe.out.find("exponent (float, default 0.5, [0, 2])") != std::string::npos);

  auto job = tmp.write("job.toml",
                       "[plugins]\npath = [\"build\"]\n[lr]\nrule = \"power\"\n"
                       "exponent = 0.75\n");
  // `config check` runs a plugin from the file's own [plugins] path only
  // when told to.
  auto unsearched = run_process({cli, "config", "check", job.string()});
  CHECK(unsearched.exit_code == 2);
  CHECK(unsearched.err.find("--allow-config-plugins") != std::string::npos);
  auto check = run_process({cli, "config", "check", "--allow-config-plugins", job.string()});
  CHECK_MESSAGE(check.exit_code == 0, check.err);
  auto bad = tmp.write("bad.toml",
                       "[plugins]\npath = [\"build\"]\n[lr]\nrule = \"power\"\n"
                       "exponent = 3.0\n");
  auto rejected = run_process({cli, "config", "check", "--allow-config-plugins", bad.string()});
  CHECK(rejected.exit_code == 2);
  CHECK(rejected.err.find(":5:12: [lr] exponent = 3.0 is out of range: must be between 0 and 2") !=
        std::string::npos);

  // The same file through the embedding API: the rule computes.
  auto runtime = ductile::core::Runtime::from_file(job);
  auto rule = runtime.get<ductile::LrScalingRule>();
  CHECK(rule->scale(0.1, 64, 16) == doctest::Approx(0.1 * std::pow(4.0, 0.75)));
  CHECK_THROWS_AS(rule->scale(0.1, 64, 0), ductile::Error);

  // A program embedding the installed core, built out of tree too.
  const fs::path embed_build = tmp / "embed";
  auto embed_configure = run_process(
      {CMAKE_COMMAND_PATH, "-S", DUCTILE_SOURCE_DIR "/samples/embedding", "-B",
       embed_build.string(), "-DCMAKE_PREFIX_PATH=" + prefix.string(),
       "-DCMAKE_CXX_COMPILER=" CXX_COMPILER_PATH, "-DCMAKE_CXX_FLAGS=" OUT_OF_TREE_CXX_FLAGS});
  REQUIRE_MESSAGE(embed_configure.exit_code == 0, embed_configure.out << embed_configure.err);
  auto embed_compile = run_process({CMAKE_COMMAND_PATH, "--build", embed_build.string()});
  REQUIRE_MESSAGE(embed_compile.exit_code == 0, embed_compile.out << embed_compile.err);
  auto embedded = run_process({(embed_build / "embed").string(), job.string(), "0.1", "16", "64"});
  CHECK_MESSAGE(embedded.exit_code == 0, embedded.err);
  double scaled = std::stod(embedded.out.substr(embedded.out.find(' ') + 1));
  CHECK(scaled == doctest::Approx(0.1 * std::pow(4.0, 0.75)));
  auto embedded_bad =
      run_process({(embed_build / "embed").string(), bad.string(), "0.1", "16", "64"});
  CHECK(embedded_bad.exit_code == 2);
}
