// `ductile elastic` run as a subprocess: DeepSpeed's unit cases through the
// CLI with --json (results and exit code 2 with the error type), TOML
// configs, argument errors, the scheduler contract, human output and demo.
#include <doctest/doctest.h>

#include <chrono>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "process.hpp"
#include "temp_dir.hpp"

using json = nlohmann::json;
using ductile::test::run_process;

namespace {

// The environment without the scheduler variables (an outer job might set them).
const std::vector<std::string> kNoScheduler = {"DEEPSPEED_ELASTICITY_CONFIG=",
                                               "DUCTILE_ELASTICITY_CONFIG="};

ductile::test::ProcessResult elastic(const std::vector<std::string>& args,
                                     const std::vector<std::string>& env = {}) {
  std::vector<std::string> argv = {DUCTILE_CLI, "elastic"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(argv, env);
}

std::string ours_for(const std::string& deepspeed_error) {
  static const std::map<std::string, std::string> mapping = {
      {"ValueError", "ElasticityConfigError"},
      {"TypeError", "ElasticityError"},
      {"ZeroDivisionError", "ElasticityError"},
      {"AssertionError", "ElasticityError"}};
  auto it = mapping.find(deepspeed_error);
  return it == mapping.end() ? deepspeed_error : it->second;
}

}  // namespace

TEST_CASE("ductile elastic --json on every DeepSpeed unit case") {
  ductile::test::TempDir dir;
  std::ifstream in(DUCTILE_TEST_DATA_DIR "/reference/elastic_deepspeed_unit_cases.jsonl");
  REQUIRE(in.good());
  std::string line;
  int cases = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    ++cases;
    json vector = json::parse(line);
    CAPTURE(line);
    auto file = dir.write("case" + std::to_string(cases) + ".json", vector["ds_config"].dump());
    std::vector<std::string> args = {"--config", file.string(), "--json"};
    const auto world_size = vector["world_size"].get<std::int64_t>();
    if (world_size > 0) {
      args.push_back("--world-size");
      args.push_back(std::to_string(world_size));
    }
    auto run = elastic(args, kNoScheduler);
    const json& expect = vector["expect"];
    json out = json::parse(run.out, nullptr, false);
    REQUIRE_MESSAGE(!out.is_discarded(), "stdout is not one JSON object: " << run.out << run.err);
    if (expect.contains("error")) {
      CHECK(run.exit_code == 2);
      REQUIRE(out.contains("error"));
      CHECK(out["error"]["type"] == ours_for(expect["error"].get<std::string>()));
      CHECK_FALSE(out["error"]["message"].get<std::string>().empty());
    } else {
      CHECK_MESSAGE(run.exit_code == 0, run.err);
      CHECK(out["final_batch_size"] == expect["final_batch_size"]);
      CHECK(out["valid_gpus"] == expect["valid_gpus"]);
      if (world_size > 0) {
        CHECK(out["micro_batch_size"] == expect["micro_batch_size"]);
        CHECK(out["gradient_accumulation_steps"].get<std::int64_t>() *
                  out["micro_batch_size"].get<std::int64_t>() * world_size ==
              out["final_batch_size"].get<std::int64_t>());
      } else {
        CHECK(out["micro_batch_size"].is_null());
        CHECK(out["gradient_accumulation_steps"].is_null());
      }
      CHECK(out["fallback"] == false);
    }
  }
  CHECK(cases > 10);
}

