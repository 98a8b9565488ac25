// Configuration validation: exact messages and positions, all errors at once.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/core/text.hpp"
#include "temp_dir.hpp"

namespace fs = std::filesystem;
using namespace ductile;
using namespace ductile::core;

namespace {

const fs::path kGood = fs::path(FIXTURE_ROOT) / "good";

const PluginRegistry& registry() {
  static PluginRegistry r({kGood}, nullptr);
  return r;
}

std::vector<std::string> errors_of(std::string_view text) {
  try {
    auto doc = ConfigDocument::from_string(text, "job.toml");
    Config::validate(doc, registry());
  } catch (const ConfigError& e) {
    CHECK(e.kind() == ErrorKind::config);
    std::vector<std::string> out;
    for (const auto& d : e.diagnostics()) out.push_back(d.format());
    return out;
  }
  return {};
}

}  // namespace

TEST_CASE("a valid section gets its parameters with defaults filled in") {
  auto doc = ConfigDocument::from_string("[lr]\nrule = \"fixture_good\"\nsteps = 12\nscale = 3\n",
                                         "job.toml");
  auto config = Config::validate(doc, registry());
  const PluginSection* lr = config.section(PluginKind::lr);
  REQUIRE(lr != nullptr);
  CHECK(lr->plugin == "fixture_good");
  CHECK(lr->params.get_int("steps") == 12);
  CHECK(lr->params.get_double("scale") == 3.0);  // an integer literal is accepted for a float
  CHECK(lr->params.get_bool("enabled") == true);
  CHECK(lr->params.get_string("mode") == "fast");
  CHECK(lr->params.get_int_list("sizes") == std::vector<std::int64_t>{2, 4});
  CHECK_FALSE(lr->params.has("label"));
  CHECK(lr->where.line == 1);
  CHECK(config.host_section("log")->get_string("level") == "info");
}

TEST_CASE("every error of a file is reported together, in file order, with positions") {
  auto errors = errors_of(
      "[lr]\n"
      "rule = \"fixture_good\"\n"
      "stepz = 3\n"
      "scale = \"big\"\n"
      "mode = \"exakt\"\n"
      "sizes = [2, 0]\n"
      "\n"
      "[elastcity]\n"
      "policy = \"v0.1\"\n"
      "\n"
      "[accelerator]\n"
      "backend = 7\n");
  REQUIRE(errors.size() == 7);
  CHECK(errors[0] ==
        "job.toml:1:1: [lr] is missing required key 'steps' (integer: Number of steps)");
  CHECK(errors[1] ==
        "job.toml:3:1: unknown key 'stepz' in [lr] (did you mean 'steps'?); valid keys: steps, "
        "scale, enabled, mode, sizes, label, base_lr, base_batch_size, schedule, warmup_steps, "
        "total_steps, min_lr");
  CHECK(errors[2] == "job.toml:4:9: [lr] scale must be a float, got string 'big'");
  CHECK(errors[3] ==
        "job.toml:5:8: [lr] mode = \"exakt\" is not allowed (did you mean 'exact'?); valid values: "
        "fast, exact");
  CHECK(errors[4] == "job.toml:6:9: [lr] sizes[1] = 0 is out of range: must be >= 1");
  CHECK(errors[5] ==
        "job.toml:8:2: unknown section [elastcity] (did you mean 'elasticity'?); valid sections: "
        "plugins, log, elasticity, batching, lr, accelerator, zero, optimizer");
  CHECK(errors[6] ==
        "job.toml:12:11: [accelerator] backend must be a string naming the accelerator plugin, got "
        "integer 7");
}

TEST_CASE("wrong types and ranges name the key, the value and what is valid") {
  auto errors = errors_of(
      "[lr]\nrule = \"fixture_good\"\nsteps = 5000\nenabled = 1\n"
      "sizes = \"2,4\"\nlabel = [1]\n");
  REQUIRE(errors.size() == 4);
  CHECK(errors[0] == "job.toml:3:9: [lr] steps = 5000 is out of range: must be between 1 and 1000");
  CHECK(errors[1] == "job.toml:4:11: [lr] enabled must be a boolean, got integer 1");
  CHECK(errors[2] == "job.toml:5:9: [lr] sizes must be an array of integers, got string '2,4'");
  CHECK(errors[3] == "job.toml:6:9: [lr] label must be a string, got array [ 1 ]");
}

TEST_CASE("an unknown plugin is reported at its selector with the closest name") {
  auto errors = errors_of("[lr]\nrule = \"fixture_goo\"\n");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].starts_with(
      "job.toml:2:8: [lr] rule = \"fixture_goo\": no lr plugin named 'fixture_goo' (did you mean "
      "'fixture_good'?); available: fixture_good, fixture_throws; searched: "));
}

