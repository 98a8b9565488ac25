// NVMe read-ahead buffers of the partitioned coordinator; see nvme_read_ahead.hpp.
#include "nvme_read_ahead.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "ductile/error.hpp"
#include "wait_clock.hpp"

namespace ductile::zero {

NvmeReadAhead::NvmeReadAhead(std::shared_ptr<Accelerator> accel, std::unique_ptr<NvmeStore> store,
                             std::size_t buffer_count)
    : accel_(std::move(accel)), store_(std::move(store)), buffer_count_(buffer_count) {}

NvmeReadAhead::~NvmeReadAhead() {
  store_.reset();  // joins the I/O thread before its buffers go away
  for (auto& s : slots_) accel_->deallocate(s.host, MemoryKind::pinned_host);
}

bool NvmeReadAhead::add_parameter(std::uint32_t pi, std::uint64_t id, std::size_t bytes) {
  if (shards_.size() <= pi) shards_.resize(pi + 1);
  shards_[pi] = Shard{id, bytes, true, -1};
  return bytes > slot_bytes_ && !slots_.empty();
}

void NvmeReadAhead::ensure_buffers() {
  if (!slots_.empty()) return;
  for (const auto& s : shards_)
    if (s.on_nvme) slot_bytes_ = std::max(slot_bytes_, s.bytes);
  if (slot_bytes_ == 0) return;
  slots_.resize(buffer_count_);
  for (auto& s : slots_) s.host = accel_->allocate(slot_bytes_, MemoryKind::pinned_host);
}

void NvmeReadAhead::free_buffers() {
  for (auto& s : slots_) {
    if (s.param != kNone) {
      try {
        if (s.job) store_->wait(*s.job);
      } catch (const Error&) {
        // Abandoned read; reported again if the shard is fetched.
      }
      shards_[s.param].slot = -1;
    }
    accel_->deallocate(s.host, MemoryKind::pinned_host);
  }
  slots_.clear();
  slot_bytes_ = 0;
}

void NvmeReadAhead::drop_slot(std::int32_t s) {
  Slot& slot = slots_[static_cast<std::size_t>(s)];
  if (slot.job && !slot.job->done.load(std::memory_order_acquire)) {
    try {
      store_->wait(*slot.job);
    } catch (const Error&) {
      // The read is abandoned; a later fetch reads again and reports it.
    }
  }
  shards_[slot.param].slot = -1;
  slot.param = kNone;
  slot.job.reset();
  slot.bound = false;
}

void NvmeReadAhead::read_ahead(const Planner& planner) {
  ensure_buffers();
  std::size_t free_count = 0;
  for (const auto& s : slots_) free_count += s.param == kNone;
  if (free_count == 0) return;
  // Look a bounded distance ahead so the scan stays cheap.
  auto upcoming = planner.upcoming();
  const std::size_t window = std::min(upcoming.size(), 4 * buffer_count_ + 16);
  for (std::size_t q = 0; q < window && free_count > 0; ++q) {
    const std::uint32_t pi = upcoming[q].param;
    if (pi >= shards_.size()) continue;
    Shard& shard = shards_[pi];
    if (!shard.on_nvme || shard.slot >= 0 || planner.status(pi) != ParameterStatus::not_available)
      continue;
    std::size_t s = 0;
    while (slots_[s].param != kNone) ++s;
    Slot& slot = slots_[s];
    slot.param = pi;
    slot.bound = false;
    slot.job = store_->submit(shard.id, slot.host, shard.bytes);
    shard.slot = static_cast<std::int32_t>(s);
    ++reads;
    ++prefetch_reads;
    --free_count;
  }
}

const void* NvmeReadAhead::take(std::uint32_t pi, StagedShards& staged) {
  Shard& shard = shards_[pi];
  if (shard.slot >= 0) {
    Slot& slot = slots_[static_cast<std::size_t>(shard.slot)];
    auto t0 = WaitClock::now();
    try {
      store_->wait(*slot.job);
    } catch (...) {
      drop_slot(shard.slot);
      throw;
    }
    wait_ns += elapsed_ns(t0);
    slot.bound = true;
    staged.slots.push_back(shard.slot);
    return slot.host;
  }
  void* temp = accel_->allocate(shard.bytes, MemoryKind::pinned_host);
  try {
    auto t0 = WaitClock::now();
    store_->read(shard.id, temp, shard.bytes);
    wait_ns += elapsed_ns(t0);
  } catch (...) {
    accel_->deallocate(temp, MemoryKind::pinned_host);
    throw;
  }
  ++reads;
  staged.host_temp.push_back(temp);
  return temp;
}

void NvmeReadAhead::give_back(StagedShards& staged) {
  for (void* h : staged.host_temp) accel_->deallocate(h, MemoryKind::pinned_host);
  for (std::int32_t s : staged.slots) drop_slot(s);
  staged.host_temp.clear();
  staged.slots.clear();
}

void NvmeReadAhead::drop(std::uint32_t pi) {
  if (pi < shards_.size() && shards_[pi].slot >= 0) drop_slot(shards_[pi].slot);
}

void NvmeReadAhead::drop_unbound() {
  for (std::size_t s = 0; s < slots_.size(); ++s)
    if (slots_[s].param != kNone && !slots_[s].bound) drop_slot(static_cast<std::int32_t>(s));
}

std::size_t NvmeReadAhead::buffers_in_use() const {
  std::size_t n = 0;
  for (const auto& s : slots_) n += s.param != kNone;
  return n;
}

void NvmeReadAhead::check_invariants(const Planner& planner) const {
  std::size_t in_use = 0;
  for (std::size_t s = 0; s < slots_.size(); ++s) {
    if (slots_[s].param == kNone) continue;
    ++in_use;
    if (shards_[slots_[s].param].slot != static_cast<std::int32_t>(s))
      throw Error(ErrorKind::internal,
                  fmt::format("zero: invariant violated: NVMe buffer {} names parameter {} which "
                              "does not name it back",
                              s, planner.parameter_id(slots_[s].param)));
  }
  if (in_use > buffer_count_)
    throw Error(ErrorKind::internal,
                fmt::format("zero: invariant violated: {} NVMe buffers in use, more than "
                            "nvme_buffer_count {}",
                            in_use, buffer_count_));
}

}  // namespace ductile::zero