TEST_CASE("ductile elastic on TOML: policy by name, fallback reported, argument errors") {
  ductile::test::TempDir dir;
  auto toml = dir.write("job.toml",
                        "[elasticity]\npolicy = \"v0.2\"\nmax_train_batch_size = 89402\n"
                        "micro_batch_sizes = [8]\nmin_gpus = 2\nnum_gpus_per_node = 4\n");
  auto run = elastic({"--config", toml.string(), "--world-size", "156", "--json"}, kNoScheduler);
  REQUIRE_MESSAGE(run.exit_code == 0, run.err);
  json out = json::parse(run.out);
  CHECK(out["policy"] == "v0.2");
  CHECK(out["fallback"] == true);
  CHECK(out["warnings"].size() == 1);
  CHECK(out["valid_gpus"] == json::array({156}));
  CHECK(run.err.find("falling back") != std::string::npos);  // also logged

  auto optimal = dir.write("optimal.toml",
                           "[elasticity]\npolicy = \"optimal\"\n"
                           "max_train_batch_size = 10000\n"
                           "micro_batch_sizes = [8, 12, 16, 17]\nmin_gpus = 32\n"
                           "max_gpus = 1500\n");
  auto opt = elastic({"--config", optimal.string(), "--json"}, kNoScheduler);
  REQUIRE_MESSAGE(opt.exit_code == 0, opt.err);
  json o = json::parse(opt.out);
  CHECK(o["policy"] == "optimal");
  CHECK(o["micro_batch_size"].is_null());
  CHECK(o["valid_gpus"].size() >= 23);  // DeepSpeed v0.1 finds 23 on these settings

  auto zero = elastic({"--config", optimal.string(), "--world-size", "0", "--json"}, kNoScheduler);
  CHECK(zero.exit_code == 2);
  CHECK(json::parse(zero.out)["error"]["type"] == "ElasticityError");

  auto micro = elastic({"--config", optimal.string(), "--micro-batch", "--json"}, kNoScheduler);
  CHECK(micro.exit_code == 2);
  CHECK(json::parse(micro.out)["error"]["type"] == "ElasticityError");

  auto bad = dir.write("bad.toml",
                       "[elasticity]\npolicy = \"v0.1\"\nmax_train_batch_size = 100\n"
                       "micro_batch_sizes = [4]\nmin_gpus = 0\n");
  auto rejected = elastic({"--config", bad.string(), "--json"}, kNoScheduler);
  CHECK(rejected.exit_code == 2);
  json r = json::parse(rejected.out);
  CHECK(r["error"]["type"] == "ElasticityConfigError");
  CHECK(r["error"]["message"].get<std::string>().find("min_gpus = 0") != std::string::npos);

  auto missing = elastic({"--config", (dir / "nope.toml").string(), "--json"}, kNoScheduler);
  CHECK(missing.exit_code == 2);
  CHECK(json::parse(missing.out).contains("error"));
}

TEST_CASE("ductile elastic: human output like ds_elastic, scheduler contract") {
  ductile::test::TempDir dir;
  auto file =
      dir.write("ds.json", R"({"elasticity": {"enabled": true, "max_train_batch_size": 10000,
      "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32, "max_gpus": 1500, "version": 0.1}})");
  auto human = elastic({"--config", file.string(), "--world-size", "64"}, kNoScheduler);
  REQUIRE_MESSAGE(human.exit_code == 0, human.err);
  CHECK(human.out.find("Calculated results for world size 64:") != std::string::npos);
  CHECK(human.out.find("final_batch_size .... 9792") != std::string::npos);
  CHECK(human.out.find("micro_batch_size .... 17") != std::string::npos);
  CHECK(human.err.find("DEEPSPEED_ELASTICITY_CONFIG") != std::string::npos);  // unset: warned

  auto same = elastic({"--config", file.string(), "--json"},
                      {"DEEPSPEED_ELASTICITY_CONFIG={\"enabled\": true, \"max_train_batch_size\": "
                       "10000, \"micro_batch_sizes\": [8, 12, 16, 17], \"min_gpus\": 32, "
                       "\"max_gpus\": 1500, \"version\": 0.1}"});
  CHECK_MESSAGE(same.exit_code == 0, same.out << same.err);
  CHECK(same.err.find("DEEPSPEED_ELASTICITY_CONFIG") == std::string::npos);

  auto differs = elastic({"--config", file.string(), "--json"},
                         {"DUCTILE_ELASTICITY_CONFIG=version = 0.1\nmax_train_batch_size = 2000\n"
                          "micro_batch_sizes = [8, 12, 16, 17]\nmin_gpus = 32\nmax_gpus = 1500\n"});
  CHECK(differs.exit_code == 2);
  json e = json::parse(differs.out);
  CHECK(e["error"]["type"] == "ElasticityConfigError");
  std::string message = e["error"]["message"];
  CHECK(message.find("max_train_batch_size=2000") != std::string::npos);
  CHECK(message.find("max_train_batch_size=10000") != std::string::npos);
}

TEST_CASE("ductile demo shows the elastic plan for a few world sizes") {
  ductile::test::TempDir dir;
  auto config = dir.write("demo.toml",
                          "[elasticity]\npolicy = \"v0.1\"\nmax_train_batch_size = 10000\n"
                          "micro_batch_sizes = [8, 12, 16, 17]\nmin_gpus = 32\n"
                          "max_gpus = 1500\n");
  auto run = run_process({DUCTILE_CLI, "demo", "--config", config.string()}, kNoScheduler);
  REQUIRE_MESSAGE(run.exit_code == 0, run.err);
  CHECK(run.out.find("-- elasticity: policy 'v0.1' --") != std::string::npos);
  CHECK(run.out.find("world size    32: batch 9792") != std::string::npos);
  CHECK(run.out.find("world size    33: rejected (ElasticityIncompatibleWorldSize)") !=
        std::string::npos);
  CHECK(run.out.find("optimal policy on the same settings") != std::string::npos);
}