TEST_CASE("a plugin section without its selector lists the available plugins") {
  auto errors = errors_of("\n[lr]\nsteps = 3\n");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0] ==
        "job.toml:2:1: [lr] must name its plugin with rule = \"...\"; available: fixture_good, "
        "fixture_throws");
}

TEST_CASE("a section that is not a table is an error") {
  auto errors = errors_of("lr = 3\n");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0] == "job.toml:1:6: 'lr' must be a table ([lr]), got integer 3");
}

TEST_CASE("invalid TOML is reported at its position") {
  auto errors = errors_of("[lr]\nrule = \"fixture_good\nsteps = 3\n");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].starts_with("job.toml:2:"));
  CHECK(errors[0].find("invalid TOML") != std::string::npos);
}

TEST_CASE("host sections are validated too") {
  auto errors = errors_of("[log]\nlevel = \"verbose\"\n[plugins]\npath = \"x\"\n");
  REQUIRE(errors.size() == 2);
  CHECK(errors[0] ==
        "job.toml:2:9: [log] level = \"verbose\" is not allowed; valid values: trace, debug, info, "
        "warn, error, critical, off");
  CHECK(errors[1] == "job.toml:4:8: [plugins] path must be an array of strings, got string 'x'");
}

TEST_CASE("a missing or unreadable file is a config error naming it") {
  try {
    ConfigDocument::from_file("/nonexistent/job.toml");
    FAIL("no error");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()) == "/nonexistent/job.toml: configuration file does not exist");
  }
}

TEST_CASE("[plugins] path is resolved against the config file's directory") {
  test::TempDir dir;
  fs::create_directories(dir / "conf");
  auto file = dir.write("conf/job.toml", "[plugins]\npath = [\"../plugins\", \"/abs\"]\n");
  auto doc = ConfigDocument::from_file(file);
  auto dirs = doc.plugin_dirs();
  REQUIRE(dirs.size() == 2);
  CHECK(dirs[0] == dir / "conf" / "../plugins");
  CHECK(dirs[1] == "/abs");
}

TEST_CASE("the runtime creates the configured plugin once and shares it") {
  std::string text =
      "[plugins]\npath = [\"" + kGood.string() + "\"]\n[lr]\nrule = \"fixture_good\"\nsteps = 2\n";
  auto runtime = Runtime::from_string(text, "inline.toml");
  CHECK(runtime.has(PluginKind::lr));
  CHECK_FALSE(runtime.has(PluginKind::elasticity));
  auto a = runtime.instance(PluginKind::lr);
  auto b = runtime.instance(PluginKind::lr);
  CHECK(a == b);
  CHECK_THROWS_WITH_AS(runtime.instance(PluginKind::elasticity),
                       "inline.toml: no [elasticity] section; add one naming the elasticity "
                       "plugin to use",
                       Error);
}

TEST_CASE("a library above the core adds host keys to a section, and mistakes are refused") {
  static const char* const kModes[] = {"on", "off", nullptr};
  // (Added last in this file's order: the tests above list [log]'s keys.)
  extend_section("log", {{.key = "test_host_mode",
                          .type = ParamType::string,
                          .default_value = "\"on\"",
                          .allowed_values = kModes,
                          .doc = "a key of this test's host"}});
  auto config = Config::validate(ConfigDocument::from_string("[log]\n", "job.toml"), registry());
  CHECK(config.host_section("log")->get_string("test_host_mode") == "on");
  CHECK(errors_of("[log]\ntest_host_mode = \"of\"\n") ==
        std::vector<std::string>{"job.toml:2:18: [log] test_host_mode = \"of\" is not allowed "
                                 "(did you mean 'on'?); valid values: on, off"});
  CHECK_THROWS_WITH_AS(
      extend_section("log", {{.key = "test_host_mode", .type = ParamType::string, .doc = ""}}),
      "extend_section: [log] already has the key 'test_host_mode'", Error);
  CHECK_THROWS_WITH_AS(extend_section("logs", {}), "extend_section: no section [logs]", Error);
}

