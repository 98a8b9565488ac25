// Device buffers for gathered copies, reused by size. A trace gathers the
// same parameters every pass, so after the first pass no gather allocates:
// on cuda, cudaMalloc/cudaFree synchronise the device (and the memory is
// invisible to torch's caching allocator); on the cpu, fresh pages of large
// buffers cost a page fault each (glibc maps them anew every time).
//
// A buffer given back is kept idle for a later request of the same size
// while that size's buffers (in use and idle) stay within the most of that
// size ever in use at once, and the idle bytes within four times the
// high-water mark of the bytes in use; beyond either, it is freed at once.
// In a trace that repeats, each size keeps the buffers its busiest moment
// needs, so no gather allocates after the first pass; the extra memory is
// at most one busiest set per size (a few layers' worth in a transformer).
//
// Resting (rest(), the host only): once a pass has issued its last gather,
// no idle buffer is taken before the next pass, and the end of a backward
// is where a step holds the most (the embedding's gradients, the last
// reduce-scatters). On the host an idle buffer's pages are then given back
// to the system (madvise MADV_DONTNEED) while its address stays in the
// pool: the memory serves the model meanwhile, and the next pass maps the
// pages anew, once a pass, against a buffer's worth of resident memory held
// through the backward's peak. A rested buffer taken again is populated in
// one call (madvise MADV_POPULATE_WRITE, Linux 5.14 and later; else its
// pages fault one at a time as it is written) before its gather is issued:
// page by page, the faults fell inside the gather's receive, on the
// communicator's thread, and both ranks waited for them (the race's gather
// wait was 58-63 ms a step that way, 25-31 ms populated). The accounting
// (idle_bytes, allocations) is unchanged. A device buffer stays as it is:
// freeing it would synchronise the device.
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
  // Until the next take(): on the host, the idle buffers' pages and those
  // of buffers given meanwhile go back to the system (see above); on a
  // device, nothing.
  void rest() noexcept;

  GatherMemoryStats stats() const { return stats_; }

 private:
  struct Idle {
    void* pointer;
    bool rested;  // its pages were given back: populated when taken
  };
  struct SizeClass {
    std::vector<Idle> idle;
    std::size_t in_use = 0;
    std::size_t most_in_use = 0;
  };
  static void drop_pages(void* pointer, std::size_t bytes) noexcept;
  static void populate(void* pointer, std::size_t bytes) noexcept;

  std::shared_ptr<Accelerator> accel_;
  bool host_ = accel_->backend() == "cpu";  // buffers of host memory
  bool resting_ = false;
  std::unordered_map<std::size_t, SizeClass> sizes_;
  GatherMemoryStats stats_;
};

}  // namespace ductile::zero
