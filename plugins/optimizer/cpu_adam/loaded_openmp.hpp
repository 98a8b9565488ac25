// The OpenMP runtime the host process has already loaded, used in place of
// the plugin's own pool.
//
// Why OpenMP: torch runs its CPU operators on OpenMP (it loads libgomp.so.1),
// and libgomp's idle workers spin after each parallel region before they
// sleep: up to GOMP_SPINCOUNT (300,000) pauses, milliseconds, unless the
// process has more OpenMP threads than CPUs, when libgomp spins 100 times
// only (GCC's manual, GOMP_SPINCOUNT). A step on a pool of our own would
// share the cores with workers that spin right after the forward, the
// backward or another optimizer's step. The plugin does not link an OpenMP
// runtime itself (a second copy of libgomp, e.g. the one a wheel would
// vendor, keeps a second set of spinning workers): it looks the runtime up
// by soname without loading one (dlopen RTLD_NOLOAD) and calls
// GOMP_parallel, the entry point that `#pragma omp parallel` compiles to in
// GCC, which libgomp (GCC 4.9 and later) and LLVM's libomp both export.
//
// Why the plugin also keeps an idle team of its own: libgomp's idle
// workers spin their full count only while the process has no more OpenMP
// threads than CPUs, and torch's team alone (its N threads on N cores) is
// just that. Its idle workers then hold the cores for milliseconds after
// every operator while the caller runs Python between operators (an
// engine's hooks, gathers, bookkeeping): on 2 cores with another process
// busy, a one-rank ZeRO-3 step with optimizer offload took 0.76-1.8 s where
// OMP_WAIT_POLICY=passive gave 0.06 s, nearly all of it in libgomp's spin
// loops (perf). prepare() starts a thread of ours that leads one empty
// region of two threads and then waits: its team stays (the runtime keeps
// a thread's pool while the thread lives), a process whose torch runs on
// every core has more OpenMP threads than cores, and every pool's idle
// workers, torch's included, spin briefly and sleep. (DeepSpeed's processes get there by chance:
// gloo's work thread runs a torch copy, which makes a pool of its own.) The
// steps themselves still run on the caller's team: handing each to a
// thread of ours cost a wake-up per step, 0.6-0.95x DeepSpeed's speed at 2
// threads on a loaded machine.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

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

  // Ends the idle team of prepare(), if any.
  ~LoadedOpenMP();
  LoadedOpenMP(const LoadedOpenMP&) = delete;
  LoadedOpenMP& operator=(const LoadedOpenMP&) = delete;

  // Starts the idle team (see above) unless it runs already; returns when
  // it exists. Called when steps will use more than one thread: with one,
  // no worker is idle to spin. Thread-safe.
  void prepare();

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

  std::mutex mutex_;
  std::condition_variable changed_;  // the idle team exists, or stop_
  bool idle_team_ = false;           // guarded by mutex_
  bool stop_ = false;                // guarded by mutex_
  std::thread idle_leader_;          // started by prepare()
};

}  // namespace ductile::cpu_adam