TEST_CASE("a value built in C++ is checked against its spec as a TOML value is") {
  const ParamSpec steps{.key = "steps",
                        .type = ParamType::integer,
                        .flags = param_has_min | param_has_max,
                        .min_value = 1,
                        .max_value = 1000,
                        .doc = ""};
  std::string error;
  CHECK_FALSE(check_param_value(steps, std::int64_t{5000}, "steps", error));
  CHECK(error == "steps = 5000 is out of range: must be between 1 and 1000");
  CHECK_FALSE(check_param_value(steps, std::string("x"), "steps", error));
  CHECK(error == "steps must be an integer, got \"x\"");
  const ParamSpec scale{
      .key = "scale", .type = ParamType::floating, .flags = param_has_min, .doc = ""};
  auto widened = check_param_value(scale, std::int64_t{3}, "scale", error);
  REQUIRE(widened);
  CHECK(std::get<double>(*widened) == 3.0);
  CHECK_FALSE(check_param_value(scale, std::int64_t{-3}, "scale", error));
  CHECK(error == "scale = -3 is out of range: must be >= 0");
}

TEST_CASE("parameter literals round-trip through format_param_value") {
  ParamSpec list{.key = "xs", .type = ParamType::float_list, .doc = ""};
  CHECK(format_param_value(parse_param_literal(list, "[1, 2.5]")) == "[1.0, 2.5]");
  ParamSpec text{.key = "s", .type = ParamType::string, .doc = ""};
  CHECK(format_param_value(parse_param_literal(text, "\"a\\\"b\"")) == "\"a\\\"b\"");
  CHECK_THROWS_AS(parse_param_literal(text, "[1"), Error);
}

TEST_CASE("parameter literals: plain ones and the rest of TOML read alike") {
  ParamSpec integer{.key = "n", .type = ParamType::integer, .doc = ""};
  CHECK(std::get<std::int64_t>(parse_param_literal(integer, "42")) == 42);
  CHECK(std::get<std::int64_t>(parse_param_literal(integer, "-7")) == -7);
  CHECK(std::get<std::int64_t>(parse_param_literal(integer, "-0")) == 0);
  CHECK(std::get<std::int64_t>(parse_param_literal(integer, "+5")) == 5);
  CHECK(std::get<std::int64_t>(parse_param_literal(integer, "1_000")) == 1000);
  CHECK(std::get<std::int64_t>(parse_param_literal(integer, "0x10")) == 16);
  CHECK(std::get<std::int64_t>(parse_param_literal(integer, "9223372036854775807")) ==
        std::numeric_limits<std::int64_t>::max());
  CHECK_THROWS_AS(parse_param_literal(integer, "9223372036854775808"), Error);
  CHECK_THROWS_AS(parse_param_literal(integer, "007"), Error);
  CHECK_THROWS_AS(parse_param_literal(integer, "1.5"), Error);
  CHECK_THROWS_AS(parse_param_literal(integer, "-"), Error);

  ParamSpec floating{.key = "x", .type = ParamType::floating, .doc = ""};
  CHECK(std::get<double>(parse_param_literal(floating, "2.5")) == 2.5);
  CHECK(std::get<double>(parse_param_literal(floating, "1e-3")) == 1e-3);
  CHECK(std::get<double>(parse_param_literal(floating, "6.02E+23")) == 6.02e23);
  CHECK(std::get<double>(parse_param_literal(floating, "1e06")) == 1e6);
  CHECK(std::signbit(std::get<double>(parse_param_literal(floating, "-0.0"))));
  CHECK(std::get<double>(parse_param_literal(floating, "3")) == 3.0);
  CHECK(std::isinf(std::get<double>(parse_param_literal(floating, "inf"))));
  CHECK(std::get<double>(parse_param_literal(floating, "1_0.5")) == 10.5);
  CHECK_THROWS_AS(parse_param_literal(floating, "1."), Error);
  CHECK_THROWS_AS(parse_param_literal(floating, ".5"), Error);
  CHECK_THROWS_AS(parse_param_literal(floating, "01.5"), Error);
  CHECK_THROWS_AS(parse_param_literal(floating, "1e"), Error);

  ParamSpec flag{.key = "b", .type = ParamType::boolean, .doc = ""};
  CHECK(std::get<bool>(parse_param_literal(flag, "true")));
  CHECK_FALSE(std::get<bool>(parse_param_literal(flag, "false")));
  CHECK_THROWS_AS(parse_param_literal(flag, "True"), Error);

  ParamSpec text{.key = "s", .type = ParamType::string, .doc = ""};
  CHECK(std::get<std::string>(parse_param_literal(text, "\"cosine\"")) == "cosine");
  CHECK(std::get<std::string>(parse_param_literal(text, "\"\"")).empty());
  CHECK(std::get<std::string>(parse_param_literal(text, "\"a\\tb\"")) == "a\tb");
  CHECK(std::get<std::string>(parse_param_literal(text, "'C:\\dir'")) == "C:\\dir");
  CHECK(std::get<std::string>(parse_param_literal(text, "\"\xc3\xa9\"")) == "\xc3\xa9");
  CHECK_THROWS_AS(parse_param_literal(text, "\"a\"b\""), Error);
}

