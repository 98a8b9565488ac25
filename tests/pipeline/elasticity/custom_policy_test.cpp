// samples/custom_policy end to end: install ductile to a temporary prefix,
// build the out-of-tree "pow2" policy against the installed SDK, and use it
// without a word of it in the project: listed and checked by the installed
// CLI, selected by name from TOML (found through [plugins] path or
// --plugin-path) and DeepSpeed JSON, from Python, and by `ductile agent`,
// whose workers' scheduler contract (every key of the policy's schema)
// holds.
#include <doctest/doctest.h>

#include <sstream>

#include <nlohmann/json.hpp>

#include "process.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using json = nlohmann::json;
using ductile::test::run_process;

TEST_CASE("an out-of-tree elasticity policy builds against the installed SDK and runs") {
  ductile::test::TempDir tmp;
  const fs::path prefix = tmp / "prefix";
  const fs::path build = tmp / "build";
  auto install = run_process(
      {CMAKE_COMMAND_PATH, "--install", DUCTILE_BINARY_DIR, "--prefix", prefix.string()});
  REQUIRE_MESSAGE(install.exit_code == 0, install.out << install.err);
  CHECK(fs::exists(prefix / "include/ductile/elasticity_policy.hpp"));

  auto configure = run_process(
      {CMAKE_COMMAND_PATH, "-S", DUCTILE_SOURCE_DIR "/samples/custom_policy", "-B", build.string(),
       "-DCMAKE_PREFIX_PATH=" + prefix.string(), "-DCMAKE_CXX_COMPILER=" CXX_COMPILER_PATH});
  REQUIRE_MESSAGE(configure.exit_code == 0, configure.out << configure.err);
  auto compile = run_process({CMAKE_COMMAND_PATH, "--build", build.string()});
  REQUIRE_MESSAGE(compile.exit_code == 0, compile.out << compile.err);
  REQUIRE(fs::exists(build / "libductile_elasticity_pow2.so"));

  const std::string cli = (prefix / "bin/ductile").string();
  const std::vector<std::string> env = {"DUCTILE_ELASTICITY_CONFIG=",
                                        "DEEPSPEED_ELASTICITY_CONFIG="};
  // Selected by name from TOML, found through [plugins] path (relative to the file).
  auto job = tmp.write("job.toml",
                       "[plugins]\npath = [\"build\"]\n[elasticity]\npolicy = \"pow2\"\n"
                       "max_train_batch_size = 1000\nmicro_batch_size = 4\n"
                       "min_gpus = 2\nmax_gpus = 64\n");
  auto plan = run_process({cli, "elastic", "--config", job.string(), "--json"}, env);
  REQUIRE_MESSAGE(plan.exit_code == 0, plan.out << plan.err);
  json out = json::parse(plan.out);
  CHECK(out["policy"] == "pow2");
  const auto batch = out["final_batch_size"].get<std::int64_t>();
  CHECK(batch <= 1000);
  REQUIRE(out["valid_gpus"].size() >= 2);
  for (const auto& g : out["valid_gpus"]) {
    auto n = g.get<std::int64_t>();
    CHECK((n & (n - 1)) == 0);  // a power of two
    CHECK(n >= 2);
    CHECK(batch % (4 * n) == 0);
  }

  auto at16 =
      run_process({cli, "elastic", "--config", job.string(), "--world-size", "16", "--json"}, env);
  REQUIRE_MESSAGE(at16.exit_code == 0, at16.err);
  json r = json::parse(at16.out);
  CHECK(r["micro_batch_size"] == 4);
  CHECK(r["gradient_accumulation_steps"].get<std::int64_t>() * 4 * 16 == batch);

  auto at12 =
      run_process({cli, "elastic", "--config", job.string(), "--world-size", "12", "--json"}, env);
  CHECK(at12.exit_code == 2);
  CHECK(json::parse(at12.out)["error"]["type"] == "ElasticityIncompatibleWorldSize");

  // The same policy found through --plugin-path instead.
  auto plain = tmp.write("plain.toml",
                         "[elasticity]\npolicy = \"pow2\"\nmax_train_batch_size = 1000\n"
                         "micro_batch_size = 4\nmax_gpus = 8\n");
  auto via_flag = run_process(
      {cli, "--plugin-path", build.string(), "elastic", "--config", plain.string(), "--json"}, env);
  REQUIRE_MESSAGE(via_flag.exit_code == 0, via_flag.err);
  CHECK(json::parse(via_flag.out)["valid_gpus"] == json::array({1, 2, 4, 8}));

  // And from a DeepSpeed JSON config naming it with ductile's "policy" key:
  // DeepSpeed keys the policy does not know are dropped with a warning.
  auto ds = tmp.write("ds.json", R"({"elasticity": {"enabled": true, "policy": "pow2",
      "max_train_batch_size": 1000, "max_gpus": 8, "min_time": 20}})");
  auto from_json = run_process(
      {cli, "--plugin-path", build.string(), "elastic", "--config", ds.string(), "--json"}, env);
  REQUIRE_MESSAGE(from_json.exit_code == 0, from_json.out << from_json.err);
  CHECK(json::parse(from_json.out)["valid_gpus"] == json::array({1, 2, 4, 8}));
  CHECK(from_json.err.find("has no parameter 'min_time'") != std::string::npos);

  // Listed and checked like a built-in policy, errors at the key.
  auto listed = run_process({cli, "--plugin-path", build.string(), "plugins", "list"}, env);
  CHECK_MESSAGE(listed.exit_code == 0, listed.err);
  CHECK(listed.out.find("pow2") != std::string::npos);
  auto checked =
      run_process({cli, "--plugin-path", build.string(), "config", "check", plain.string()}, env);
  CHECK_MESSAGE(checked.exit_code == 0, checked.err);
  CHECK(checked.out.find("[elasticity] elasticity plugin 'pow2'") != std::string::npos);
  auto bad = tmp.write("bad.toml",
                       "[elasticity]\npolicy = \"pow2\"\nmax_train_batch_size = 1000\n"
                       "micro_batch_size = 0\n");
  auto refused =
      run_process({cli, "--plugin-path", build.string(), "config", "check", bad.string()}, env);
  CHECK(refused.exit_code == 2);
  CHECK_MESSAGE(refused.err.find(bad.string() + ":4:20: [elasticity] micro_batch_size = 0 is out "
                                                "of range") != std::string::npos,
                refused.err);

  // Run by `ductile agent` (one node, two workers on its own rendezvous):
  // the workers get the policy's plan and its scheduler contract.
  std::vector<std::string> agent_env = env;
  agent_env.push_back("DUCTILE_PLUGIN_PATH=" + build.string());
  auto agent = run_process(
      {cli, "agent", "--config", plain.string(), "--standalone", "--nproc-per-node", "2",
       "--monitor-interval", "0.05", "--no-python", "/bin/sh", "-c",
       "[ \"$RANK\" = 0 ] && printf 'plan %s %s %s\\ncontract %s\\n' \"$WORLD_SIZE\" "
       "\"$DUCTILE_GLOBAL_BATCH\" \"$DUCTILE_MICRO_BATCH\" \"$DEEPSPEED_ELASTICITY_CONFIG\"; "
       "exit 0"},
      agent_env);
  REQUIRE_MESSAGE(agent.exit_code == 0, agent.out << agent.err);
  const std::string both = agent.out + agent.err;
  const auto batch8 = json::parse(via_flag.out)["final_batch_size"].get<std::int64_t>();
  CHECK_MESSAGE(both.find("plan 2 " + std::to_string(batch8) + " 4") != std::string::npos, both);
  const auto at = both.find("contract ");
  REQUIRE_MESSAGE(at != std::string::npos, both);
  const std::string contract = both.substr(at + 9, both.find('\n', at) - at - 9);
  CHECK(json::parse(contract)["policy"] == "pow2");

