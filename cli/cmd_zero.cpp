// ductile zero --config FILE [--steps N] [--blocks B] [--width W] [--compute-us U]:
// runs a few forward+backward passes of a synthetic, scaled-down transformer
// through the configured ZeRO-3 parameter coordinator ([zero] and
// [accelerator] sections), checks every gathered parameter against the
// values each rank's shard was made from, and prints one line per pass.
// Meant to run under mpirun (./run.sh uses 2 ranks); rank 0 prints.
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli_common.hpp"
#include "ductile/accelerator.hpp"
#include "ductile/parameter_coordinator.hpp"

namespace ductile::cli {
namespace {

struct ZeroOptions {
  std::string config = "samples/configs/demo.toml";
  int steps = 4;
  int blocks = 8;
  int width = 64;
  int compute_us = 0;
};

// The value of element `i` of parameter `id` in pass `version`: exact in
// float, different for every parameter, element and version.
float model_value(ParameterId id, std::size_t i, int version) {
  return static_cast<float>(
             static_cast<int>((id * 7919 + i * 31 + static_cast<std::size_t>(version) * 17) %
                              2048) -
             1024) /
         8.0f;
}

struct SyntheticModel {
  struct Param {
    ParameterId id;
    std::size_t numel;
    std::string name;
  };
  struct Mod {
    ModuleId id;
    std::string name;
    std::vector<ParameterId> params;
  };
  std::vector<Param> params;
  std::vector<Mod> modules;
  std::vector<ModuleId> order;  // one forward+backward pass
};

// Token embedding (tied with the output head, so shared by two modules), then
// `blocks` transformer blocks of four weight matrices and two small norms.
SyntheticModel make_model(int blocks, int width) {
  SyntheticModel m;
  const auto w = static_cast<std::size_t>(width);
  const std::size_t vocab = 16 * w;
  ParameterId next_param = 0;
  auto add_param = [&](std::size_t numel, std::string name) {
    m.params.push_back({next_param, numel, std::move(name)});
    return next_param++;
  };
  ParameterId embedding = add_param(vocab * w, "embedding");
  m.modules.push_back({0, "embed", {embedding}});
  for (int b = 0; b < blocks; ++b) {
    std::vector<ParameterId> ps;
    ps.push_back(add_param(w * 3 * w, fmt::format("block{}.attn.qkv", b)));
    ps.push_back(add_param(w * w, fmt::format("block{}.attn.out", b)));
    ps.push_back(add_param(w * 4 * w, fmt::format("block{}.mlp.up", b)));
    ps.push_back(add_param(4 * w * w, fmt::format("block{}.mlp.down", b)));
    ps.push_back(add_param(w, fmt::format("block{}.norm1", b)));
    ps.push_back(add_param(w, fmt::format("block{}.norm2", b)));
    m.modules.push_back({static_cast<ModuleId>(b + 1), fmt::format("block{}", b), ps});
  }
  m.modules.push_back({static_cast<ModuleId>(blocks + 1), "head", {embedding}});
  for (const auto& mod : m.modules) m.order.push_back(mod.id);
  for (auto it = m.modules.rbegin(); it != m.modules.rend(); ++it) m.order.push_back(it->id);
  return m;
}

void fill(std::vector<float>& buffer, ParameterId id, std::size_t numel, int version) {
  buffer.resize(numel);
  for (std::size_t i = 0; i < numel; ++i) buffer[i] = model_value(id, i, version);
}

// Stands for device compute: the host thread is idle (it sleeps), waking up
// now and then to drive in-flight gathers for transports that need polling.
void simulate_compute(ParameterCoordinator& zero, int microseconds) {
  if (microseconds <= 0) return;
  auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(microseconds);
  for (auto now = std::chrono::steady_clock::now(); now < end;
       now = std::chrono::steady_clock::now()) {
    zero.progress();
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(end - now, std::chrono::microseconds(100)));
  }
}

int run_zero(const CliContext& context, const ZeroOptions& options) {
  if (options.steps < 1 || options.steps > 1000)
    throw Error(
        ErrorKind::invalid_argument,
        fmt::format("--steps {}: expected a number of passes from 1 to 1000", options.steps));
  if (options.blocks < 1 || options.blocks > 256)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("--blocks {}: expected from 1 to 256", options.blocks));
  if (options.width < 1 || options.width > 1024)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("--width {}: expected from 1 to 1024", options.width));
  if (options.compute_us < 0 || options.compute_us > 1000000)
    throw Error(ErrorKind::invalid_argument,
                fmt::format("--compute-us {}: expected from 0 to 1000000", options.compute_us));

  auto runtime = context.load_runtime(options.config);
  if (!runtime.has(PluginKind::zero))
    throw Error(ErrorKind::config,
                fmt::format("{}: no [zero] section; add one (e.g. coordinator = \"partitioned\")",
                            options.config));
  auto accel = runtime.get<Accelerator>();
  auto zero = runtime.get<ParameterCoordinator>();
  auto world = accel->world();
  const bool printer = world->rank() == 0;
  std::ostream& out = std::cout;

  SyntheticModel model = make_model(options.blocks, options.width);
  std::size_t total = 0;
  for (const auto& p : model.params) {
    zero->register_parameter({p.id, p.numel, DataType::f32});
    total += p.numel;
  }
  for (const auto& m : model.modules) zero->register_module(m.id, m.params);
  std::vector<float> values;
  for (const auto& p : model.params) {
    fill(values, p.id, p.numel, 0);
    zero->set_full(p.id, values.data(), values.size() * sizeof(float));
  }
  if (printer) {
    out << fmt::format("== ductile zero: {} ({} backend, {} ranks) ==\n", options.config,
                       accel->backend(), world->size());
    out << fmt::format(
        "model: {} blocks of width {}, {} parameters, {} elements; {} modules per pass "
        "(forward then backward, embedding shared with the head)\n",
        options.blocks, options.width, model.params.size(), total, model.order.size());
  }

  std::size_t persistent = 0;
  for (const auto& p : model.params) persistent += zero->is_persistent(p.id);
  std::vector<float> gathered, expected;
  CoordinatorStats before = zero->stats();
  for (int step = 0; step < options.steps; ++step) {
    const int version = step;  // shards are rewritten between passes, as an optimizer would
    auto t0 = std::chrono::steady_clock::now();
    std::size_t checked = 0;
    for (ModuleId mid : model.order) {
      zero->fetch(mid);
      for (ParameterId pid : model.modules[mid].params) {
        const auto& p = model.params[pid];
        gathered.resize(p.numel);
        zero->read_full(pid, gathered.data(), gathered.size() * sizeof(float));
        fill(expected, pid, p.numel, version);
        if (std::memcmp(gathered.data(), expected.data(), p.numel * sizeof(float)) != 0)
          throw Error(ErrorKind::internal,
                      fmt::format("zero: pass {}: gathered parameter {} ({}) differs from its "
                                  "original values",
                                  step + 1, pid, p.name));
        ++checked;
      }
      simulate_compute(*zero, options.compute_us);
      zero->release(mid);
      zero->check_invariants();
    }
    CoordinatorStats mid_pass = zero->stats();
    zero->end_step();
    double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    CoordinatorStats after = zero->stats();
    if (printer)
      out << fmt::format(
          "pass {}: trace {:<8} gathers {:>3}  demand {:>3}  prefetched {:>3}  retained {:>3}  "
          "waited {:>7.3f} ms of {:>7.3f} ms  peak live {} (limit {} + largest module {})  "
          "params checked {} ok\n",
          step + 1, to_string(mid_pass.trace_mode), after.gathers - before.gathers,
          after.demand_gathered_params - before.demand_gathered_params,
          after.prefetched_params - before.prefetched_params,
          after.retained_params - before.retained_params,
          static_cast<double>(after.fetch_wait_ns - before.fetch_wait_ns) / 1e6, ms,
          after.peak_live_numel, after.max_live_numel, after.largest_module_numel, checked);
    if (after.live_numel != 0)
      throw Error(
          ErrorKind::internal,
          fmt::format("zero: {} elements still gathered after end_step()", after.live_numel));
    before = after;
    // New shard values for the next pass.
    for (const auto& p : model.params) {
      fill(values, p.id, p.numel, version + 1);
      zero->set_full(p.id, values.data(), values.size() * sizeof(float));
    }
  }
  if (printer) {
    CoordinatorStats s = zero->stats();
    out << fmt::format(
        "total: {} gathers, {} elements gathered, {} trace invalidations, peak {} gathers in "
        "flight, {} persistent parameters (at most {} elements each, gathered once per pass "
        "because the shards change)\n",
        s.gathers, s.gathered_numel, s.trace_invalidations, s.peak_inflight_gathers, persistent,
        options.width);
    out << std::flush;
  }
  return kExitOk;
}

}  // namespace

void register_zero_command(CLI::App& app, CliContext& context) {
  auto options = std::make_shared<ZeroOptions>();
  auto* zero = app.add_subcommand(
      "zero", "Run a synthetic model through the ZeRO-3 parameter coordinator (use mpirun)");
  zero->add_option("--config", options->config, "TOML configuration file")->capture_default_str();
  zero->add_option("--steps", options->steps, "Forward+backward passes to run")
      ->capture_default_str();
  zero->add_option("--blocks", options->blocks, "Transformer blocks of the synthetic model")
      ->capture_default_str();
  zero->add_option("--width", options->width, "Hidden width of the synthetic model")
      ->capture_default_str();
  zero->add_option("--compute-us", options->compute_us,
                   "Simulated compute per module in microseconds (polls progress())")
      ->capture_default_str();
  set_action(zero, context, [&context, options] { return run_zero(context, *options); });
}

}  // namespace ductile::cli
