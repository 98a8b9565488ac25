// Shared by the cpu_adam tests: the plugin with given parameters, and the
// instruction sets this CPU can run it with.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ductile/core/runtime.hpp"
#include "ductile/optimizer.hpp"

namespace ductile::test {

inline core::Runtime& cpu_adam_runtime() {
  static core::Runtime runtime = [] {
    core::RuntimeOptions options;
    options.extra_plugin_dirs.emplace_back(DUCTILE_PLUGIN_DIR);
    return core::Runtime::from_string("", "cpu_adam test", options);
  }();
  return runtime;
}

inline std::shared_ptr<Optimizer> cpu_adam(const std::string& simd = "auto",
                                           std::int64_t threads = 1,
                                           const std::string& threading = "auto") {
  Params params;
  params.set("simd", simd);
  params.set("threads", threads);
  params.set("threading", threading);
  return cpu_adam_runtime().create<Optimizer>("cpu_adam", params);
}

// "scalar" first, then avx2 and avx512 where this CPU has them.
inline std::vector<std::string> available_simd() {
  std::vector<std::string> out;
  for (const char* simd : {"scalar", "avx2", "avx512"}) {
    try {
      cpu_adam(simd);
      out.emplace_back(simd);
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::unsupported) throw;
    }
  }
  return out;
}

}  // namespace ductile::test
