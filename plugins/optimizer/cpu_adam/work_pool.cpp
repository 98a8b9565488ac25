#include "work_pool.hpp"

#include <algorithm>

namespace ductile::cpu_adam {

WorkPool::WorkPool(std::size_t workers) {
  threads_.reserve(workers);
  for (std::size_t i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
}

WorkPool::~WorkPool() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkPool::retire(Job& job) {
  auto it = std::find(jobs_.begin(), jobs_.end(), &job);
  if (it != jobs_.end()) jobs_.erase(it);
}

WorkPool::Job* WorkPool::open_job() {
  for (Job* job : jobs_)
    if (job->workers_inside < job->max_workers) return job;
  return nullptr;
}

void WorkPool::run(std::size_t count, Chunk chunk, const void* context, std::size_t threads) {
  // Workers beyond the chunks left for them would only wake to find none.
  const std::size_t helpers =
      std::min({threads_.size(), count - std::min<std::size_t>(count, 1), threads - 1});
  Job job(count, chunk, context, helpers);
  if (threads == 0 || helpers == 0) return job.drain();
  {
    std::lock_guard lock(mutex_);
    jobs_.push_back(&job);
  }
  if (helpers == threads_.size())
    wake_.notify_all();
  else
    for (std::size_t i = 0; i < helpers; ++i) wake_.notify_one();
  job.drain();
  // Every chunk is claimed; those claimed by workers are done once no
  // worker is inside the job (a worker enters under the mutex, before it
  // claims anything, and leaves after its last chunk returned).
  std::unique_lock lock(mutex_);
  retire(job);
  left_.wait(lock, [&] { return job.workers_inside == 0; });
}

void WorkPool::work() {
  std::unique_lock lock(mutex_);
  for (;;) {
    Job* job = nullptr;
    wake_.wait(lock, [&] { return stop_ || (job = open_job()) != nullptr; });
    if (stop_) return;
    ++job->workers_inside;
    lock.unlock();
    job->drain();
    lock.lock();
    retire(*job);
    if (--job->workers_inside == 0) left_.notify_all();
  }
}
}  // namespace ductile::cpu_adam
