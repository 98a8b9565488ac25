// The host side of elasticity: DeepSpeed JSON -> policy and parameters,
// TOML and JSON files loaded into a policy, and the scheduler contract.
#include <doctest/doctest.h>

#include <cstdlib>

#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "temp_dir.hpp"

using namespace ductile;
using pipeline::elasticity_from_deepspeed_json;

namespace {

std::string error_of(const std::string& json_text) {
  try {
    elasticity_from_deepspeed_json(json_text, "ds.json");
  } catch (const Error& e) {
    CHECK(e.type() == "ElasticityConfigError");
    CHECK(e.kind() == ErrorKind::config);
    return e.what();
  }
  return "no error";
}

// Unsets the scheduler variables around a test.
struct SchedulerEnv {
  SchedulerEnv() { clear(); }
  ~SchedulerEnv() { clear(); }
  static void clear() {
    unsetenv(pipeline::kDeepSpeedElasticityConfigEnv);
    unsetenv(pipeline::kDuctileElasticityConfigEnv);
  }
};

pipeline::ElasticityFingerprint runtime_fingerprint() {
  auto s = elasticity_from_deepspeed_json(
      R"({"elasticity": {"enabled": true, "max_train_batch_size": 2000,
          "micro_batch_sizes": [2, 4, 6], "max_gpus": 64, "version": 0.1}})",
      "runtime.json");
  return pipeline::fingerprint_of(s.policy, s.params);
}

}  // namespace

TEST_CASE("DeepSpeed JSON maps to a policy with DeepSpeed's keys and defaults") {
  auto whole = elasticity_from_deepspeed_json(
      R"({"train_batch_size": 8, "elasticity": {"enabled": true, "max_train_batch_size": 100,
          "micro_batch_sizes": [2, 4], "version": 0.1, "min_gpus": 2.0}})",
      "ds.json");
  CHECK(whole.policy == "v0.1");
  CHECK(whole.deepspeed_json);
  CHECK(whole.params.get_int("max_train_batch_size") == 100);
  CHECK(whole.params.get_int_list("micro_batch_sizes") == std::vector<std::int64_t>{2, 4});
  CHECK(whole.params.get_int("min_gpus") == 2);
  CHECK(whole.params.get_bool("enabled"));

  // A bare block; no version means DeepSpeed's latest (0.2); enabled defaults to false.
  auto bare = elasticity_from_deepspeed_json(R"({"max_train_batch_size": 100})", "env");
  CHECK(bare.policy == "v0.2");
  CHECK_FALSE(bare.params.get_bool("enabled"));

  CHECK(elasticity_from_deepspeed_json(R"({"elasticity": {"version": "0.1"}})", "x").policy ==
        "v0.1");
  CHECK(elasticity_from_deepspeed_json(R"({"elasticity": {"policy": "optimal"}})", "x").policy ==
        "optimal");
  auto unknown = elasticity_from_deepspeed_json(R"({"elasticity": {"min_gpu": 3}})", "x");
  REQUIRE(unknown.warnings.size() == 1);
  CHECK(unknown.warnings[0].find("did you mean 'min_gpus'") != std::string::npos);
}

