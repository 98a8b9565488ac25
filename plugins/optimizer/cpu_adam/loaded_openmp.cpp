#include "loaded_openmp.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <climits>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

namespace ductile::cpu_adam {

namespace {

// libgomp (GCC; torch's wheels carry one), LLVM's libomp, Intel's.
constexpr const char* kSonames[] = {"libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so"};

// What every thread of the team runs.
void drain(void* queue) {
  static_cast<ChunkQueue*>(queue)->drain();
}

// The chunks of the idle team's one region: the team is made, nothing is
// computed.
void no_work(const void*, std::size_t) {}

}  // namespace

std::unique_ptr<LoadedOpenMP> LoadedOpenMP::find() {
  for (const char* soname : kSonames) {
    // RTLD_NODELETE: once a step has run on its workers the runtime stays
    // loaded for good. Its idle workers live on in its code; unloading it
    // when the last holder lets go (as a test that loaded it itself may)
    // would pull the code from under them.
    void* handle = dlopen(soname, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD | RTLD_NODELETE);
    if (handle == nullptr) continue;
    if (void* parallel = dlsym(handle, "GOMP_parallel"))
      return std::unique_ptr<LoadedOpenMP>(
          new LoadedOpenMP(handle, reinterpret_cast<Parallel>(parallel), soname));
    dlclose(handle);
  }
  return nullptr;
}

std::string LoadedOpenMP::searched() {
  std::string out;
  for (const char* soname : kSonames) out += (out.empty() ? "" : ", ") + std::string(soname);
  return out;
}

LoadedOpenMP::LoadedOpenMP(void* handle, Parallel parallel, std::string soname)
    : handle_(handle), parallel_(parallel), soname_(std::move(soname)) {}

LoadedOpenMP::~LoadedOpenMP() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  changed_.notify_all();
  // Its team goes with it: the runtime frees a thread's pool as it exits.
  if (idle_leader_.joinable()) idle_leader_.join();
  dlclose(handle_);  // drops our reference; RTLD_NODELETE keeps the code mapped
}

void LoadedOpenMP::prepare() {
  std::unique_lock lock(mutex_);
  if (idle_leader_.joinable()) return;
  idle_leader_ = std::thread([this] {
#if defined(__linux__)
    prctl(PR_SET_NAME, "ductile-adam", 0, 0, 0);
#endif
    ChunkQueue nothing(2, &no_work, nullptr);
    parallel_(&drain, &nothing, 2, 0);
    std::unique_lock held(mutex_);
    idle_team_ = true;
    changed_.notify_all();
    changed_.wait(held, [&] { return stop_; });
  });
  changed_.wait(lock, [&] { return idle_team_; });
}

void LoadedOpenMP::run(std::size_t count, Chunk chunk, const void* context,
                       std::size_t threads) const {
  ChunkQueue queue(count, chunk, context);
  const std::size_t team_size = std::min({count, threads, std::size_t{UINT_MAX}});
  if (team_size <= 1) return queue.drain();
  // GOMP_parallel(fn, data, num_threads, flags): runs fn(data) on the team,
  // the caller as thread 0, and returns after the region's closing barrier.
  parallel_(&drain, &queue, static_cast<unsigned>(team_size), 0);
}

}  // namespace ductile::cpu_adam
