// The plugin loader and registry against real fixture libraries.
#include <dlfcn.h>
#include <stdlib.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <typeinfo>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <spdlog/sinks/ostream_sink.h>

#include "ductile/core/config.hpp"
#include "ductile/core/registry.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/lr_scaling_rule.hpp"
#include "fixtures/fixture_plugin.hpp"

namespace fs = std::filesystem;
using namespace ductile;
using namespace ductile::core;

namespace {

const fs::path kRoot = FIXTURE_ROOT;

std::string load_error(const fs::path& file) {
  try {
    load_plugin_file(file);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::plugin);
    return e.what();
  }
  FAIL("loading " << file << " did not fail");
  return {};
}

struct CapturedLog {
  std::ostringstream stream;
  std::shared_ptr<spdlog::logger> logger;
  CapturedLog() {
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(stream);
    logger = std::make_shared<spdlog::logger>("capture", sink);
    logger->set_level(spdlog::level::debug);
  }
};

// A descriptor that passes the one rule of version.hpp, for the checks of
// check_plugin_descriptor() after it.
ductile_plugin_descriptor host_descriptor(PluginKind kind, const char* name) {
  ductile_plugin_descriptor d{};
  d.abi_version = DUCTILE_ABI_VERSION;
  d.kind = static_cast<std::uint32_t>(kind);
  d.interface_revision = interface_revision(kind);
  d.layout_fingerprint = detail::shared_layout_fingerprint();
  d.build_tag = DUCTILE_BUILD_TAG;
  d.name = name;
  d.create = [](const HostContext*, ductile_plugin_error*) -> Plugin* { return nullptr; };
  return d;
}

bool library_loaded(const fs::path& file) {
  void* handle = dlopen(file.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (!handle) return false;
  dlclose(handle);
  return true;
}

}  // namespace

TEST_CASE("a well-formed plugin loads with its descriptor and schema") {
  auto info = load_plugin_file(kRoot / "good" / "libductile_lr_fixture_good.so");
  CHECK(info.kind == PluginKind::lr);
  CHECK(info.name == "fixture_good");
  CHECK(info.version == "1.2.3");
  CHECK(info.description == "A well-formed fixture plugin");
  CHECK(info.abi_version == DUCTILE_ABI_VERSION);
  CHECK(info.interface_revision == DUCTILE_INTERFACE_REVISION_LR);
  CHECK(info.build_tag == DUCTILE_BUILD_TAG);
  REQUIRE(info.params.size() == 6);
  CHECK(std::string(info.params[0].key) == "steps");
  CHECK((info.params[0].flags & param_required) != 0);
  CHECK(static_cast<bool>(info.factory));
}

TEST_CASE("a plugin built for another ABI version is refused, naming both versions") {
  const fs::path file = kRoot / "bad" / "libductile_lr_fixture_abi.so";
  CHECK(load_error(file) == fmt::format("'{}' was built for plugin ABI 99 but this ductile uses "
                                        "ABI {}; rebuild the plugin against this SDK",
                                        file.string(), DUCTILE_ABI_VERSION));
}

TEST_CASE("a plugin with another build tag is refused, naming both tags") {
  auto message = load_error(kRoot / "bad" / "libductile_lr_fixture_tag.so");
  CHECK(message.find("'msvc-19/msvc-stl/c++202002/sdk-0.1'") != std::string::npos);
  CHECK(message.find(std::string("'") + DUCTILE_BUILD_TAG + "'") != std::string::npos);
}

TEST_CASE("a shared library without the entry symbol is refused") {
  auto message = load_error(kRoot / "bad" / "libductile_lr_fixture_noentry.so");
  CHECK(message.find("does not export the entry symbol 'ductile_plugin_entry'") !=
        std::string::npos);
}

TEST_CASE("a file that is not a shared library is refused") {
  auto message = load_error(kRoot / "bad" / "libductile_lr_fixture_text.so");
  CHECK(message.find("is not a loadable shared library") != std::string::npos);
  CHECK(message.find("libductile_lr_fixture_text.so") != std::string::npos);
}

TEST_CASE("a plugin whose descriptor contradicts its file name is refused") {
  auto message = load_error(kRoot / "bad" / "libductile_lr_fixture_misnamed.so");
  CHECK(message.find("declares plugin lr/something_else") != std::string::npos);
  CHECK(message.find("libductile_lr_something_else.so") != std::string::npos);
}

TEST_CASE("a missing file is not_found") {
  try {
    load_plugin_file(kRoot / "good" / "libductile_lr_nothing.so");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::not_found);
  }
}