TEST_CASE("DeepSpeed JSON errors are ElasticityConfigError naming key and value") {
  CHECK(error_of(R"({"elasticity": {"version": 0.3}})").find("0.3") != std::string::npos);
  CHECK(error_of(R"({"elasticity": {"version": 0.15}})").find("unknown elasticity version 0.15") !=
        std::string::npos);
  CHECK(error_of(R"({"elasticity": {"micro_batch_sizes": 5}})").find("micro_batch_sizes") !=
        std::string::npos);
  auto mixed = error_of(R"({"elasticity": {"micro_batch_sizes": ["a", null, 0.5]}})");
  CHECK(mixed.find("[\"a\",null,0.5]") != std::string::npos);
  CHECK(error_of(R"({"elasticity": {"micro_batch_sizes": [2, 0.5, 4]}})").find("0.5") !=
        std::string::npos);
  CHECK(error_of(R"({"elasticity": {"min_gpus": "two"}})")
            .find("min_gpus must be an integer, got \"two\"") != std::string::npos);
  CHECK(error_of(R"({"elasticity": {"prefer_larger_batch": 1}})").find("prefer_larger_batch") !=
        std::string::npos);
  CHECK(error_of(R"({"elasticity": {"max_train_batch_size": 1e30}})").find("1e+30") !=
        std::string::npos);
  CHECK(error_of(R"({"train_batch_size": 8})").find("'elasticity' is missing") !=
        std::string::npos);
  CHECK(error_of(R"({"elasticity": 3})").find("'elasticity' must be an object") !=
        std::string::npos);
  CHECK(error_of("{\"elasticity\": ").find("invalid JSON") != std::string::npos);
  CHECK(error_of(R"({"elasticity": {"version": 0.2, "policy": "v0.1"}})").find("contradicts") !=
        std::string::npos);
}

TEST_CASE("files are read as JSON or TOML by extension, else by content") {
  CHECK(pipeline::is_json_config("a.json", "x = 1"));
  CHECK_FALSE(pipeline::is_json_config("a.toml", "{"));
  CHECK(pipeline::is_json_config("a.conf", "  \n{\"elasticity\": {}}"));
  CHECK_FALSE(pipeline::is_json_config("a.conf", "[elasticity]\n"));

  test::TempDir dir;
  auto json_file = dir.write("ds_config", R"({"elasticity": {"enabled": true,
      "max_train_batch_size": 100, "micro_batch_sizes": [2, 4], "version": 0.1}})");
  auto from_json = pipeline::load_elasticity(json_file);
  CHECK(from_json.source.policy == "v0.1");
  CHECK(from_json.effective_params.get_int("max_gpus") == 10000);  // default filled in
  auto json_plan = from_json.policy->compute({});
  auto toml_file = dir.write("job.toml",
                             "[elasticity]\nversion = 0.1\nmax_train_batch_size = 100\n"
                             "micro_batch_sizes = [2, 4]\n");
  auto from_toml = pipeline::load_elasticity(toml_file);
  CHECK(from_toml.source.policy == "v0.1");
  auto toml_plan = from_toml.policy->compute({});
  CHECK(toml_plan.final_batch_size == json_plan.final_batch_size);
  CHECK(toml_plan.valid_gpus == json_plan.valid_gpus);

  auto no_section = dir.write("none.toml", "[log]\nlevel = \"warn\"\n");
  try {
    pipeline::load_elasticity(no_section);
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.type() == "ElasticityConfigError");
    CHECK(std::string(e.what()).find("no [elasticity] section") != std::string::npos);
  }
}