#ifdef DUCTILE_PYTHON
  // From Python: the same plan, and the agent's contract holds.
  std::vector<std::string> py_env = agent_env;
  py_env.push_back("PYTHONPATH=" DUCTILE_BINARY_DIR "/python");
  std::istringstream sanitizer(DUCTILE_PYTHON_ENV);
  for (std::string entry; std::getline(sanitizer, entry, '|');)
    if (!entry.empty()) py_env.push_back(entry);
  auto with_contract = [&](const std::string& text) {
    auto out = py_env;
    std::erase_if(
        out, [](const std::string& e) { return e.starts_with("DEEPSPEED_ELASTICITY_CONFIG="); });
    out.push_back("DEEPSPEED_ELASTICITY_CONFIG=" + text);
    return out;
  };
  auto python =
      run_process({DUCTILE_PYTHON, "-c",
                   "import sys, ductile.elasticity as e\n"
                   "p = e.load(sys.argv[1])\n"
                   "r = p.compute(world_size=2)\n"
                   "print(p.name, r.final_batch_size, r.micro_batch_size, p.check_scheduler())\n",
                   plain.string()},
                  with_contract(contract));
  REQUIRE_MESSAGE(python.exit_code == 0, python.out << python.err);
  CHECK(python.out == "pow2 " + std::to_string(batch8) + " 4 True\n");
  // A contract that differs in a key only the policy knows is refused.
  const std::string other =
      R"({"enabled": true, "policy": "pow2", )"
      R"("max_train_batch_size": 1000, "micro_batch_size": 2, "max_gpus": 8})";
  auto differs = run_process({DUCTILE_PYTHON, "-c",
                              "import sys, ductile.elasticity as e\n"
                              "e.load(sys.argv[1]).check_scheduler()\n",
                              plain.string()},
                             with_contract(other));
  CHECK(differs.exit_code != 0);
  CHECK_MESSAGE(differs.err.find("'micro_batch_size=2' seen by the resource scheduler does not "
                                 "match 'micro_batch_size=4'") != std::string::npos,
                differs.err);
#endif
}
