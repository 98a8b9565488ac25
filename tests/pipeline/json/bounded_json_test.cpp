// JSON from users never crashes ductile: nesting deeper than 64 levels is
// refused before a DOM is built (nlohmann-json recurses once per level when
// it builds and when it dumps), and messages quote at most 60 characters of
// a value.
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "ductile/core/runtime.hpp"
#include "ductile/lr_scaling_rule.hpp"
#include "ductile/pipeline/deepspeed_batching.hpp"
#include "ductile/pipeline/elasticity.hpp"
#include "ductile/pipeline/json.hpp"
#include "ductile/pipeline/lr_schedule.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using namespace ductile;
using nlohmann::json;
namespace bj = ductile::pipeline;

namespace {

std::string nested_arrays(std::size_t depth) {
  return std::string(depth, '[') + std::string(depth, ']');
}

// An elasticity block whose value is nested `depth` levels below the top.
std::string deep_elasticity(std::size_t depth) {
  return "{\"elasticity\": " + nested_arrays(depth - 1) + "}";
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST_CASE("the depth scan counts brackets outside strings only") {
  CHECK(bj::json_depth_exceeded_at("[[1]]", 2) == std::string_view::npos);
  CHECK(bj::json_depth_exceeded_at("[[1]]", 1) == 1);
  CHECK(bj::json_depth_exceeded_at(R"({"a": {"b": [1]}})", 2) == 12);
  // Brackets and escaped quotes inside strings do not count.
  CHECK(bj::json_depth_exceeded_at(R"(["[[[[", "\"[[[", {}])", 2) == std::string_view::npos);
  CHECK(bj::json_depth_exceeded_at(R"(["\\", [[]]])", 2) == 8);
  // Unbalanced text is left to the parser.
  CHECK(bj::json_depth_exceeded_at("]]]][", 1) == std::string_view::npos);
}

TEST_CASE("64 levels parse, 65 are refused naming the source and the limit") {
  const json ok =
      bj::parse_bounded_json(nested_arrays(64), "x.json", "invalid JSON", ErrorKind::config);
  CHECK(ok.is_array());
  const std::string refused = message_of([] {
    (void)bj::parse_bounded_json(nested_arrays(65), "x.json", "invalid JSON", ErrorKind::config,
                                 "SomeType");
  });
  CHECK(refused ==
        "x.json: JSON nested deeper than 64 levels (at byte 64); ductile accepts at "
        "most 64");
  try {
    (void)bj::parse_bounded_json(nested_arrays(100000), "x.json", "invalid JSON", ErrorKind::io,
                                 "SomeType");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::io);
    CHECK(e.type() == "SomeType");
  }
  CHECK(message_of([] {
          (void)bj::parse_bounded_json("{\"a\": ", "y.json", "invalid JSON", ErrorKind::config);
        }).starts_with("y.json: invalid JSON: "));
}

TEST_CASE(
    "a key given twice in one object is refused by name, the same key in two objects is not") {
  const auto parse = [](const std::string& text) {
    return bj::parse_bounded_json(text, "ds.json", "invalid JSON", ErrorKind::config, "SomeType");
  };
  CHECK(parse(R"({"a": {"x": 1}, "b": {"x": 2}, "x": [{"x": 3}, {"x": 4}]})")["b"]["x"] == 2);
  CHECK(message_of([&] { (void)parse(R"({"enabled": true, "enabled": false})"); }) ==
        "ds.json: key \"enabled\" appears twice in one object; each key may be given once");
  CHECK(message_of([&] {
          (void)parse(R"({"elasticity": {"max_gpus": 8, "min_gpus": 1, "max_gpus": 16}})");
        }) == "ds.json: key \"max_gpus\" appears twice in one object; each key may be given once");
  try {
    (void)parse(R"([{"k": 1, "k": 1}])");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::config);
    CHECK(e.type() == "SomeType");
  }
}

TEST_CASE("excerpts are compact JSON, cut after 60 characters") {
  CHECK(bj::json_excerpt(json::parse(R"(["a", null, 0.5, {"k": true}])")) ==
        R"(["a",null,0.5,{"k":true}])");
  CHECK(bj::json_excerpt(json(1e30)) == "1e+30");
  const std::string long_text(1000000, 'x');
  const std::string cut = bj::json_excerpt(json(long_text));
  CHECK(cut == "\"" + std::string(59, 'x') + "...");
  json big = json::array();
  for (int i = 0; i < 100000; ++i) big.push_back(i);
  const std::string head = bj::json_excerpt(big);
  CHECK(head.size() == 63);
  CHECK(head.starts_with("[0,1,2,3,"));
  CHECK(head.ends_with("..."));
  // As deep as the parser allows, still bounded.
  CHECK(bj::json_excerpt(json::parse(nested_arrays(64))).size() == 63);
}

TEST_CASE("every JSON reader of the pipeline refuses 100,000 levels cleanly") {
  const std::string deep = deep_elasticity(100000);
  try {
    (void)pipeline::elasticity_from_deepspeed_json(deep, "ds.json");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.type() == "ElasticityConfigError");
    CHECK(std::string(e.what()).find("ds.json: JSON nested deeper than 64 levels") == 0);
  }
  const std::string batching =
      R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": )" +
      nested_arrays(100000) + "}}}}";
  CHECK(message_of([&] {
          (void)pipeline::parse_deepspeed_batching(batching, "b.json");
        }).find("b.json: JSON nested deeper than 64 levels") == 0);
  // A user value in a message is an excerpt, never the whole value.
  const std::string huge_value =
      R"({"elasticity": {"min_gpus": ")" + std::string(1000000, 'y') + "\"}}";
  const std::string m =
      message_of([&] { (void)pipeline::elasticity_from_deepspeed_json(huge_value, "h.json"); });
  CHECK(m.find("min_gpus must be an integer") != std::string::npos);
  CHECK(m.size() < 200);
  // A list of 100,000 elements with one bad one: the list is quoted by its head.
  std::string list;
  for (int i = 0; i < 100000; ++i) list += std::to_string(i % 7 + 1) + ", ";
  const std::string wide = R"({"elasticity": {"micro_batch_sizes": [)" + list + R"("x"]}})";
  const std::string w =
      message_of([&] { (void)pipeline::elasticity_from_deepspeed_json(wide, "w.json"); });
  CHECK(w.find("instead contains: [1,2,3,4,5,6,7,1,") != std::string::npos);
  CHECK(w.size() < 300);
  // A number of 200,000 digits (too large for a double): a clean user error,
  // the number cut in the message.
  try {
    (void)pipeline::elasticity_from_deepspeed_json(
        R"({"elasticity": {"max_gpus": )" + std::string(200000, '9') + "}}", "n.json");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.type() == "ElasticityConfigError");
    CHECK(std::string(e.what()).starts_with("n.json: invalid JSON: "));
    CHECK(std::string(e.what()).size() < 300);
  }
}

TEST_CASE("ductile elastic and pack refuse a config nested 100,000 levels: exit 2, no crash") {
  test::TempDir dir;
  const auto file = dir.write("deep.json", deep_elasticity(100000));
  const std::string cli = DUCTILE_CLI;
  const auto human = test::run_process({cli, "elastic", "--config", file.string()});
  CHECK(human.exit_code == 2);
  CHECK(human.err.find(file.string() + ": JSON nested deeper than 64 levels") != std::string::npos);
  CHECK(human.err.find("at most 64") != std::string::npos);
  const auto as_json = test::run_process({cli, "elastic", "--config", file.string(), "--json"});
  CHECK(as_json.exit_code == 2);
  const json error = json::parse(as_json.out);
  CHECK(error["error"]["type"] == "ElasticityConfigError");
  CHECK(error["error"]["message"].get<std::string>().find("nested deeper than 64") !=
        std::string::npos);
  // The same text without an extension is recognized as JSON by content.
  const auto bare = dir.write("ds_config", deep_elasticity(100000));
  CHECK(test::run_process({cli, "elastic", "--config", bare.string()}).exit_code == 2);

  const auto pack_config = dir.write(
      "pack.json", R"({"data_efficiency": {"data_sampling": {"dynamic_batching": {"max_tokens": )" +
                       nested_arrays(100000) + "}}}}");
  const auto pack = test::run_process({cli, "pack", "--json", "--config", pack_config.string()});
  CHECK(pack.exit_code == 2);
  CHECK(json::parse(pack.out)["error"]["message"].get<std::string>().find(
            "nested deeper than 64") != std::string::npos);

  // The scheduler's copy in the environment, checked by `ductile elastic`.
  const auto toml = dir.write("job.toml",
                              "[elasticity]\nversion = 0.1\nmax_train_batch_size = 100\n"
                              "micro_batch_sizes = [2, 4]\n");
  const auto env = test::run_process({cli, "elastic", "--config", toml.string()},
                                     {"DEEPSPEED_ELASTICITY_CONFIG=" + nested_arrays(20000)});
  CHECK(env.exit_code == 2);
  CHECK(env.err.find("DEEPSPEED_ELASTICITY_CONFIG: JSON nested deeper than 64 levels") !=
        std::string::npos);
}

TEST_CASE("a learning-rate state nested too deep is refused, the schedule unchanged") {
  auto runtime = core::Runtime::from_string("", "lr state test");
  pipeline::VariableBatchLrSchedule schedule({}, runtime.create<LrScalingRule>("linear"), 2,
                                             {2, 4});
  schedule.step();
  const std::string m = message_of([&] { schedule.load_state(nested_arrays(100000)); });
  CHECK(m ==
        "lr schedule state: JSON nested deeper than 64 levels (at byte 64); ductile accepts "
        "at most 64");
  CHECK(schedule.step_index() == 1);
}