TEST_CASE("the registry collects broken files as problems and reports them on lookup") {
  CapturedLog log;
  PluginRegistry registry({kRoot / "bad"}, log.logger);
  CHECK(registry.plugins().empty());
  CHECK(registry.problems().size() == 6);
  CHECK(log.stream.str().find("[warning]") != std::string::npos);
  try {
    registry.find(PluginKind::lr, "fixture_abi");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::plugin);
    CHECK(std::string(e.what()).find("lr plugin 'fixture_abi' cannot be used") !=
          std::string::npos);
    CHECK(std::string(e.what()).find("plugin ABI 99 but") != std::string::npos);
  }
}

TEST_CASE("an unknown plugin name lists what exists and suggests the closest") {
  PluginRegistry registry({kRoot / "good"}, nullptr);
  REQUIRE(registry.plugins().size() == 2);
  try {
    registry.find(PluginKind::lr, "fixture_goood");
    FAIL("no error");
  } catch (const Error& e) {
    std::string message = e.what();
    CHECK(e.kind() == ErrorKind::not_found);
    CHECK(message.find("no lr plugin named 'fixture_goood' (did you mean 'fixture_good'?)") !=
          std::string::npos);
    CHECK(message.find("available: fixture_good, fixture_throws") != std::string::npos);
  }
  CHECK_THROWS_AS(registry.find(PluginKind::elasticity, "fixture_good"), Error);
  CHECK(registry.find_any("lr/fixture_good").name == "fixture_good");
  CHECK(registry.find_any("fixture_good").kind == PluginKind::lr);
}

TEST_CASE("the first of two plugins with the same kind and name wins, with a warning naming both") {
  CapturedLog log;
  PluginRegistry registry({kRoot / "dup_a", kRoot / "dup_b"}, log.logger);
  REQUIRE(registry.plugins().size() == 1);
  CHECK(registry.plugins()[0].version == "1.0.0-a");
  std::string text = log.stream.str();
  CHECK(text.find((kRoot / "dup_a" / "libductile_lr_fixture_dup.so").string()) !=
        std::string::npos);
  CHECK(text.find((kRoot / "dup_b" / "libductile_lr_fixture_dup.so").string()) !=
        std::string::npos);

  PluginRegistry reversed({kRoot / "dup_b", kRoot / "dup_a"}, nullptr);
  CHECK(reversed.plugins()[0].version == "2.0.0-b");
}

TEST_CASE("a throwing factory's error keeps its kind, type and message") {
  auto runtime = Runtime::from_string("", "inline.toml", {{kRoot / "good"}, nullptr});
  try {
    runtime.create(PluginKind::lr, "fixture_throws", {});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::config);
    CHECK(e.type() == "FixtureStartError");
    std::string message = e.what();
    CHECK(message.find("lr plugin 'fixture_throws'") != std::string::npos);
    CHECK(message.find("fixture refuses to start: no GPU attached") != std::string::npos);
  }
}

TEST_CASE("the validate hook runs before creation and its error keeps kind, type and key") {
  auto runtime = Runtime::from_string("", "inline.toml", {{kRoot / "checks"}, nullptr});
  Params odd;
  odd.set("steps", std::int64_t{3});
  try {
    runtime.create(PluginKind::lr, "fixture_checked", odd);
    FAIL("no error");
  } catch (const ParamError& e) {
    CHECK(e.kind() == ErrorKind::config);
    CHECK(e.type() == "FixtureParamError");
    CHECK(e.key() == "steps");
    CHECK(std::string(e.what()) == "fixture_checked: steps = 3 must be even");
  }
  Params four;
  four.set("steps", std::int64_t{4});
  try {
    runtime.create(PluginKind::lr, "fixture_checked", four);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::incompatible);
    CHECK(e.type() == "FixtureNoDevice");
    CHECK(std::string(e.what()).find("steps = 4 needs a device") != std::string::npos);
  }
  Params two;
  two.set("steps", std::int64_t{2});
  CHECK(runtime.create(PluginKind::lr, "fixture_checked", two));
}

