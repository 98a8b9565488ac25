// A pool of worker threads that share the chunks of one or more jobs with
// the threads that submitted them. run() hands its chunks to the pool and
// works on them itself, so a job progresses even while every worker serves
// another job, and concurrent jobs share the workers (first come, first
// served) instead of each starting threads of its own.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace ductile::cpu_adam {

// The function a run calls for each chunk: chunk(context, index). It must
// not throw.
using Chunk = void (*)(const void* context, std::size_t index);

// The chunks [0, count) of one run, claimed in turn by every thread that
// works on it (the pool's, or an OpenMP team's: loaded_openmp.hpp), so that
// a thread slowed by others on its core leaves its share to the rest.
struct ChunkQueue {
  ChunkQueue(std::size_t n, Chunk f, const void* c) : count(n), chunk(f), context(c) {}

  const std::size_t count;
  const Chunk chunk;
  const void* const context;
  std::atomic<std::size_t> next{0};

  // Runs chunks until none is left unclaimed; thread-safe.
  void drain() {
    for (;;) {
      const std::size_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= count) return;
      chunk(context, i);
    }
  }
};

class WorkPool {
 public:
  // Starts `workers` threads (0: run() works alone on the caller's thread).
  explicit WorkPool(std::size_t workers);
  // Stops and joins the workers; no run() may be in flight.
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  // Calls chunk(context, i) once for every i in [0, count), on the caller's
  // thread and at most `threads - 1` of the pool's, and returns when every
  // call has returned (their writes are then visible to the caller).
  // Thread-safe.
  void run(std::size_t count, Chunk chunk, const void* context, std::size_t threads);

  std::size_t workers() const { return threads_.size(); }

 private:
  struct Job : ChunkQueue {
    Job(std::size_t n, Chunk f, const void* c, std::size_t helpers)
        : ChunkQueue(n, f, c), max_workers(helpers) {}
    const std::size_t max_workers;   // workers that may join
    std::size_t workers_inside = 0;  // guarded by mutex_
  };

  void retire(Job& job);  // takes the job off the queue; mutex_ held
  Job* open_job();        // the first job a worker may join, or null; mutex_ held
  void work();

  std::mutex mutex_;
  std::condition_variable wake_;  // a job was queued, or stop_
  std::condition_variable left_;  // a worker left a job
  std::deque<Job*> jobs_;         // jobs with chunks not yet claimed
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace ductile::cpu_adam
