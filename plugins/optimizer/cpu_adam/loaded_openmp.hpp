// The OpenMP runtime the host process has already loaded, used in place of
// the plugin's own threads.
//
// Why: torch runs its CPU operators on OpenMP (it loads libgomp.so.1), and
// libgomp's idle workers spin for milliseconds after each parallel region
// before they sleep. A step on threads of our own then shares the cores
// with workers that spin right after the forward, the backward or another
// optimizer's step: on 2 cores, a 10 M-element step took 5-20% longer than
// the same step on torch's own OpenMP workers (bench_cpu_adam.py, 2 threads,
// OMP_WAIT_POLICY unset against passive). A step on the runtime's team
// takes the spinning workers instead of competing with them, as
// DeepSpeedCPUAdam does by linking OpenMP.
//
// The plugin does not link an OpenMP runtime itself (a second copy of
// libgomp, e.g. the one a wheel would vendor, keeps a second pool of
// spinning workers): it looks the runtime up by soname without loading one
// (dlopen RTLD_NOLOAD) and calls GOMP_parallel, the entry point that
// `#pragma omp parallel` compiles to in GCC, which libgomp (GCC 4.9 and
// later) and LLVM's libomp both export.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "work_pool.hpp"

namespace ductile::cpu_adam {

class LoadedOpenMP {
 public:
  // The runtime this process has loaded, or null when it has none (a
  // process that never loaded torch or another OpenMP user). The runtime
  // is marked never to be unloaded (RTLD_NODELETE): its workers outlive
  // this object.
  static std::unique_ptr<LoadedOpenMP> find();

  // The sonames find() looks for, for messages: "libgomp.so.1, ...".
  static std::string searched();

  ~LoadedOpenMP();
  LoadedOpenMP(const LoadedOpenMP&) = delete;
  LoadedOpenMP& operator=(const LoadedOpenMP&) = delete;

  // Calls chunk(context, i) once for every i in [0, count) on a team of up
  // to `threads` threads of the runtime, the caller included, and returns
  // when every call has returned (their writes are then visible to the
  // caller). Thread-safe: each calling thread gets a team of its own; a
  // call from inside another parallel region runs on the caller alone
  // (OpenMP's default for nested regions).
  void run(std::size_t count, Chunk chunk, const void* context, std::size_t threads) const;

  // The soname found, e.g. "libgomp.so.1".
  const std::string& soname() const { return soname_; }

 private:
  using Parallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
  LoadedOpenMP(void* handle, Parallel parallel, std::string soname);

  void* handle_;
  Parallel parallel_;
  std::string soname_;
};

}  // namespace ductile::cpu_adam
