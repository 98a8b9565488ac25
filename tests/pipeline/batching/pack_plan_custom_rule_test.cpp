// Any installed lr plugin can be chosen wherever a rule is named: from
// DeepSpeed JSON (lr_scaling_method, with lr_scaling_params typed by the
// rule's own schema), from pack_plan options, and from the CLI. The rule here
// is a test fixture built as a real plugin library outside the built-in
// plugin directory.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "ductile/core/runtime.hpp"
#include "ductile/pipeline/deepspeed_batching.hpp"
#include "ductile/pipeline/pack_plan.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using nlohmann::json;
using namespace ductile;

namespace {

const std::string kFixtureDir = DUCTILE_PIPELINE_FIXTURE_DIR;

core::RuntimeOptions with_fixture() {
  core::RuntimeOptions options;
  options.extra_plugin_dirs = {kFixtureDir};
  return options;
}

core::PluginRegistry fixture_registry() {
  return core::PluginRegistry(core::PluginRegistry::default_search_path({kFixtureDir}), nullptr);
}

std::string ds_config(const std::string& dynamic_batching_extra) {
  return R"({"train_batch_size": 2, "optimizer": {"params": {"lr": 0.01}},
    "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": true,
      "max_tokens": 12, "metrics_path": "metrics", "lr_scaling_method": "fixture_power")" +
         dynamic_batching_extra + "}}}}";
}

std::string error_of(const std::string& text, const core::PluginRegistry& registry) {
  try {
    (void)pipeline::parse_deepspeed_batching(text, "ds.json", {}, registry);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::config);
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("a custom lr plugin is chosen from DeepSpeed JSON, with parameters its schema types") {
  const auto registry = fixture_registry();
  const auto ds = pipeline::parse_deepspeed_batching(
      ds_config(R"(, "lr_scaling_params": {"exponent": 2})"), "ds.json", "/run", registry);
  CHECK(ds.setup.options.lr_rule == "fixture_power");
  CHECK(ds.setup.options.lr_params.get_double("exponent") == 2.0);
  CHECK(ds.setup.options.base_batch_size == 2.0);

  // The rule computes every step's learning rate of the plan.
  auto runtime = core::Runtime::from_string("", "custom rule test", with_fixture());
  const auto& setup = ds.setup;
  CHECK(setup.lengths == std::filesystem::path("/run/metrics/seqlen/seqlen_sample_to_metric"));
  const std::vector<std::int64_t> lengths = {5, 5, 5, 2, 2, 2, 2, 2, 2, 11, 1, 1, 1, 1};
  const auto plan = pipeline::pack_plan(runtime, lengths, setup.options);
  REQUIRE(plan.lr_rule == std::optional<std::string>("fixture_power"));
  REQUIRE(plan.lrs.size() == plan.step_count());
  bool varied = false;
  for (std::size_t s = 0; s < plan.step_count(); ++s) {
    const double k = static_cast<double>(plan.batch_sizes[s]) / 2.0;
    CHECK(plan.lrs[s] == doctest::Approx(0.01 * k * k).epsilon(1e-12));
    varied = varied || plan.batch_sizes[s] != plan.batch_sizes[0];
  }
  CHECK(varied);  // the packing gives steps of different sizes, so the rule matters

  // Its default parameters when none are given, filled in as for a TOML [lr].
  const auto plain = pipeline::parse_deepspeed_batching(ds_config(""), "ds.json", {}, registry);
  CHECK(plain.setup.options.lr_params.get_double("exponent") == 1.0);
  const auto linear_like = pipeline::pack_plan(runtime, lengths, plain.setup.options);
  for (std::size_t s = 0; s < linear_like.step_count(); ++s)
    CHECK(linear_like.lrs[s] ==
          doctest::Approx(0.01 * static_cast<double>(linear_like.batch_sizes[s]) / 2.0));
}

TEST_CASE("DeepSpeed JSON rule errors name the key, the value and what is valid") {
  const auto registry = fixture_registry();
  CHECK(
      error_of(ds_config(R"(, "lr_scaling_params": {"exponent": 9})"), registry).find("exponent") !=
      std::string::npos);
  CHECK(error_of(ds_config(R"(, "lr_scaling_params": {"exponnt": 1})"), registry)
            .find("lr_scaling_params.exponnt is not a parameter of rule 'fixture_power'; "
                  "valid: exponent") != std::string::npos);
  CHECK(error_of(ds_config(R"(, "lr_scaling_params": {"exponent": "two"})"), registry)
            .find("lr_scaling_params.exponent must be a number, got \"two\"") != std::string::npos);
  CHECK(error_of(ds_config(R"(, "lr_scaling_params": [1])"), registry)
            .find("lr_scaling_params must be an object, got [1]") != std::string::npos);
  // Without the fixture on the search path the rule is not installed: the
  // message lists what is.
  const core::PluginRegistry builtin(core::PluginRegistry::default_search_path(), nullptr);
  CHECK(error_of(ds_config(""), builtin)
            .find("'fixture_power' is not valid; valid: linear, none, sqrt (or null)") !=
        std::string::npos);
}

TEST_CASE("the CLI chooses the custom rule by flag and from DeepSpeed JSON") {
  test::TempDir dir;
  const auto lengths = dir.write("lengths.txt", "5\n5\n5\n2\n2\n2\n2\n2\n2\n11\n1\n1\n1\n1\n");
  auto run = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {DUCTILE_CLI, "--plugin-path", kFixtureDir, "pack", "--json"};
    argv.insert(argv.end(), args.begin(), args.end());
    const auto r = test::run_process(argv);
    INFO(r.out.substr(0, 400), r.err.substr(0, 400));
    REQUIRE(r.exit_code == 0);
    return json::parse(r.out);
  };
  const json by_flag =
      run({"--lengths", lengths.string(), "--max-tokens", "12", "--effective-batch-size", "2",
           "--lr-rule", "fixture_power", "--base-batch-size", "2", "--base-lr", "0.01"});
  const auto& sizes = by_flag.at("batch_sizes");
  for (std::size_t s = 0; s < sizes.size(); ++s)
    CHECK(by_flag["lrs"][s].get<double>() ==
          doctest::Approx(0.01 * sizes[s].get<double>() / 2.0));  // default exponent 1

  // From a DeepSpeed JSON config (lengths from DeepSpeed's metric files): the
  // rule and its parameter come from the config.
  std::filesystem::create_directories(dir.path() / "metrics" / "seqlen");
  const std::string source = DUCTILE_TEST_DATA_DIR;
  for (const char* ext : {".bin", ".idx"})
    std::filesystem::copy_file(
        source + "/lengths/deepspeed_metric/azure_conv_seqlen_u16" + std::string(ext),
        dir.path() / "metrics" / "seqlen" / (std::string("seqlen_sample_to_metric") + ext));
  const auto config =
      dir.write("ds.json", R"({"train_batch_size": 4, "optimizer": {"params": {"lr": 0.001}},
      "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": true,
      "max_tokens": 16384, "metrics_path": "metrics", "lr_scaling_method": "fixture_power",
      "lr_scaling_params": {"exponent": 0.25}}}}})");
  const json from_json = run({"--config", config.string()});
  const auto& ds_sizes = from_json.at("batch_sizes");
  REQUIRE(from_json.at("lrs").size() == ds_sizes.size());
  for (std::size_t s = 0; s < ds_sizes.size(); ++s)
    CHECK(from_json["lrs"][s].get<double>() ==
          doctest::Approx(0.001 * std::pow(ds_sizes[s].get<double>() / 4.0, 0.25)));
}
