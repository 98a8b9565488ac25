// cpu_adam as a plugin of the framework: the [optimizer] section chooses and
// validates it (through the runtime and `ductile config check`), `ductile
// plugins` lists and describes it, and a bad call or parameter is an error
// naming the field, the value and what is valid, leaving the buffers as
// they were.
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "cpu_adam_support.hpp"
#include "process.hpp"
#include "temp_dir.hpp"

using ductile::Error;
using ductile::ErrorKind;
using ductile::Optimizer;
using ductile::OptimizerBuffers;
using ductile::OptimizerHyperParams;
using ductile::test::cpu_adam;
using ductile::test::run_process;
using ductile::test::TempDir;

namespace {

ductile::core::Runtime runtime_of(const std::string& toml) {
  ductile::core::RuntimeOptions options;
  options.extra_plugin_dirs.emplace_back(DUCTILE_PLUGIN_DIR);
  return ductile::core::Runtime::from_string(toml, "job.toml", options);
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("[optimizer] chooses cpu_adam by default and passes its parameters") {
  auto runtime = runtime_of("[optimizer]\nthreads = 3\nsimd = \"scalar\"\n");
  REQUIRE(runtime.has(ductile::PluginKind::optimizer));
  auto opt = runtime.get<Optimizer>();
  CHECK(opt->implementation().starts_with("scalar, 3 threads ("));
  CHECK(opt->state_names() == std::vector<std::string>{"exp_avg", "exp_avg_sq"});
  const auto& info = runtime.registry().find(ductile::PluginKind::optimizer, "cpu_adam");
  CHECK(info.kind == ductile::PluginKind::optimizer);
  CHECK(std::string(ductile::to_string(info.kind)) == "optimizer");
}

TEST_CASE("[optimizer] selects a user's optimizer plugin, with its own states") {
  auto runtime = runtime_of(std::string("[plugins]\npath = [\"") + OPTIMIZER_FIXTURE_DIR +
                            "\"]\n[optimizer]\nname = \"sign_sgd\"\n");
  auto opt = runtime.get<Optimizer>();
  CHECK(opt->state_names() == std::vector<std::string>{"momentum"});
  std::vector<float> p = {1.0f, 1.0f, 1.0f}, g = {0.5f, -2.0f, 0.0f}, m(3, 0.0f);
  float* state[] = {m.data()};
  opt->step({.params = p.data(), .grads = g.data(), .state = state, .numel = 3},
            {.lr = 0.25, .beta1 = 0.5}, 1);
  CHECK(p == std::vector<float>{0.75f, 1.25f, 1.0f});
  CHECK(m == std::vector<float>{0.25f, -1.0f, 0.0f});
}

TEST_CASE("a bad [optimizer] section names the key, the value and what is valid") {
  auto error_of = [](const std::string& toml) -> std::string {
    try {
      runtime_of(toml);
    } catch (const Error& e) {
      return e.what();
    }
    return "accepted";
  };
  CHECK(contains(error_of("[optimizer]\nthread = 2\n"), "unknown key 'thread'"));
  CHECK(contains(error_of("[optimizer]\nthreads = -1\n"), "threads = -1 is out of range"));
  const std::string simd = error_of("[optimizer]\nsimd = \"sse\"\n");
  CHECK(contains(simd, "simd = \"sse\" is not allowed"));
  CHECK(contains(simd, "auto, avx512, avx2, scalar"));
  CHECK(contains(error_of("[optimizer]\nname = \"lamb\"\n"), "lamb"));
}

TEST_CASE("an instruction set the CPU lacks is refused, naming what it has") {
  std::string missing;
  for (const char* simd : {"avx512", "avx2"}) {
    try {
      cpu_adam(simd);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::unsupported);
      CHECK(contains(e.what(), std::string("simd = \"") + simd + "\" is not available"));
      CHECK(contains(e.what(), "it has: "));
      CHECK(contains(e.what(), "scalar"));
      missing = simd;
      break;
    }
  }
  if (missing.empty()) MESSAGE("this CPU has every instruction set: nothing to refuse");
}

TEST_CASE("bad calls are refused before anything is written") {
  auto adam = cpu_adam("auto", 2);
  const std::size_t n = 100'000;
  std::vector<float> p(n, 1.0f), g(n, 0.5f), m(n, 0.0f), v(n, 0.0f);
  float* state[] = {m.data(), v.data()};
  const OptimizerBuffers good{.params = p.data(), .grads = g.data(), .state = state, .numel = n};
  auto error_of = [&](OptimizerBuffers b, OptimizerHyperParams h, std::uint64_t step) {
    try {
      adam->step(b, h, step);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::invalid_argument);
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const OptimizerHyperParams h;
  CHECK(contains(error_of(good, {.lr = -1e-3}, 1),
                 "lr = -0.001 is invalid; need a finite number >= 0"));
  CHECK(contains(error_of(good, {.beta1 = 1.0}, 1), "beta1 = 1 is invalid; need 0 <= beta1 < 1"));
  CHECK(contains(error_of(good, {.beta2 = -0.1}, 1), "beta2 = -0.1 is invalid"));
  CHECK(contains(error_of(good, {.eps = NAN}, 1), "eps = nan is invalid"));
  CHECK(contains(error_of(good, {.weight_decay = -1}, 1), "weight_decay = -1 is invalid"));
  CHECK(contains(error_of(good, {.grad_scale = 0}, 1), "grad_scale = 0 is invalid"));
  CHECK(contains(error_of(good, h, 0), "step = 0 is invalid; steps count from 1"));
  OptimizerBuffers one_state = good;
  one_state.state = std::span<float* const>(state, 1);
  CHECK(contains(error_of(one_state, h, 1), "1 state buffers given; this optimizer keeps 2"));
  OptimizerBuffers null_grads = good;
  null_grads.grads = nullptr;
  CHECK(contains(error_of(null_grads, h, 1), "grads is null with numel = 100000"));
  OptimizerBuffers overlap = good;
  overlap.grads = p.data() + 10;
  CHECK(contains(error_of(overlap, h, 1), "params and grads overlap"));
  std::vector<std::uint16_t> copy(n);
  OptimizerBuffers copy_over_state = good;
  copy_over_state.copy_out = v.data() + n / 2;
  CHECK(contains(error_of(copy_over_state, h, 1), "state[1] and copy_out overlap"));
  for (std::size_t i = 0; i < n; ++i)
    if (p[i] != 1.0f || g[i] != 0.5f || m[i] != 0.0f || v[i] != 0.0f)
      FAIL("element " << i << " written");
  // An empty shard is checked and does nothing.
  OptimizerBuffers empty{.state = state};
  adam->step(empty, h, 1);
  CHECK(contains(error_of(empty, h, 0), "step = 0"));
}

TEST_CASE("ductile plugins and config check know the optimizer kind") {
  TempDir dir;
  // The CLI of the build tree finds the built plugins as its built-in ones.
  auto list = run_process({DUCTILE_CLI, "plugins", "list"});
  INFO(list.out << list.err);
  CHECK(list.exit_code == 0);
  CHECK(contains(list.out, "optimizer"));
  CHECK(contains(list.out, "cpu_adam"));
  auto describe = run_process({DUCTILE_CLI, "plugins", "describe", "optimizer/cpu_adam"});
  INFO(describe.out << describe.err);
  CHECK(describe.exit_code == 0);
  CHECK(contains(describe.out, "threads"));
  CHECK(contains(describe.out, "simd"));

  auto example = run_process({DUCTILE_CLI, "config", "check",
                              DUCTILE_SOURCE_DIR "/plugins/optimizer/cpu_adam/example.toml"});
  INFO(example.out << example.err);
  CHECK(example.exit_code == 0);
  auto bad = dir.write("bad.toml", "[optimizer]\nname = \"cpu_adam\"\nthreads = 1.5\n");
  auto checked = run_process({DUCTILE_CLI, "config", "check", bad.string()});
  INFO(checked.out << checked.err);
  CHECK(checked.exit_code == 2);
  CHECK(contains(checked.err, "bad.toml:3:11"));
  CHECK(contains(checked.err, "threads"));
}

TEST_CASE("threading = \"openmp\" in a process without an OpenMP runtime is refused") {
  // ctest runs each case in a process of its own, and nothing this one
  // links uses OpenMP (cpu_adam_test's OpenMP case loads one for good).
  REQUIRE_MESSAGE(dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD) == nullptr,
                  "an OpenMP runtime is already loaded in this process: run this case alone");
  std::string message;
  try {
    cpu_adam("auto", 2, "openmp");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::unsupported);
    message = e.what();
  }
  CHECK(contains(message, "threading = \"openmp\" needs an OpenMP runtime loaded"));
  CHECK(contains(message, "libgomp.so.1"));
  CHECK(contains(message, "use \"auto\" or \"pool\""));
  CHECK(cpu_adam("auto", 2)->implementation().ends_with("2 threads (own pool)"));
  // The [optimizer] section passes the key through.
  auto runtime = runtime_of("[optimizer]\nthreading = \"pool\"\n");
  CHECK(runtime.get<Optimizer>()->implementation().ends_with("(own pool)"));
}
