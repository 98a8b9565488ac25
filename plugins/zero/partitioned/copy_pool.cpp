// The pool of gathered copies; see copy_pool.hpp.
#include "copy_pool.hpp"

#include <algorithm>

namespace ductile::zero {

CopyPool::~CopyPool() {
  trim();
}

void* CopyPool::take(std::size_t bytes) {
  SizeClass& size = sizes_[bytes];
  void* pointer = nullptr;
  if (!size.idle.empty()) {
    pointer = size.idle.back();
    size.idle.pop_back();
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
      size->idle.push_back(pointer);
      stats_.idle_bytes += bytes;
      return;
    } catch (...) {  // no memory for the list: free it instead
    }
  }
  accel_->deallocate(pointer, MemoryKind::device);
  ++stats_.frees;
}

void CopyPool::trim() noexcept {
  for (auto& [bytes, size] : sizes_) {
    for (void* p : size.idle) {
      accel_->deallocate(p, MemoryKind::device);
      ++stats_.frees;
    }
    stats_.idle_bytes -= bytes * size.idle.size();
    size.idle.clear();
  }
}

}  // namespace ductile::zero
