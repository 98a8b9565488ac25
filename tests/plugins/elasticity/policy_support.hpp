// Helpers shared by the elasticity policy tests: the real plugins, created
// through the core with explicit parameters or from a TOML text.
#pragma once

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "ductile/core/runtime.hpp"
#include "ductile/elasticity_policy.hpp"

namespace ductile::test {

inline core::Runtime& plugin_runtime() {
  static core::Runtime runtime = [] {
    // The build tree's plugin directory (DUCTILE_PLUGIN_DIR) is the core's
    // built-in one.
    return core::Runtime::from_string("", "elasticity-tests");
  }();
  return runtime;
}

struct ElasticConfig {
  std::int64_t cap = 2000;
  std::vector<std::int64_t> micro = {2, 4, 6};
  std::int64_t min_gpus = 1;
  std::int64_t max_gpus = 10000;
  std::int64_t gpus_per_node = 1;
  std::int64_t model_parallel = 1;
  bool prefer_larger = true;

  Params params() const {
    Params p;
    p.set("max_train_batch_size", cap);
    p.set("micro_batch_sizes", micro);
    p.set("min_gpus", min_gpus);
    p.set("max_gpus", max_gpus);
    p.set("num_gpus_per_node", gpus_per_node);
    p.set("model_parallel_size", model_parallel);
    p.set("prefer_larger_batch", prefer_larger);
    return p;
  }
};

inline std::shared_ptr<ElasticityPolicy> make_policy(const std::string& name,
                                                     const ElasticConfig& config) {
  return plugin_runtime().create<ElasticityPolicy>(name, config.params());
}

// The error a call throws: its type() and message (empty type = no error).
struct Thrown {
  std::string type;
  std::string message;
  ErrorKind kind = ErrorKind::internal;
};
template <class F>
Thrown thrown_by(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return {e.type(), e.what(), e.kind()};
  }
  return {};
}

// n in [lo, hi] is valid for `batch` when some micro batch m has m * n | batch.
inline bool count_is_valid(std::int64_t batch, const std::vector<std::int64_t>& micro,
                           std::int64_t n) {
  for (auto m : micro)
    if (batch % m == 0 && (batch / m) % n == 0) return true;
  return false;
}

// Every valid count of `batch` in [lo, hi], by trying each n (small inputs only).
inline std::vector<std::int64_t> brute_valid_counts(std::int64_t batch,
                                                    const std::vector<std::int64_t>& micro,
                                                    std::int64_t lo, std::int64_t hi) {
  std::vector<std::int64_t> out;
  for (std::int64_t n = lo; n <= hi && n <= batch; ++n)
    if (count_is_valid(batch, micro, n)) out.push_back(n);
  return out;
}

}  // namespace ductile::test