TEST_CASE("the core validates DeepSpeed's version key with the pipeline's one mapping") {
  // The pipeline registers [elasticity] version as a selector alias when its
  // library loads; the core only looks it up.
  auto errors_of = [](std::string_view text) -> std::string {
    try {
      core::Runtime::from_string(text, "job.toml");
    } catch (const core::ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  auto selected = [](std::string_view text) {
    auto runtime = core::Runtime::from_string(text, "job.toml");
    return runtime.config().section(PluginKind::elasticity)->plugin;
  };
  CHECK(selected("[elasticity]\nversion = 0.1\nmax_train_batch_size = 100\n"
                 "micro_batch_sizes = [2]\n") == "v0.1");
  CHECK(selected("[elasticity]\nversion = \"0.2\"\nmax_train_batch_size = 100\n"
                 "micro_batch_sizes = [2]\n") == "v0.2");
  // A file may keep DeepSpeed's version while naming another policy.
  CHECK(selected("[elasticity]\npolicy = \"optimal\"\nversion = 0.1\n"
                 "max_train_batch_size = 100\nmicro_batch_sizes = [2]\n") == "optimal");
  CHECK(errors_of("[elasticity]\nversion = 0.15\n") ==
        "job.toml:2:11: [elasticity] version: unknown elasticity version 0.15; valid versions: "
        "0.1, 0.2");
  CHECK(errors_of("[elasticity]\nversion = 0.3\n") ==
        "job.toml:2:11: [elasticity] version: attempting to run elasticity version 0.3 but "
        "ductile supports up to 0.2 (valid: 0.1, 0.2)");
  CHECK(errors_of("[elasticity]\npolicy = \"v0.2\"\nversion = 0.1\n") ==
        "job.toml:3:11: [elasticity] version = 0.1 contradicts policy = \"v0.2\"; give one of "
        "them");
  CHECK(errors_of("[elasticity]\nversion = [1]\n") ==
        "job.toml:2:11: [elasticity] version must be a number such as 0.1 or 0.2, got array [ 1 ]");
}

TEST_CASE(
    "scheduler contract: unset is a warning, equal passes, any difference names both values") {
  SchedulerEnv env;
  auto runtime = runtime_fingerprint();
  CHECK_FALSE(pipeline::check_scheduler_elasticity(runtime, nullptr));

  setenv(pipeline::kDeepSpeedElasticityConfigEnv,
         R"({"enabled": true, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
             "max_gpus": 64, "version": 0.1, "min_time": 30})",
         1);
  CHECK(pipeline::check_scheduler_elasticity(runtime, nullptr));

  setenv(pipeline::kDeepSpeedElasticityConfigEnv,
         R"({"elasticity": {"enabled": true, "max_train_batch_size": 4000,
             "micro_batch_sizes": [2, 4], "max_gpus": 64, "num_gpus_per_node": 8}})",
         1);
  try {
    pipeline::check_scheduler_elasticity(runtime, nullptr);
    FAIL("expected a mismatch");
  } catch (const Error& e) {
    std::string m = e.what();
    CHECK(e.type() == "ElasticityConfigError");
    CHECK(m.find("'max_train_batch_size=4000' seen by the resource scheduler does not match "
                 "'max_train_batch_size=2000'") != std::string::npos);
    CHECK(m.find("'micro_batch_sizes=[2, 4]'") != std::string::npos);
    CHECK(m.find("'micro_batch_sizes=[2, 4, 6]'") != std::string::npos);
    CHECK(m.find("'num_gpus_per_node=8'") != std::string::npos);
    CHECK(m.find("'policy=v0.2'") != std::string::npos);  // no version: DeepSpeed's 0.2
    CHECK(m.find("max_gpus") == std::string::npos);       // equal fields are not reported
  }

  SchedulerEnv::clear();
  setenv(pipeline::kDuctileElasticityConfigEnv,
         "[elasticity]\npolicy = \"v0.1\"\nmax_train_batch_size = 2000\n"
         "micro_batch_sizes = [2, 4, 6]\nmax_gpus = 64\nprefer_larger_batch = false\n",
         1);
  try {
    pipeline::check_scheduler_elasticity(runtime, nullptr);
    FAIL("expected a mismatch");
  } catch (const Error& e) {
    std::string m = e.what();
    CHECK(m.find("DUCTILE_ELASTICITY_CONFIG") != std::string::npos);
    CHECK(m.find("'prefer_larger_batch=false'") != std::string::npos);
    CHECK(m.find("'prefer_larger_batch=true'") != std::string::npos);
  }
  setenv(pipeline::kDuctileElasticityConfigEnv,
         "version = 0.1\nmax_train_batch_size = 2000\n"
         "micro_batch_sizes = [2, 4, 6]\nmax_gpus = 64\n",
         1);
  CHECK(pipeline::check_scheduler_elasticity(runtime, nullptr));
  setenv(pipeline::kDuctileElasticityConfigEnv, "max_train_batch_size = \"big\"\n", 1);
  CHECK_THROWS_WITH_AS(pipeline::check_scheduler_elasticity(runtime, nullptr),
                       doctest::Contains("max_train_batch_size must be an integer"), Error);
}