TEST_CASE("plugin checks in config validation point at the key named, else at the section") {
  PluginRegistry registry({kRoot / "checks"}, nullptr);
  auto errors = [&](const std::string& text, bool plugin_checks) {
    auto doc = ConfigDocument::from_string(text, "job.toml");
    try {
      Config::validate(doc, registry, plugin_checks);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string odd = "# odd\n[lr]\nrule = \"fixture_checked\"\n  steps = 5\n";
  CHECK(errors(odd, false).empty());
  CHECK(errors(odd, true) == "job.toml:4:11: fixture_checked: steps = 5 must be even");
  CHECK(errors("[lr]\nrule = \"fixture_checked\"\nsteps = 6\n", true) ==
        "job.toml:1:1: fixture_checked: steps = 6 is refused as a whole");
  CHECK(errors("[lr]\nrule = \"fixture_checked\"\nsteps = 8\n", true).empty());
}

TEST_CASE("type identity across the boundary is as export.hpp says") {
  auto runtime = Runtime::from_string("", "inline.toml", {{kRoot / "checks"}, nullptr});
  auto probe =
      std::static_pointer_cast<ProbePlugin>(runtime.create(PluginKind::lr, "fixture_probe", {}));
  // Each plugin has its own type_info for the SDK types...
  CHECK(probe->error_type_info() != static_cast<const void*>(&typeid(Error)));
  // ...and an exception thrown by plugin code is still caught by type.
  try {
    probe->raise();
    FAIL("no exception");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::io);
    CHECK(e.type() == "FixtureRaised");
  }
}

TEST_CASE("objects keep their library loaded after the registry is gone") {
  const fs::path file = kRoot / "good" / "libductile_lr_fixture_good.so";
  std::shared_ptr<Plugin> object;
  {
    auto runtime = Runtime::from_string("", "inline.toml", {{kRoot / "good"}, nullptr});
    Params params;
    params.set("steps", std::int64_t{3});
    params.set("scale", 2.5);
    object = runtime.create(PluginKind::lr, "fixture_good", params);
    CHECK(library_loaded(file));
  }
  CHECK(library_loaded(file));
  REQUIRE(object);
  object.reset();
  // Never unloaded during the run (see registry.hpp).
  CHECK(library_loaded(file));
}

TEST_CASE("explicit parameters are checked against the schema") {
  auto runtime = Runtime::from_string("", "inline.toml", {{kRoot / "good"}, nullptr});
  Params missing;
  CHECK_THROWS_WITH_AS(runtime.create(PluginKind::lr, "fixture_good", missing),
                       "lr plugin 'fixture_good': missing required parameter 'steps'", Error);
  Params bad;
  bad.set("steps", std::int64_t{0});
  bad.set("stepz", std::int64_t{1});
  std::string message;
  try {
    runtime.create(PluginKind::lr, "fixture_good", bad);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("unknown parameter 'stepz' (did you mean 'steps'?)") != std::string::npos);
  CHECK(message.find("steps = 0 is out of range: must be between 1 and 1000") != std::string::npos);
}

TEST_CASE("the search path is config dirs, then DUCTILE_PLUGIN_PATH, then the built-in dir") {
  setenv("DUCTILE_PLUGIN_PATH", "/opt/a::/opt/b", 1);
  auto path = PluginRegistry::default_search_path({"/etc/x"});
  unsetenv("DUCTILE_PLUGIN_PATH");
  REQUIRE(path.size() == 4);
  CHECK(path[0] == "/etc/x");
  CHECK(path[1] == "/opt/a");
  CHECK(path[2] == "/opt/b");
  CHECK(path[3] == PluginRegistry::builtin_plugin_dir());
  CHECK(path[3] == fs::path(DUCTILE_PLUGIN_DIR));
}

TEST_CASE("a directory named twice on the search path is scanned once, without warnings") {
  CapturedLog log;
  PluginRegistry registry({kRoot / "good", kRoot / "good" / ".." / "good"}, log.logger);
  CHECK(registry.plugins().size() == 2);
  CHECK(registry.problems().empty());
  CHECK(log.stream.str().find("found twice") == std::string::npos);
}

TEST_CASE(
    "schema bounds: NaN, min above max or a bound without its flag is refused, any other bound is "
    "printed as given") {
  ParamSpec spec{.key = "steps",
                 .type = ParamType::integer,
                 .flags = param_has_min | param_has_max,
                 .default_value = "-5",
                 .max_value = 10.0,
                 .doc = "steps"};
  ductile_plugin_descriptor d = host_descriptor(PluginKind::lr, "bounds");
  d.params = &spec;
  d.param_count = 1;
  const fs::path file = "libductile_lr_bounds.so";
  auto refused = [&] {
    try {
      check_plugin_descriptor(&d, file);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::plugin);
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  auto default_error = [&] {
    auto info = check_plugin_descriptor(&d, file);
    try {
      complete_params(info, Params{});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };

  CHECK(default_error().find("between 0 and 10") != std::string::npos);
  spec.max_value = std::nan("");
  CHECK(refused().find("parameter 'steps' of its schema has a NaN bound") != std::string::npos);
  spec.max_value = 10.0;
  spec.min_value = 20.0;
  CHECK(refused().find("min_value 20 above max_value 10") != std::string::npos);
  // Bounds no int64 can hold, on an integer key: printed as doubles, not
  // converted (that conversion is undefined; the fuzzer found it).
  spec.flags = param_has_min;
  spec.min_value = 1e300;
  spec.max_value = 0;
  CHECK(default_error().find(">= 1e+300") != std::string::npos);
  spec.flags = param_has_max;
  spec.min_value = 0;
  spec.max_value = -std::numeric_limits<double>::infinity();
  CHECK(default_error().find("<= -inf") != std::string::npos);

  // A bound without its flag would never be compared: refused, whatever the
  // value, except 0 (the default of an unset field, params.hpp).
  spec.flags = param_has_min;
  spec.min_value = -3;
  spec.max_value = 10;
  CHECK(refused() ==
        "'libductile_lr_bounds.so': plugin lr/bounds declares parameter 'steps' with max_value "
        "10 but without the param_has_max flag, so the bound is never checked; add "
        "ductile::param_has_max to its .flags to check it, or remove .max_value");
  spec.flags = param_has_max;
  spec.min_value = -std::numeric_limits<double>::infinity();
  CHECK(refused().find("with min_value -inf but without the param_has_min flag") !=
        std::string::npos);
  spec.min_value = std::nan("");
  CHECK(refused().find("with min_value nan but without the param_has_min flag") !=
        std::string::npos);
  spec.flags = 0;
  spec.min_value = 0;
  spec.max_value = 0;
  CHECK(refused() == "(accepted)");
  // On a key without numbers, the flag would not help: the advice is to
  // remove the bound.
  spec.type = ParamType::string;
  spec.default_value = "\"a\"";
  spec.min_value = 1;
  CHECK(refused().find("bounds apply only to numbers and lists of numbers, and this parameter is "
                       "of type string: remove .min_value") != std::string::npos);
}

TEST_CASE("a plugin file whose schema sets a bound without its flag is refused when it registers") {
  const fs::path file = kRoot / "unchecked" / "libductile_lr_fixture_unchecked.so";
  const std::string refusal =
      "plugin lr/fixture_unchecked declares parameter 'steps' with min_value 1 but without the "
      "param_has_min flag, so the bound is never checked; add ductile::param_has_min to its "
      ".flags to check it, or remove .min_value";
  CHECK(load_error(file) == fmt::format("'{}': {}", file.string(), refusal));

  CapturedLog log;
  PluginRegistry registry({kRoot / "unchecked"}, log.logger);
  CHECK(registry.plugins().empty());
  REQUIRE(registry.problems().size() == 1);
  CHECK(registry.problems()[0].message.find(refusal) != std::string::npos);
  CHECK(log.stream.str().find(refusal) != std::string::npos);
  try {
    registry.find(PluginKind::lr, "fixture_unchecked");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::plugin);
    CHECK(std::string(e.what()).find("lr plugin 'fixture_unchecked' cannot be used") !=
          std::string::npos);
    CHECK(std::string(e.what()).find(refusal) != std::string::npos);
  }
}

TEST_CASE("a plugin built against a kind interface with an appended virtual is refused") {
  // fixture_future: this SDK's lr_scaling_rule.hpp with one more virtual at
  // the end of LrScalingRule and the next DUCTILE_INTERFACE_REVISION_LR, as
  // the rule in version.hpp makes a later SDK (fixtures/CMakeLists.txt).
  auto message = load_error(kRoot / "interface" / "libductile_lr_fixture_future.so");
  CHECK(message.find(fmt::format("was built against revision {} of the lr interface "
                                 "(LrScalingRule) but this ductile has revision {}",
                                 DUCTILE_INTERFACE_REVISION_LR + 1,
                                 DUCTILE_INTERFACE_REVISION_LR)) != std::string::npos);
  CHECK(message.find("rebuild the plugin against this SDK") != std::string::npos);

  // The same source built against this SDK loads and computes.
  auto runtime = Runtime::from_string("", "inline.toml", {{kRoot / "interface"}, nullptr});
  auto rule = runtime.create<LrScalingRule>("fixture_present");
  CHECK(rule->scale(0.1, 8, 8) == doctest::Approx(0.3));
  CHECK(runtime.registry().find(PluginKind::lr, "fixture_present").interface_revision ==
        DUCTILE_INTERFACE_REVISION_LR);
}

TEST_CASE("a plugin whose shared types have another layout (_GLIBCXX_DEBUG) is refused") {
  auto message = load_error(kRoot / "interface" / "libductile_lr_fixture_debug_layout.so");
  CHECK(message.find("was compiled with another layout of the types plugins share with ductile") !=
        std::string::npos);
  CHECK(message.find(fmt::format("this ductile's {:#010x}", detail::shared_layout_fingerprint())) !=
        std::string::npos);
}

TEST_CASE("one rule: ABI version, build tag, shared layout and interface revision are the host's") {
  ductile_plugin_descriptor d = host_descriptor(PluginKind::batching, "rule");
  const fs::path file = "libductile_batching_rule.so";
  auto info = check_plugin_descriptor(&d, file);
  CHECK(info.abi_version == DUCTILE_ABI_VERSION);
  CHECK(info.interface_revision == DUCTILE_INTERFACE_REVISION_BATCHING);
  CHECK(info.build_tag == DUCTILE_BUILD_TAG);

  // Each refusal names the file, the plugin's value, the host's, and what to do.
  auto refusal = [&](ductile_plugin_descriptor changed) {
    try {
      check_plugin_descriptor(&changed, file);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::plugin);
      const std::string message = e.what();
      CHECK(message.starts_with("'libductile_batching_rule.so' "));
      CHECK(message.find("rebuild the plugin against this SDK") != std::string::npos);
      return message;
    }
    FAIL("accepted");
    return std::string();
  };
  ductile_plugin_descriptor older = d;
  older.abi_version = DUCTILE_ABI_VERSION - 1;
  CHECK(refusal(older).find(fmt::format("built for plugin ABI {} but this ductile uses ABI {}",
                                        DUCTILE_ABI_VERSION - 1, DUCTILE_ABI_VERSION)) !=
        std::string::npos);
  ductile_plugin_descriptor tagged = d;
  tagged.build_tag = "clang-99/libc++/c++202002L/fmt-1/spdlog-1.0.0";
  CHECK(refusal(tagged).find(fmt::format("built with 'clang-99/libc++/c++202002L/fmt-1/"
                                         "spdlog-1.0.0' but this ductile was built with '{}'",
                                         DUCTILE_BUILD_TAG)) != std::string::npos);
  ductile_plugin_descriptor laid_out = d;
  laid_out.layout_fingerprint = detail::shared_layout_fingerprint() ^ 1;
  CHECK(refusal(laid_out).find(fmt::format("fingerprint {:#010x}, this ductile's {:#010x}",
                                           detail::shared_layout_fingerprint() ^ 1,
                                           detail::shared_layout_fingerprint())) !=
        std::string::npos);
  ductile_plugin_descriptor revised = d;
  revised.interface_revision = DUCTILE_INTERFACE_REVISION_BATCHING + 1;
  CHECK(refusal(revised).find(fmt::format("built against revision {} of the batching interface "
                                          "(BatchSampler) but this ductile has revision {}",
                                          DUCTILE_INTERFACE_REVISION_BATCHING + 1,
                                          DUCTILE_INTERFACE_REVISION_BATCHING)) !=
        std::string::npos);
}

TEST_CASE("a descriptor pointing where its library maps nothing is refused before any read") {
  // Each fixture's entry point returns one pointer into nothing (garbage_plugin.cpp);
  // reading through any of them crashed the process that listed the plugins.
  const std::pair<const char*, const char*> cases[] = {
      {"wild_descriptor",
       "its descriptor's address (0x10, 4 bytes) lies outside what the "
       "library maps"},
      {"wild_name", "its descriptor's name (0x10, a string) lies outside"},
      {"wild_schema", "its descriptor's params (an array of 1) (0x10,"},
      {"huge_schema", "its descriptor declares 1099511627776 parameters, more than the 4096"},
      {"wild_allowed", "its descriptor's params[0].allowed_values[1] (0x10, a string)"},
      {"data_factory", "its descriptor's create ("},
  };
  for (const auto& [name, expected] : cases) {
    CAPTURE(name);
    const fs::path file = kRoot / "garbage" / fmt::format("libductile_lr_garbage_{}.so", name);
    const std::string message = load_error(file);
    CHECK(message.find(file.string()) != std::string::npos);
    CHECK_MESSAGE(message.find(expected) != std::string::npos, message);
    CHECK(message.find("the plugin was not used") != std::string::npos);
  }
  // What `ductile plugins list` does: every file is a problem, none a crash.
  PluginRegistry registry({kRoot / "garbage"}, nullptr);
  std::size_t garbage = 0;
  for (const auto& problem : registry.problems())
    garbage += problem.file.filename().string().starts_with("libductile_lr_garbage_");
  CHECK(garbage == std::size(cases));
  for (const auto& info : registry.plugins()) CHECK_FALSE(info.name.starts_with("garbage_"));
}
