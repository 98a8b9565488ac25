// Device buffers for gathered copies, reused by size. A trace gathers the
// same parameters every pass, so after the first pass no gather allocates:
// on cuda, cudaMalloc/cudaFree synchronise the device (and the memory is
// invisible to torch's caching allocator); on the cpu, fresh pages of large
// buffers cost a page fault each (glibc maps them anew every time).
//
// A buffer given back is kept idle for a later request of the same size
// while the idle bytes stay within the high-water mark of the bytes in use;
// beyond it, it is freed at once. So the pool never holds more than twice
// the largest set of copies alive at once, and in a steady trace no more
// than that set.
//
// The caller gives a buffer back only once its last use has completed (the
// gather pipeline defers that until the compute stream has passed the
// release: record_stream semantics).
//
// Threading: the coordinator's thread. Ownership: owns idle buffers; the
// destructor frees them (buffers in use must have been given back).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "ductile/accelerator.hpp"
#include "ductile/parameter_coordinator.hpp"

namespace ductile::zero {

class CopyPool {
 public:
  explicit CopyPool(std::shared_ptr<Accelerator> accel) : accel_(std::move(accel)) {}
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // A buffer of `bytes` bytes of device memory (an idle one when there is).
  void* take(std::size_t bytes);
  // `pointer` (from take(bytes)) is no longer used.
  void give(void* pointer, std::size_t bytes) noexcept;
  // Frees every idle buffer.
  void trim() noexcept;

  GatherMemoryStats stats() const { return stats_; }

 private:
  std::shared_ptr<Accelerator> accel_;
  std::unordered_map<std::size_t, std::vector<void*>> idle_;
  GatherMemoryStats stats_;
};

}  // namespace ductile::zero
