// Per-call latency of each elasticity policy over a sweep of configurations,
// caps 10^3 .. 2^40 (a program, not a test; build Release). Prints, for each
// policy and cap, the median and the maximum over the sweep's configurations
// of the per-configuration median call time.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "ductile/core/logging.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/elasticity_policy.hpp"

using namespace ductile;
using Clock = std::chrono::steady_clock;

namespace {

struct Sweep {
  std::vector<std::int64_t> micro;
  std::int64_t min_gpus, max_gpus, gpus_per_node;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = argc > 1 ? std::max(1, std::atoi(argv[1])) : 7;
  // Fallback warnings of v0.2 would flood the output.
  core::init_logging(std::string("error"));
  // The build tree's plugin directory (DUCTILE_PLUGIN_DIR) is the core's built-in one.
  auto runtime = core::Runtime::from_string("", "elasticity-bench");
  const std::vector<Sweep> sweeps = {
      {{2, 4, 6}, 1, 10000, 1},
      {{8, 12, 16, 17}, 32, 1500, 1},
      {{1, 2, 3, 5, 7}, 1, std::int64_t{1} << 62, 1},  // huge max_gpus
      {{4, 8}, 8, 4096, 8},                            // whole nodes
      {{6, 10, 15}, 16, 100000, 4},
  };
  const std::vector<std::pair<const char*, std::int64_t>> caps = {
      {"10^3", 1000}, {"10^6", 1000000}, {"10^9", 1000000000}, {"2^40", std::int64_t{1} << 40}};
  std::printf("%-8s %-6s %14s %14s %8s\n", "policy", "cap", "median (ms)", "max (ms)", "configs");
  for (const char* name : {"v0.1", "v0.2", "optimal"}) {
    for (const auto& [cap_name, cap] : caps) {
      std::vector<double> per_config;
      for (const auto& s : sweeps) {
        if (std::string(name) == "v0.1" && s.gpus_per_node > 1) continue;
        Params p;
        p.set("max_train_batch_size", cap);
        p.set("micro_batch_sizes", s.micro);
        p.set("min_gpus", s.min_gpus);
        p.set("max_gpus", s.max_gpus);
        p.set("num_gpus_per_node", s.gpus_per_node);
        auto policy = runtime.create<ElasticityPolicy>(name, p);
        // v0.2 needs a world size: use one of the whole-node counts.
        ElasticityRequest request;
        if (std::string(name) == "v0.2") request.world_size = s.gpus_per_node * 4;
        std::vector<double> times;
        for (int r = 0; r < repeats; ++r) {
          auto t0 = Clock::now();
          try {
            auto result = policy->compute(request);
            (void)result;
          } catch (const Error&) {
            // Some sweeps have no valid answer at small caps; still timed.
          }
          times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
        per_config.push_back(median(times));
      }
      std::printf("%-8s %-6s %14.4f %14.4f %8zu\n", name, cap_name, median(per_config),
                  *std::max_element(per_config.begin(), per_config.end()), per_config.size());
    }
  }
  return 0;
}
