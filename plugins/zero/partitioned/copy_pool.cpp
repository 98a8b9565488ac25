// The pool of gathered copies; see copy_pool.hpp.
#include "copy_pool.hpp"

#include <algorithm>

namespace ductile::zero {

CopyPool::~CopyPool() {
  trim();
}

void* CopyPool::take(std::size_t bytes) {
  void* pointer = nullptr;
  auto it = idle_.find(bytes);
  if (it != idle_.end() && !it->second.empty()) {
    pointer = it->second.back();
    it->second.pop_back();
    stats_.idle_bytes -= bytes;
    ++stats_.reuses;
  } else {
    pointer = accel_->allocate(bytes, MemoryKind::device);
    ++stats_.allocations;
  }
  stats_.in_use_bytes += bytes;
  stats_.high_water_bytes = std::max(stats_.high_water_bytes, stats_.in_use_bytes);
  return pointer;
}

void CopyPool::give(void* pointer, std::size_t bytes) noexcept {
  stats_.in_use_bytes -= bytes;
  if (stats_.idle_bytes + bytes > stats_.high_water_bytes) {
    accel_->deallocate(pointer, MemoryKind::device);
    ++stats_.frees;
    return;
  }
  try {
    idle_[bytes].push_back(pointer);
  } catch (...) {  // no memory for the list: free it instead
    accel_->deallocate(pointer, MemoryKind::device);
    ++stats_.frees;
    return;
  }
  stats_.idle_bytes += bytes;
}

void CopyPool::trim() noexcept {
  for (auto& [bytes, list] : idle_) {
    for (void* p : list) {
      accel_->deallocate(p, MemoryKind::device);
      ++stats_.frees;
    }
    stats_.idle_bytes -= bytes * list.size();
    list.clear();
  }
  idle_.clear();
}

}  // namespace ductile::zero