TEST_CASE("a long micro_batch_sizes is refused at once, naming the key, the count and the cap") {
  ductile::test::TempDir dir;
  // 300,000 distinct entries (2 MB, well under the configuration file cap):
  // the searches are quadratic and more in the list, so it is refused by its
  // length, by `config check` as by `ductile elastic`, before any search.
  std::string toml =
      "[elasticity]\npolicy = \"v0.1\"\nmax_train_batch_size = 4096\n"
      "micro_batch_sizes = [";
  for (int i = 1; i <= 300000; ++i) toml += (i > 1 ? ", " : "") + std::to_string(i);
  auto file = dir.write("long.toml", toml + "]\n");
  const std::string expected = "micro_batch_sizes has 300000 entries, more than the 1024 accepted";
  for (const char* command : {"config", "elastic"}) {
    CAPTURE(command);
    std::vector<std::string> argv = {DUCTILE_CLI, command};
    if (std::string(command) == "config")
      argv.insert(argv.end(), {"check", file.string()});
    else
      argv.insert(argv.end(), {"--config", file.string()});
    const auto start = std::chrono::steady_clock::now();
    auto run = run_process(argv, kNoScheduler);
    const auto seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    CHECK(run.exit_code == 2);
    CHECK_MESSAGE(run.err.find(expected) != std::string::npos, run.err);
    // Refused in well under a second here; the search it replaces ran for
    // minutes, so the bound has a wide margin for a loaded machine.
    CHECK(seconds < 10.0);
  }
  // config check points at the key in the file.
  auto check = run_process({DUCTILE_CLI, "config", "check", file.string()}, kNoScheduler);
  CHECK_MESSAGE(check.err.find(file.string() + ":4:") != std::string::npos, check.err);
}

TEST_CASE("ductile elastic names its own option for a world size a policy needs") {
  ductile::test::TempDir dir;
  auto file = dir.write("v02.toml",
                        "[elasticity]\npolicy = \"v0.2\"\nmax_train_batch_size = 2000\n"
                        "micro_batch_sizes = [2, 4, 6]\n");
  auto run = elastic({"--config", file.string()}, kNoScheduler);
  CHECK(run.exit_code == 2);
  CHECK_MESSAGE(run.err.find("no world size was given") != std::string::npos, run.err);
  CHECK_MESSAGE(run.err.find("pass --world-size N") != std::string::npos, run.err);
  auto given = elastic({"--config", file.string(), "--world-size", "4", "--json"}, kNoScheduler);
  CHECK_MESSAGE(given.exit_code == 0, given.err);
}

TEST_CASE("max_train_batch_size out of range: one ElasticityConfigError, TOML and JSON alike") {
  ductile::test::TempDir dir;
  struct Case {
    std::string value, says;
  };
  const std::vector<Case> cases = {
      {"0", "max_train_batch_size = 0 is invalid: must be >= 1"},
      {"4611686018427387905",
       "max_train_batch_size = 4611686018427387905 is too large: must be <= 2^62 "
       "(4611686018427387904)"}};
  for (const char* policy : {"v0.1", "v0.2", "optimal"}) {
    for (const auto& c : cases) {
      CAPTURE(policy);
      CAPTURE(c.value);
      const auto toml = dir.write("cap.toml", std::string("[elasticity]\npolicy = \"") + policy +
                                                  "\"\nmax_train_batch_size = " + c.value +
                                                  "\nmicro_batch_sizes = [2, 4]\n");
      const auto deepspeed =
          dir.write("cap.json", std::string(R"({"elasticity": {"enabled": true, "policy": ")") +
                                    policy + R"(", "max_train_batch_size": )" + c.value +
                                    R"(, "micro_batch_sizes": [2, 4]}})");
      const std::string expected = std::string("elasticity (") + policy + "): " + c.says;
      for (const auto& file : {toml, deepspeed}) {
        auto run =
            elastic({"--config", file.string(), "--world-size", "8", "--json"}, kNoScheduler);
        CHECK(run.exit_code == 2);
        const json out = json::parse(run.out, nullptr, false);
        REQUIRE_MESSAGE(out.contains("error"), run.out << run.err);
        CHECK(out["error"]["type"] == "ElasticityConfigError");
        CHECK(out["error"]["message"] == expected);
      }
    }
  }
}
