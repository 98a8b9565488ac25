// The pool of gathered copies; see copy_pool.hpp.
#include "copy_pool.hpp"

#include <algorithm>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace ductile::zero {

CopyPool::~CopyPool() {
  trim();
}

void* CopyPool::take(std::size_t bytes) {
  resting_ = false;
  SizeClass& size = sizes_[bytes];
  void* pointer = nullptr;
  if (!size.idle.empty()) {
    const Idle idle = size.idle.back();
    size.idle.pop_back();
    pointer = idle.pointer;
    if (idle.rested) populate(pointer, bytes);
    stats_.idle_bytes -= bytes;
    ++stats_.reuses;
  } else {
    pointer = accel_->allocate(bytes, MemoryKind::device);
    ++stats_.allocations;
  }
  ++size.in_use;
  size.most_in_use = std::max(size.most_in_use, size.in_use);
  stats_.in_use_bytes += bytes;
  stats_.high_water_bytes = std::max(stats_.high_water_bytes, stats_.in_use_bytes);
  return pointer;
}

void CopyPool::give(void* pointer, std::size_t bytes) noexcept {
  stats_.in_use_bytes -= bytes;
  auto it = sizes_.find(bytes);
  SizeClass* size = it != sizes_.end() ? &it->second : nullptr;
  if (size) --size->in_use;
  const bool keep = size && size->in_use + size->idle.size() < size->most_in_use &&
                    stats_.idle_bytes + bytes <= 4 * stats_.high_water_bytes;
  if (keep) {
    try {
      size->idle.push_back({pointer, resting_});
      stats_.idle_bytes += bytes;
      if (resting_) drop_pages(pointer, bytes);
      return;
    } catch (...) {  // no memory for the list: free it instead
    }
  }
  accel_->deallocate(pointer, MemoryKind::device);
  ++stats_.frees;
}

void CopyPool::rest() noexcept {
  if (!host_ || resting_) return;
  resting_ = true;
  for (auto& [bytes, size] : sizes_)
    for (Idle& idle : size.idle) {
      if (!idle.rested) drop_pages(idle.pointer, bytes);
      idle.rested = true;
    }
}

#if defined(__linux__)
namespace {

// madvise on the whole pages of a buffer. Pages the buffer shares with the
// heap's other chunks (its first and last, partly) are left alone.
void advise_whole_pages(void* pointer, std::size_t bytes, int advice) noexcept {
  static const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<std::uintptr_t>(pointer);
  const std::uintptr_t first = (start + page - 1) / page * page;
  const std::uintptr_t last = (start + bytes) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, advice);
}

}  // namespace
#endif

void CopyPool::drop_pages(void* pointer, std::size_t bytes) noexcept {
#if defined(__linux__)
  // Private anonymous pages (the accelerator's aligned_alloc): the next
  // touch maps a zeroed page, and a gather writes its buffer whole before
  // anything reads it.
  advise_whole_pages(pointer, bytes, MADV_DONTNEED);
#else
  (void)pointer;
  (void)bytes;
#endif
}

// Where the kernel lacks MADV_POPULATE_WRITE the call fails and the pages
// fault as they are written, as before.
void CopyPool::populate(void* pointer, std::size_t bytes) noexcept {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  advise_whole_pages(pointer, bytes, MADV_POPULATE_WRITE);
#else
  (void)pointer;
  (void)bytes;
#endif
}

void CopyPool::trim() noexcept {
  for (auto& [bytes, size] : sizes_) {
    for (const Idle& idle : size.idle) {
      accel_->deallocate(idle.pointer, MemoryKind::device);
      ++stats_.frees;
    }
    stats_.idle_bytes -= bytes * size.idle.size();
    size.idle.clear();
  }
}

}  // namespace ductile::zero
