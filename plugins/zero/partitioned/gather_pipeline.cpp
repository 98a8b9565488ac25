// The gather pipeline of the partitioned coordinator; see gather_pipeline.hpp.
#include "gather_pipeline.hpp"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "ductile/error.hpp"
#include "wait_clock.hpp"

namespace ductile::zero {
namespace {

MemoryKind memory_of(ShardLocation where) {
  return where == ShardLocation::host ? MemoryKind::pinned_host : MemoryKind::device;
}

}  // namespace

GatherPipeline::GatherPipeline(std::shared_ptr<Accelerator> accel,
                               std::shared_ptr<Communicator> comm, NvmeReadAhead* nvme)
    : accel_(std::move(accel)), comm_(std::move(comm)), nvme_(nvme), pool_(accel_) {
  world_ = static_cast<std::size_t>(comm_->size());
  comm_stream_ = accel_->create_stream();
  copy_stream_ = accel_->create_stream();
}

GatherPipeline::~GatherPipeline() {
  // The coordinator retires every gather first; what is left failed.
  for (auto& b : batches_) {
    try {
      finish(b);
    } catch (...) {
    }
  }
  try {
    check_ordered(true);
  } catch (...) {
  }
  ordered_.clear();
  try {
    if (compute_stream_) compute_stream_->synchronize();
    comm_stream_->synchronize();
    copy_stream_->synchronize();
  } catch (...) {
  }
  for (auto& b : batches_) unstage(b.staging);
  if (own_staged_) unstage(own_);
  for (auto& f : pending_frees_) pool_.give(f.pointer, f.bytes);
  pending_frees_.clear();
  for (std::uint32_t pi = 0; pi < params_.size(); ++pi) {
    auto& p = params_[pi];
    if (p.full) pool_.give(p.full, shard_bytes(pi) * world_);
    if (p.shard) accel_->deallocate(p.shard, memory_of(p.location));
  }
  pool_.trim();
}

void GatherPipeline::add_parameter(std::uint32_t pi, std::span<const std::size_t> member_numels,
                                   DataType type, ShardLocation where) {
  if (params_.size() <= pi) params_.resize(pi + 1);
  DeviceParameter& p = params_[pi];
  p.members.clear();
  p.shard_numel = 0;
  for (std::size_t numel : member_numels) {
    const std::size_t shard = (numel + world_ - 1) / world_;
    p.members.push_back({numel, shard, p.shard_numel});
    p.shard_numel += shard;
  }
  p.element_size = size_of(type);
  p.type = type;
  p.location = where;
  if (where == ShardLocation::device) {
    p.shard = accel_->allocate(shard_bytes(pi), MemoryKind::device);
    accel_->memset_async(p.shard, 0, shard_bytes(pi), *copy_stream_);
    copy_stream_->synchronize();
  } else if (where == ShardLocation::host) {
    p.shard = accel_->allocate(shard_bytes(pi), MemoryKind::pinned_host);
    std::memset(p.shard, 0, shard_bytes(pi));
    ++host_shards_;
  }
}

void GatherPipeline::write_shard(std::uint32_t pi, const void* host, std::size_t bytes) {
  if (params_[pi].location == ShardLocation::host) {
    if (bytes) std::memcpy(params_[pi].shard, host, bytes);
    return;
  }
  accel_->copy_async(params_[pi].shard, host, bytes, CopyKind::host_to_device, *copy_stream_);
  copy_stream_->synchronize();
}

void GatherPipeline::read_shard(std::uint32_t pi, void* host, std::size_t bytes) {
  if (params_[pi].location == ShardLocation::host) {
    if (bytes) std::memcpy(host, params_[pi].shard, bytes);
    return;
  }
  accel_->copy_async(host, params_[pi].shard, bytes, CopyKind::device_to_host, *copy_stream_);
  copy_stream_->synchronize();
}

void GatherPipeline::move_shard(std::uint32_t pi, ShardLocation where) {
  DeviceParameter& p = params_[pi];
  if (p.location == where) return;
  const std::size_t bytes = shard_bytes(pi);
  void* moved = accel_->allocate(bytes, memory_of(where));
  try {
    // The shard may have been written on the compute stream (an optimizer
    // step) or be read by its work still.
    if (compute_stream_) compute_stream_->synchronize();
    accel_->copy_async(
        moved, p.shard, bytes,
        where == ShardLocation::host ? CopyKind::device_to_host : CopyKind::host_to_device,
        *copy_stream_);
    copy_stream_->synchronize();
  } catch (...) {
    accel_->deallocate(moved, memory_of(where));
    throw;
  }
  accel_->deallocate(p.shard, memory_of(p.location));
  if (where == ShardLocation::host) ++host_shards_;
  if (p.location == ShardLocation::host) --host_shards_;
  p.shard = moved;
  p.location = where;
}

void GatherPipeline::slice_full(std::uint32_t pi, int rank, const unsigned char* full,
                                unsigned char* shard) const {
  const DeviceParameter& p = params_[pi];
  const std::size_t es = p.element_size;
  std::size_t at = 0;  // the member's first element in `full`
  for (const Member& m : p.members) {
    unsigned char* out = shard + m.offset * es;
    const std::size_t first = static_cast<std::size_t>(rank) * m.shard;
    const std::size_t count = first < m.numel ? std::min(m.shard, m.numel - first) : 0;
    if (count) std::memcpy(out, full + (at + first) * es, count * es);
    std::memset(out + count * es, 0, (m.shard - count) * es);
    at += m.numel;
  }
}

void GatherPipeline::read_full(std::uint32_t pi, void* host, std::size_t bytes) {
  const DeviceParameter& p = params_[pi];
  if (compute_stream_) compute_stream_->synchronize();
  auto* out = static_cast<unsigned char*>(host);
  const auto* full = static_cast<const unsigned char*>(p.full);
  std::size_t done = 0;
  for (const Member& m : p.members) {
    const std::size_t n = std::min(m.numel * p.element_size, bytes - done);
    accel_->copy_async(out + done, full + world_ * m.offset * p.element_size, n,
                       CopyKind::device_to_host, *copy_stream_);
    done += n;
  }
  copy_stream_->synchronize();
}

void GatherPipeline::stage_own(std::span<const std::uint32_t> params) {
  if (own_staged_) {
    unstage(own_);
    own_staged_ = false;
  }
  if (all_on_device() || params.empty()) return;  // nothing to stage, nothing can fail
  stage(params, own_);
  own_staged_ = true;
}

void GatherPipeline::stage(std::span<const std::uint32_t> params, Staging& out) {
  out.sources.clear();
  if (all_on_device()) {  // nothing to read, nothing can fail
    for (std::uint32_t pi : params) out.sources.push_back(params_[pi].shard);
    return;
  }
  out.clear();
  try {
    for (std::uint32_t pi : params) {
      const DeviceParameter& p = params_[pi];
      if (p.location == ShardLocation::device) {
        out.sources.push_back(p.shard);
        continue;
      }
      const void* host = p.location == ShardLocation::host ? p.shard : nvme_->take(pi, out.shards);
      const std::size_t bytes = shard_bytes(pi);
      void* device = pool_.take(bytes);
      out.device.push_back({device, bytes});
      accel_->copy_async(device, host, bytes, CopyKind::host_to_device, *comm_stream_);
      out.sources.push_back(device);
    }
  } catch (...) {
    unstage(out);
    throw;
  }
}

void GatherPipeline::unstage(Staging& staging) {
  if (!staging.device.empty() || !staging.shards.slots.empty() ||
      !staging.shards.host_temp.empty()) {
    try {
      comm_stream_->synchronize();
    } catch (...) {
    }
  }
  for (const DeviceCopy& d : staging.device) pool_.give(d.pointer, d.bytes);
  if (nvme_) nvme_->give_back(staging.shards);
  staging.clear();
}

void GatherPipeline::execute(const Plan& plan, Planner& planner, bool timed) {
  for (std::size_t k = 0; k < plan.steps.size(); ++k) {
    const Step& s = plan.steps[k];
    switch (s.kind) {
      case StepKind::retire:
        timing_ = timed;
        retire_through(s.gather);
        timing_ = false;
        break;
      case StepKind::free:
        free_copy(s.param);
        break;
      case StepKind::gather: {
        Batch& b = batches_.emplace_back();
        if (!spare_.empty()) {
          std::swap(b.staging, spare_.back());  // reuses a retired gather's capacity
          spare_.pop_back();
        }
        b.id = s.gather;
        try {
          auto which = plan.gather_params(s);
          if (!s.prefetch && own_staged_) {
            if (own_.sources.size() != which.size())
              throw Error(ErrorKind::internal,
                          fmt::format("zero: {} shards staged for a gather of {} parameters",
                                      own_.sources.size(), which.size()));
            std::swap(b.staging, own_);
            own_staged_ = false;
          } else {
            stage(which, b.staging);
          }
          issue(plan, s, b);
        } catch (...) {
          unstage(b.staging);
          batches_.pop_back();
          // Nothing of this gather was issued: the planner takes it back,
          // with the later gathers of the plan, newest first.
          for (std::size_t j = plan.steps.size(); j-- > k;)
            if (plan.steps[j].kind == StepKind::gather) planner.cancel_gather(plan.steps[j].gather);
          for (std::size_t j = k + 1; j < plan.steps.size(); ++j)
            if (plan.steps[j].kind == StepKind::retire) retire_through(plan.steps[j].gather);
          throw;
        }
        if (compute_stream_) {
          b.event = accel_->create_event();
          b.event->record(*comm_stream_);
        }
        break;
      }
    }
  }
}

// Takes the gathered copies from the pool and issues the coalesced gather
// (on failure the copies taken so far go back). With a compute stream, the
// first gather after a pass ended or a shard changed starts after the work
// enqueued on it so far: the shards it reads may have been written there
// (an optimizer step). Later gathers of the pass need not wait for it.
void GatherPipeline::issue(const Plan& plan, const Step& step, Batch& b) {
  auto which = plan.gather_params(step);
  items_.clear();
  std::size_t k = 0;
  try {
    for (; k < which.size(); ++k) {
      DeviceParameter& p = params_[which[k]];
      p.full = pool_.take(shard_bytes(which[k]) * world_);
      const auto* source = static_cast<const unsigned char*>(b.staging.sources[k]);
      auto* full = static_cast<unsigned char*>(p.full);
      for (const Member& m : p.members)
        items_.push_back(GatherItem{source + m.offset * p.element_size,
                                    full + world_ * m.offset * p.element_size, m.shard, p.type});
    }
    if (compute_stream_ && order_after_compute_) {
      if (!compute_done_) compute_done_ = accel_->create_event();
      compute_done_->record(*compute_stream_);
      comm_stream_->wait_event(*compute_done_);
      order_after_compute_ = false;
    }
    b.handle = comm_->all_gather_coalesced(items_, *comm_stream_);
  } catch (...) {
    for (std::size_t j = 0; j < k; ++j) {
      pool_.give(params_[which[j]].full, shard_bytes(which[j]) * world_);
      params_[which[j]].full = nullptr;
    }
    throw;
  }
}

void GatherPipeline::finish(Batch& b) {
  if (b.done) return;
  const bool staged = !b.staging.device.empty() || !b.staging.shards.slots.empty() ||
                      !b.staging.shards.host_temp.empty();
  if (compute_stream_ && b.event && !staged) {
    // The device orders the compute stream after the gather; the host goes on.
    compute_stream_->wait_event(*b.event);
    ordered_.push_back({std::move(b.handle)});
    b.done = true;
    return;
  }
  if (timing_) {
    auto t0 = WaitClock::now();
    b.handle->wait();
    wait_ns += elapsed_ns(t0);
  } else {
    b.handle->wait();
  }
  if (compute_stream_ && b.event) compute_stream_->wait_event(*b.event);
  for (const DeviceCopy& d : b.staging.device) pool_.give(d.pointer, d.bytes);
  b.staging.device.clear();
  if (nvme_) nvme_->give_back(b.staging.shards);
  b.done = true;
}

void GatherPipeline::retire_through(std::uint64_t id) {
  while (!batches_.empty() && batches_.front().id <= id) {
    Batch& b = batches_.front();
    finish(b);
    b.staging.clear();
    spare_.push_back(std::move(b.staging));  // keeps its capacity for the next gather
    batches_.pop_front();
  }
}

void GatherPipeline::poll(Planner& planner) {
  for (auto& b : batches_) {
    if (b.done) continue;
    if (!b.handle->query()) break;
    finish(b);
    planner.complete(b.id);
  }
}

void GatherPipeline::free_copies(const Plan& plan) {
  for (const Step& s : plan.steps) {
    if (s.kind != StepKind::free)
      throw Error(ErrorKind::internal, "zero: a release plan holds a step other than a free");
    free_copy(s.param);
  }
}

void GatherPipeline::free_copy(std::uint32_t pi) {
  DeviceParameter& p = params_[pi];
  const std::size_t bytes = shard_bytes(pi) * world_;
  if (compute_stream_) {
    std::shared_ptr<Event> ev;
    if (!spare_events_.empty()) {
      ev = std::move(spare_events_.back());
      spare_events_.pop_back();
    } else {
      ev = accel_->create_event();
    }
    ev->record(*compute_stream_);
    pending_frees_.push_back({p.full, bytes, std::move(ev)});
  } else {
    pool_.give(p.full, bytes);
  }
  p.full = nullptr;
}

void GatherPipeline::check_ordered(bool all) {
  while (!ordered_.empty()) {
    CollectiveHandle& handle = *ordered_.front().handle;
    if (all) {
      handle.wait();
    } else if (!handle.query()) {
      return;
    }
    ordered_.pop_front();
  }
}

void GatherPipeline::reap_frees() {
  check_ordered(false);
  while (!pending_frees_.empty() && pending_frees_.front().event->query()) {
    PendingFree& f = pending_frees_.front();
    pool_.give(f.pointer, f.bytes);
    spare_events_.push_back(std::move(f.event));
    pending_frees_.pop_front();
  }
}

void GatherPipeline::set_compute_stream(std::shared_ptr<Stream> stream) {
  if (compute_stream_ && compute_stream_ != stream) {
    compute_stream_->synchronize();
    reap_frees();
  }
  compute_stream_ = std::move(stream);
}

void GatherPipeline::check_invariants(const Planner& planner) const {
  auto fail = [](const std::string& what) {
    throw Error(ErrorKind::internal, "zero: invariant violated: " + what);
  };
  for (std::uint32_t pi = 0; pi < params_.size(); ++pi) {
    const auto status = planner.status(pi);
    const bool gathered = status != ParameterStatus::not_available;
    if (gathered && !params_[pi].full)
      fail(fmt::format("parameter {} is {} without a buffer", planner.parameter_id(pi),
                       to_string(status)));
    if (!gathered && params_[pi].full)
      fail(fmt::format("parameter {} is not available but holds a buffer",
                       planner.parameter_id(pi)));
  }
  if (batches_.size() != planner.outstanding_gathers())
    fail(fmt::format("the pipeline holds {} gathers, the planner {}", batches_.size(),
                     planner.outstanding_gathers()));
}

}  // namespace ductile::zero