TEST_CASE("a plain default is checked against its spec like any other value") {
  ParamSpec bounded{.key = "n",
                    .type = ParamType::integer,
                    .flags = param_has_min | param_has_max,
                    .min_value = 1,
                    .max_value = 10,
                    .doc = ""};
  CHECK(std::get<std::int64_t>(parse_param_literal(bounded, "10")) == 10);
  try {
    parse_param_literal(bounded, "0");
    FAIL("no error for a default below the minimum");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("default of 'n'") != std::string::npos);
  }
}

TEST_CASE("a file of many bad keys reports its first 100 in file order and counts the rest") {
  std::string text = "[lr]\nrule = \"fixture_good\"\nsteps = 3\n";
  // Written in reverse name order: the table's own order (by name) is not the file's.
  for (int k = 1999; k >= 0; --k) text += "unknown_" + std::to_string(k) + " = 1\n";
  try {
    Config::validate(ConfigDocument::from_string(text, "job.toml"), registry());
    FAIL("no error");
  } catch (const ConfigError& e) {
    REQUIRE(e.diagnostics().size() == kMaxConfigDiagnostics);
    CHECK(e.more() == 2000 - kMaxConfigDiagnostics);
    CHECK(e.diagnostics().front().where.line == 4);
    CHECK(e.diagnostics().front().message.starts_with("unknown key 'unknown_1999' in [lr]"));
    CHECK(e.diagnostics().back().where.line == 103);
    const std::string what = e.what();
    CHECK(std::count(what.begin(), what.end(), '\n') == 100);
    CHECK(what.ends_with("\n... and 1900 more"));
  }
}

TEST_CASE("control, bidi and NUL characters and bytes that are not UTF-8 are escaped") {
  using namespace std::string_literals;
  CHECK(printable("plain text, ünïcödé, tab\tand\nnewline") ==
        "plain text, ünïcödé, tab\tand\nnewline");
  CHECK(printable("a\0b\x1b[31m\x7f"s) == "a\\x00b\\x1b[31m\\x7f");
  CHECK(printable("x\ny", false) == "x\\x0ay");
  CHECK(printable("evil\u202etxt\u2066\u200f") == "evil\\u{202e}txt\\u{2066}\\u{200f}");
  CHECK(printable("c1:\xc2\x85") == "c1:\\u{0085}");
  CHECK(printable("bad:\xff\xc3(\xed\xa0\x80") == "bad:\\xff\\xc3(\\xed\\xa0\\x80");
  CHECK(printable("cut:\xe2\x82") == "cut:\\xe2\\x82");
  // Quoted values and whole diagnostics go through it.
  CHECK(excerpt("k\0ey\u202e"s) == "k\\x00ey\\u{202e}");
  const auto errors =
      errors_of("[lr]\nrule = \"fixture_good\"\nsteps = 3\n\"a\\u0000b\\u202E\" = 1\n");
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].starts_with("job.toml:4:1: unknown key 'a\\x00b\\u{202e}' in [lr]"));
}

TEST_CASE("an integer past 64 bits is named by its key and position, with the valid range") {
  auto errors = errors_of("[lr]\nrule = \"fixture_good\"\nsteps = 99999999999999999999\n");
  REQUIRE(errors.size() == 1);
  CHECK_MESSAGE(errors[0].starts_with("job.toml:3:"), errors[0]);
  CHECK_MESSAGE(errors[0].find("steps = 99999999999999999999 is past the largest integer "
                               "(2^63-1)") != std::string::npos,
                errors[0]);
  CHECK(errors[0].find("9223372036854775807") != std::string::npos);
  CHECK(errors[0].find("not representable") == std::string::npos);
  auto negative = errors_of("[lr]\nrule = \"fixture_good\"\nsteps = -9223372036854775809\n");
  REQUIRE(negative.size() == 1);
  CHECK_MESSAGE(negative[0].find("steps = -9223372036854775809 is past the smallest integer "
                                 "(-2^63)") != std::string::npos,
                negative[0]);
  // The largest integer itself is an integer (its range is the schema's).
  auto largest = errors_of("[lr]\nrule = \"fixture_good\"\nsteps = 9223372036854775807\n");
  for (const auto& e : largest) CHECK(e.find("past the") == std::string::npos);
}
