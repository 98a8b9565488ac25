// The "partitioned" ZeRO-3 parameter coordinator: DeepSpeed's
// PartitionedParameterCoordinator re-created over the ductile Accelerator
// interface, with exact live-element accounting, release decisions computed
// fresh on every call (no stale memo), one warning per distinct trace
// deviation, a configurable bound on in-flight gathers, and rank-order checks
// that never leave a rank waiting in a mismatched collective.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <fmt/format.h>
#include <spdlog/logger.h>

#include "ductile/accelerator.hpp"
#include "ductile/parameter_coordinator.hpp"
#include "ductile/plugin.hpp"
#include "nvme_store.hpp"

namespace ductile::zero {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::uint32_t kNone = 0xffffffffu;
// Prefetches of consecutive modules share one gather until it holds this
// many elements; larger modules get a gather each.
constexpr std::size_t kMinGatherNumel = 32768;

std::uint64_t elapsed_ns(Clock::time_point since) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count());
}

// A whole, non-negative number of elements from a [zero] key given as integer
// or float (DeepSpeed writes 5e7).
std::size_t element_count(const Params& params, const char* key) {
  double v = params.get_double(key);
  if (!std::isfinite(v) || v < 0 || v != std::floor(v) || v > 9.0e18)
    throw Error(ErrorKind::config,
                fmt::format("[zero] {} = {}: expected a whole number of elements >= 0", key, v));
  return static_cast<std::size_t>(v);
}

struct Parameter {
  ParameterInfo info;
  std::size_t shard_numel = 0;
  std::size_t element_size = 0;
  bool persistent = false;
  bool on_nvme = false;
  ParameterStatus status = ParameterStatus::not_available;
  void* shard = nullptr;  // device memory (not on NVMe)
  void* full = nullptr;   // gathered copy, world * shard_numel elements
  // Gather that brought it and that no call has retired yet (0: none).
  // Retiring depends only on the sequence of calls, never on timing, so
  // every rank takes the same decisions from it.
  std::uint64_t batch = 0;
  std::vector<std::uint32_t> users;  // fetched modules using it (indices)
  // Trace bookkeeping (complete trace only).
  std::vector<std::int64_t> uses;     // steps of the trace that use it, ascending
  std::int64_t fetched_through = -1;  // latest trace step whose use a gather covers
  std::int32_t slot = -1;             // NVMe read-ahead buffer holding its shard
  std::uint64_t chosen = 0;           // prefetch round that picked it

  std::size_t shard_bytes() const { return shard_numel * element_size; }
};

struct Module {
  ModuleId id = 0;
  std::vector<std::uint32_t> params;  // indices, sorted by parameter id
  std::size_t numel = 0;
  bool active = false;
};

// One coalesced all-gather in flight.
struct Batch {
  std::uint64_t id = 0;
  bool done = false;  // completed (parameters available), not yet retired
  std::shared_ptr<CollectiveHandle> handle;
  std::shared_ptr<Event> event;  // recorded after the gather (when a compute stream is set)
  std::vector<std::uint32_t> params;
  std::vector<void*> staging;       // device copies of NVMe shards, freed on completion
  std::vector<void*> host_temp;     // pinned buffers of synchronous NVMe reads
  std::vector<std::int32_t> slots;  // read-ahead buffers to give back
};

// A read-ahead buffer for NVMe shards.
struct Slot {
  void* host = nullptr;  // pinned host memory
  std::uint32_t param = kNone;
  std::shared_ptr<ReadJob> job;
  bool bound = false;  // its data is the source of an issued gather
};

struct PendingFree {
  void* pointer;
  std::shared_ptr<Event> event;
};

constexpr std::int64_t kTokenFetch = 1;
constexpr std::int64_t kTokenEnd = 2;

class PartitionedCoordinator final : public ParameterCoordinator {
 public:
  explicit PartitionedCoordinator(const HostContext& ctx) : logger_(ctx.logger()) {
    const Params& p = ctx.params();
    prefetch_bucket_ = element_count(p, "prefetch_bucket_size");
    max_live_ = element_count(p, "max_live_parameters");
    max_reuse_ = element_count(p, "max_reuse_distance");
    persistence_threshold_ = element_count(p, "param_persistence_threshold");
    max_ongoing_ = static_cast<std::size_t>(p.get_int("max_ongoing_fetch_events"));
    nvme_buffer_count_ = static_cast<std::size_t>(p.get_int("nvme_buffer_count"));
    nvme_path_ = p.get_string("nvme_path");

    accel_ = ctx.require<Accelerator>();
    if (!accel_)
      throw Error(ErrorKind::config, "[zero] requires an accelerator; none is configured");
    comm_ = accel_->world();
    rank_ = comm_->rank();
    world_ = comm_->size();
    comm_stream_ = accel_->create_stream();
    copy_stream_ = accel_->create_stream();
    if (!nvme_path_.empty()) nvme_ = std::make_unique<NvmeStore>(nvme_path_, rank_);
  }

  ~PartitionedCoordinator() override {
    try {
      drain();
    } catch (const std::exception& e) {
      logger_->error("zero: a gather failed during shutdown: {}", e.what());
    }
    nvme_.reset();  // joins the I/O thread before its buffers go away
    try {
      if (compute_stream_) compute_stream_->synchronize();
      comm_stream_->synchronize();
      copy_stream_->synchronize();
    } catch (...) {
    }
    for (auto& f : pending_frees_) accel_->deallocate(f.pointer, MemoryKind::device);
    for (auto& p : params_) {
      if (p.full) accel_->deallocate(p.full, MemoryKind::device);
      if (p.shard) accel_->deallocate(p.shard, MemoryKind::device);
    }
    for (auto& s : slots_) accel_->deallocate(s.host, MemoryKind::pinned_host);
  }

  // --- Registration ---

  void register_parameter(const ParameterInfo& info) override {
    if (param_index_.count(info.id))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: parameter {} is already registered", info.id));
    if (info.numel == 0)
      throw Error(
          ErrorKind::invalid_argument,
          fmt::format("zero: parameter {} has 0 elements; a parameter needs at least 1", info.id));
    std::size_t esize = size_of(info.type);
    if (esize == 0)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: parameter {} has an unknown element type {}", info.id,
                              static_cast<unsigned>(info.type)));
    Parameter p;
    p.info = info;
    p.element_size = esize;
    p.shard_numel =
        (info.numel + static_cast<std::size_t>(world_) - 1) / static_cast<std::size_t>(world_);
    p.persistent = info.numel <= persistence_threshold_;
    p.on_nvme = nvme_ && !p.persistent;
    if (p.on_nvme) {
      if (p.shard_bytes() > slot_bytes_ && !slots_.empty()) {
        // Larger buffers are needed: let the current ones go (reallocated lazily).
        drain();
        free_slots();
      }
      nvme_->create(info.id, p.shard_bytes());
      ++nvme_writes_;
    } else {
      p.shard = accel_->allocate(p.shard_bytes(), MemoryKind::device);
      accel_->memset_async(p.shard, 0, p.shard_bytes(), *copy_stream_);
      copy_stream_->synchronize();
    }
    param_index_.emplace(info.id, static_cast<std::uint32_t>(params_.size()));
    params_.push_back(std::move(p));
  }

  void register_module(ModuleId id, std::span<const ParameterId> parameters) override {
    if (module_index_.count(id))
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: module {} is already registered", id));
    Module m;
    m.id = id;
    std::vector<ParameterId> ids(parameters.begin(), parameters.end());
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (ParameterId pid : ids) {
      auto it = param_index_.find(pid);
      if (it == param_index_.end())
        throw Error(
            ErrorKind::invalid_argument,
            fmt::format("zero: module {} uses parameter {}, which is not registered", id, pid));
      m.params.push_back(it->second);
      m.numel += params_[it->second].info.numel;
    }
    largest_module_ = std::max(largest_module_, m.numel);
    module_index_.emplace(id, static_cast<std::uint32_t>(modules_.size()));
    modules_.push_back(std::move(m));
  }

  // --- Shard data ---

  std::size_t shard_numel(ParameterId id) const override {
    return params_[index_of(id)].shard_numel;
  }

  void set_shard(ParameterId id, const void* host_data, std::size_t bytes) override {
    std::uint32_t i = index_of(id);
    Parameter& p = params_[i];
    check_bytes("set_shard", p, bytes, p.shard_bytes(), "shard_numel() * element size");
    if (bytes && !host_data)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: set_shard({}) got a null pointer", id));
    if (!p.users.empty())
      throw Error(ErrorKind::incompatible,
                  fmt::format("zero: set_shard({}): the parameter is in use by fetched module {}; "
                              "set its shard after release()",
                              id, modules_[p.users.front()].id));
    if (p.batch != 0) retire_through(p.batch);
    if (p.status == ParameterStatus::available) free_copy(i);
    if (p.slot >= 0) drop_slot(p.slot);
    if (p.on_nvme) {
      nvme_->write(id, host_data, bytes);
      ++nvme_writes_;
    } else {
      accel_->copy_async(p.shard, host_data, bytes, CopyKind::host_to_device, *copy_stream_);
      copy_stream_->synchronize();
    }
  }

  void set_full(ParameterId id, const void* host_data, std::size_t bytes) override {
    const Parameter& p = params_[index_of(id)];
    check_bytes("set_full", p, bytes, p.info.numel * p.element_size, "numel * element size");
    if (bytes && !host_data)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: set_full({}) got a null pointer", id));
    std::vector<unsigned char> shard(p.shard_bytes(), 0);
    std::size_t first = static_cast<std::size_t>(rank_) * p.shard_numel;
    if (first < p.info.numel) {
      std::size_t count = std::min(p.shard_numel, p.info.numel - first);
      std::memcpy(shard.data(),
                  static_cast<const unsigned char*>(host_data) + first * p.element_size,
                  count * p.element_size);
    }
    set_shard(id, shard.data(), shard.size());
  }

  void read_shard(ParameterId id, void* host_out, std::size_t bytes) override {
    const Parameter& p = params_[index_of(id)];
    check_bytes("read_shard", p, bytes, p.shard_bytes(), "shard_numel() * element size");
    if (bytes && !host_out)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: read_shard({}) got a null pointer", id));
    if (p.on_nvme) {
      nvme_->read(id, host_out, bytes);
      ++nvme_reads_;
    } else {
      accel_->copy_async(host_out, p.shard, bytes, CopyKind::device_to_host, *copy_stream_);
      copy_stream_->synchronize();
    }
  }

  // --- The training loop ---

  void fetch(ModuleId module_id) override {
    std::uint32_t mi = module_of(module_id);
    Module& m = modules_[mi];
    if (m.active)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: fetch({}): the module is already fetched; release() it first",
                              module_id));
    reap_frees();
    const auto step = static_cast<std::int64_t>(step_);

    if (mode_ == TraceMode::complete) {
      if (step_ >= trace_.size())
        deviate(fmt::format("step {}: module {} fetched but the trace ends after {} modules", step_,
                            module_id, trace_.size()));
      else if (trace_[step_] != mi)
        deviate(fmt::format("step {}: expected module {} but module {} was fetched", step_,
                            modules_[trace_[step_]].id, module_id));
    }
    const bool recording = mode_ == TraceMode::record;
    if (recording) {
      exchange_token({kTokenFetch, static_cast<std::int64_t>(module_id), step, 0});
      recorded_.push_back(mi);
    }
    const std::uint64_t previous_hash = pass_hash_;
    pass_hash_ = mix(pass_hash_, module_id);

    // The module's own parameters: mark them used, gather what is missing.
    use_module(mi);
    demand_.clear();
    for (std::uint32_t pi : m.params)
      if (params_[pi].status == ParameterStatus::not_available) demand_.push_back(pi);
    if (!demand_.empty()) {
      try {
        issue_gather(demand_);
      } catch (...) {
        // Nothing was issued (an NVMe read failed): undo, so the call can be retried.
        unuse_module(mi);
        pass_hash_ = previous_hash;
        if (recording) recorded_.pop_back();
        throw;
      }
      demand_params_ += demand_.size();
    }
    // Wait only for the gathers that bring this module's parameters.
    for (std::uint32_t pi : m.params) {
      Parameter& p = params_[pi];
      if (p.batch != 0) {
        auto t0 = Clock::now();
        retire_through(p.batch);
        fetch_wait_ns_ += elapsed_ns(t0);
      }
      if (p.status != ParameterStatus::available)
        throw Error(ErrorKind::internal, fmt::format("zero: parameter {} is {} after fetch({})",
                                                     p.info.id, to_string(p.status), module_id));
    }

    if (mode_ == TraceMode::complete) {
      // Uses up to this step are now covered.
      while (queue_pos_ < queue_.size() && queue_[queue_pos_].step <= step) {
        const auto& e = queue_[queue_pos_++];
        auto& ft = params_[e.param].fetched_through;
        ft = std::max(ft, e.step);
      }
      prefetch();
      if (nvme_) read_ahead();
    }
    ++step_;
    note_peaks();
  }

  void release(ModuleId module_id) override {
    std::uint32_t mi = module_of(module_id);
    Module& m = modules_[mi];
    if (!m.active)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: release({}): the module is not fetched", module_id));
    unuse_module(mi);
    const auto next = static_cast<std::int64_t>(step_);
    keep_.clear();
    for (std::uint32_t pi : m.params) {
      Parameter& p = params_[pi];
      if (p.persistent || !p.users.empty() || p.status != ParameterStatus::available) continue;
      // Now idle.
      if (mode_ != TraceMode::complete) {
        free_copy(pi);
        continue;
      }
      std::int64_t next_use = next_use_of(p, next);
      bool prefetched_for_later = p.fetched_through >= next;
      bool reused_soon = next_use >= 0 && prefix_numel_[static_cast<std::size_t>(next_use)] -
                                                  prefix_numel_[static_cast<std::size_t>(next)] <
                                              max_reuse_;
      if ((prefetched_for_later || reused_soon) && next_use >= 0)
        keep_.push_back({next_use, pi});
      else
        free_copy(pi);
    }
    if (!keep_.empty()) {
      // Keep the ones needed soonest while the idle copies fit the limit.
      std::sort(keep_.begin(), keep_.end());
      while (!keep_.empty() && idle_numel_ > max_live_) {
        free_copy(keep_.back().second);
        keep_.pop_back();
      }
      retained_params_ += keep_.size();
    }
    note_peaks();
  }

  void end_step() override {
    if (active_modules_ != 0) {
      std::vector<ModuleId> still;
      for (const auto& m : modules_)
        if (m.active) still.push_back(m.id);
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: end_step() while module(s) {} are still fetched; release them "
                              "first",
                              fmt::join(still, ", ")));
    }
    if (mode_ == TraceMode::complete && step_ != trace_.size())
      deviate(fmt::format("step {}: the pass ended but the trace has {} modules (next: module {})",
                          step_, trace_.size(), modules_[trace_[step_]].id));
    drain();
    // Every rank must have run the same pass: same length, same order.
    exchange_token(
        {kTokenEnd, static_cast<std::int64_t>(step_), static_cast<std::int64_t>(pass_hash_), 0});
    if (mode_ == TraceMode::record && !recorded_.empty()) {
      freeze_trace();
      logger_->debug("zero: trace recorded ({} modules, {} parameter uses)", trace_.size(),
                     queue_.size());
    }
    free_idle(false);
    recorded_.clear();
    step_ = 0;
    queue_pos_ = 0;
    pass_hash_ = 0;
    for (auto& p : params_) p.fetched_through = -1;
    ++passes_;
    reap_frees();
  }

  void release_all(bool include_persistent) override {
    drain();
    free_idle(include_persistent);
  }

  void progress() override {
    reap_completed_batches();
    reap_frees();
  }

  void set_compute_stream(std::shared_ptr<Stream> stream) override {
    if (compute_stream_ && compute_stream_ != stream) {
      compute_stream_->synchronize();
      reap_frees();
    }
    compute_stream_ = std::move(stream);
  }

  // --- Queries ---

  ParameterStatus status(ParameterId id) const override { return params_[index_of(id)].status; }

  std::vector<ModuleId> active_modules(ParameterId id) const override {
    std::vector<ModuleId> out;
    for (std::uint32_t mi : params_[index_of(id)].users) out.push_back(modules_[mi].id);
    std::sort(out.begin(), out.end());
    return out;
  }

  bool is_persistent(ParameterId id) const override { return params_[index_of(id)].persistent; }

  void* full_data(ParameterId id) override {
    Parameter& p = params_[index_of(id)];
    require_available("full_data", p);
    return p.full;
  }

  void read_full(ParameterId id, void* host_out, std::size_t bytes) override {
    Parameter& p = params_[index_of(id)];
    check_bytes("read_full", p, bytes, p.info.numel * p.element_size, "numel * element size");
    require_available("read_full", p);
    if (bytes && !host_out)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: read_full({}) got a null pointer", id));
    if (compute_stream_) compute_stream_->synchronize();
    accel_->copy_async(host_out, p.full, bytes, CopyKind::device_to_host, *copy_stream_);
    copy_stream_->synchronize();
  }

  TraceMode trace_mode() const override { return mode_; }

  std::vector<ModuleId> trace() const override {
    std::vector<ModuleId> out;
    for (std::uint32_t mi : trace_) out.push_back(modules_[mi].id);
    return out;
  }

  CoordinatorStats stats() const override {
    CoordinatorStats s;
    s.trace_mode = mode_;
    s.trace_length = trace_.size();
    s.step = step_;
    s.passes = passes_;
    s.live_numel = live_numel_;
    s.idle_numel = idle_numel_;
    s.active_numel = active_numel_;
    s.persistent_numel = persistent_numel_;
    s.peak_live_numel = peak_live_;
    s.peak_idle_numel = peak_idle_;
    s.max_live_numel = max_live_;
    s.largest_module_numel = largest_module_;
    s.gathers = gathers_;
    s.demand_gathered_params = demand_params_;
    s.prefetched_params = prefetched_params_;
    s.gathered_numel = gathered_numel_;
    s.inflight_gathers = batches_.size();
    s.peak_inflight_gathers = peak_inflight_;
    s.released_params = released_params_;
    s.retained_params = retained_params_;
    s.fetch_wait_ns = fetch_wait_ns_;
    s.trace_invalidations = invalidations_;
    s.trace_warnings = warnings_;
    s.nvme_reads = nvme_reads_;
    s.nvme_prefetch_reads = nvme_prefetch_reads_;
    s.nvme_writes = nvme_writes_;
    for (const auto& slot : slots_)
      if (slot.param != kNone) ++s.nvme_buffers_in_use;
    return s;
  }

  void check_invariants() const override {
    auto fail = [](const std::string& what) {
      throw Error(ErrorKind::internal, "zero: invariant violated: " + what);
    };
    std::size_t live = 0, idle = 0, active = 0, persistent = 0;
    for (std::uint32_t i = 0; i < params_.size(); ++i) {
      const Parameter& p = params_[i];
      bool gathered = p.status != ParameterStatus::not_available;
      if (gathered && !p.full)
        fail(fmt::format("parameter {} is {} without a buffer", p.info.id, to_string(p.status)));
      if (!gathered && p.full)
        fail(fmt::format("parameter {} is not available but holds a buffer", p.info.id));
      if (p.persistent) {
        if (gathered) persistent += p.info.numel;
      } else if (gathered) {
        live += p.info.numel;
        (p.users.empty() ? idle : active) += p.info.numel;
      }
      for (std::uint32_t mi : p.users) {
        const Module& m = modules_[mi];
        if (!m.active)
          fail(fmt::format("parameter {} is used by module {}, which is not fetched", p.info.id,
                           m.id));
        if (!std::binary_search(m.params.begin(), m.params.end(), i,
                                [&](std::uint32_t a, std::uint32_t b) {
                                  return params_[a].info.id < params_[b].info.id;
                                }))
          fail(
              fmt::format("parameter {} lists module {} as a user but is not one of its parameters",
                          p.info.id, m.id));
      }
      if (p.status == ParameterStatus::inflight || p.batch != 0) {
        int found = 0;
        for (const auto& b : batches_)
          if (b.id == p.batch)
            found += static_cast<int>(std::count(b.params.begin(), b.params.end(), i));
        if (found != 1)
          fail(fmt::format("{} parameter {} is in {} outstanding gathers", to_string(p.status),
                           p.info.id, found));
      }
    }
    for (const auto& m : modules_)
      if (m.active)
        for (std::uint32_t pi : m.params)
          if (std::find(params_[pi].users.begin(), params_[pi].users.end(),
                        static_cast<std::uint32_t>(&m - modules_.data())) ==
              params_[pi].users.end())
            fail(fmt::format("fetched module {} is missing from the users of parameter {}", m.id,
                             params_[pi].info.id));
    for (const auto& b : batches_)
      for (std::uint32_t pi : b.params)
        if (params_[pi].batch != b.id ||
            params_[pi].status != (b.done ? ParameterStatus::available : ParameterStatus::inflight))
          fail(fmt::format("gather {} ({}) holds parameter {} which is {}", b.id,
                           b.done ? "completed" : "in flight", params_[pi].info.id,
                           to_string(params_[pi].status)));
    if (live != live_numel_)
      fail(fmt::format("live elements counted {} but the parameters sum to {}", live_numel_, live));
    if (idle != idle_numel_)
      fail(fmt::format("idle elements counted {} but the parameters sum to {}", idle_numel_, idle));
    if (active != active_numel_)
      fail(fmt::format("active elements counted {} but the parameters sum to {}", active_numel_,
                       active));
    if (persistent != persistent_numel_)
      fail(fmt::format("persistent elements counted {} but the parameters sum to {}",
                       persistent_numel_, persistent));
    if (idle > max_live_)
      fail(fmt::format("idle elements {} exceed max_live_parameters {}", idle, max_live_));
    if (live > max_live_ + active)
      fail(fmt::format("live elements {} exceed max_live_parameters {} + fetched elements {}", live,
                       max_live_, active));
    if (batches_.size() > max_ongoing_)
      fail(fmt::format("{} gathers in flight, more than max_ongoing_fetch_events {}",
                       batches_.size(), max_ongoing_));
    std::size_t in_use = 0;
    for (std::size_t s = 0; s < slots_.size(); ++s) {
      if (slots_[s].param == kNone) continue;
      ++in_use;
      if (params_[slots_[s].param].slot != static_cast<std::int32_t>(s))
        fail(fmt::format("NVMe buffer {} names parameter {} which does not name it back", s,
                         params_[slots_[s].param].info.id));
    }
    if (in_use > nvme_buffer_count_)
      fail(fmt::format("{} NVMe buffers in use, more than nvme_buffer_count {}", in_use,
                       nvme_buffer_count_));
  }

 private:
  struct QueueEntry {
    std::uint32_t param;
    std::int64_t step;
  };

  static std::uint64_t mix(std::uint64_t h, std::uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
  }

  std::uint32_t index_of(ParameterId id) const {
    auto it = param_index_.find(id);
    if (it == param_index_.end())
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: parameter {} is not registered", id));
    return it->second;
  }

  std::uint32_t module_of(ModuleId id) const {
    auto it = module_index_.find(id);
    if (it == module_index_.end())
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: module {} is not registered", id));
    return it->second;
  }

  static void check_bytes(const char* call, const Parameter& p, std::size_t bytes,
                          std::size_t expected, const char* what) {
    if (bytes != expected)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: {}({}) got {} bytes, expected {} ({})", call, p.info.id, bytes,
                              expected, what));
  }

  static void require_available(const char* call, const Parameter& p) {
    if (p.status != ParameterStatus::available)
      throw Error(ErrorKind::incompatible,
                  fmt::format("zero: {}({}): the parameter is {}; fetch a module using it first",
                              call, p.info.id, to_string(p.status)));
  }

  // Adds a fetched module to the users of its parameters, moving their
  // elements from idle to active.
  void use_module(std::uint32_t mi) {
    Module& m = modules_[mi];
    m.active = true;
    ++active_modules_;
    for (std::uint32_t pi : m.params) {
      Parameter& p = params_[pi];
      if (p.users.empty() && !p.persistent && p.status != ParameterStatus::not_available) {
        idle_numel_ -= p.info.numel;
        active_numel_ += p.info.numel;
      }
      p.users.push_back(mi);
    }
  }

  void unuse_module(std::uint32_t mi) {
    Module& m = modules_[mi];
    m.active = false;
    --active_modules_;
    for (std::uint32_t pi : m.params) {
      Parameter& p = params_[pi];
      auto it = std::find(p.users.begin(), p.users.end(), mi);
      if (it != p.users.end()) p.users.erase(it);
      if (p.users.empty() && !p.persistent && p.status != ParameterStatus::not_available) {
        active_numel_ -= p.info.numel;
        idle_numel_ += p.info.numel;
      }
    }
  }

  void note_peaks() {
    peak_live_ = std::max(peak_live_, live_numel_);
    peak_idle_ = std::max(peak_idle_, idle_numel_);
  }

  // Rank-order check: every rank contributes what it is doing; all ranks see
  // all contributions and so throw the same error.
  void exchange_token(std::array<std::int64_t, 4> mine) {
    if (world_ == 1) return;
    std::vector<std::int64_t> all(4 * static_cast<std::size_t>(world_));
    comm_->all_gather(mine.data(), all.data(), 4, DataType::i64, *comm_stream_)->wait();
    bool same = true;
    for (int r = 1; r < world_ && same; ++r)
      same = std::equal(all.begin(), all.begin() + 4, all.begin() + 4 * r);
    if (same) return;
    auto describe = [&](int r) {
      const std::int64_t* t = all.data() + 4 * r;
      if (t[0] == kTokenFetch)
        return fmt::format("rank {} fetch(module {}) at step {}", r, t[1], t[2]);
      return fmt::format("rank {} end_step() after {} modules", r, t[1]);
    };
    bool all_end = true;
    for (int r = 0; r < world_; ++r)
      all_end = all_end && all[4 * r] == kTokenEnd && all[4 * r + 1] == all[1];
    if (all_end) {
      // Same length, different order: compare the orders themselves.
      const std::size_t n = static_cast<std::size_t>(all[1]);
      std::vector<std::int64_t> order(n), orders(n * static_cast<std::size_t>(world_));
      for (std::size_t s = 0; s < n; ++s)
        order[s] = static_cast<std::int64_t>(
            modules_[mode_ == TraceMode::record ? recorded_[s] : trace_[s]].id);
      comm_->all_gather(order.data(), orders.data(), n, DataType::i64, *comm_stream_)->wait();
      for (std::size_t s = 0; s < n; ++s) {
        std::vector<std::string> parts;
        bool differ = false;
        for (int r = 0; r < world_; ++r) {
          parts.push_back(fmt::format("rank {} module {}", r, orders[r * n + s]));
          differ = differ || orders[r * n + s] != orders[s];
        }
        if (differ)
          throw Error(
              ErrorKind::communication,
              fmt::format("zero: ranks recorded different module orders; first difference at "
                          "step {}: {}",
                          s, fmt::join(parts, ", ")),
              "ZeroTraceMismatch");
      }
    }
    std::vector<std::string> parts;
    for (int r = 0; r < world_; ++r) parts.push_back(describe(r));
    throw Error(ErrorKind::communication,
                fmt::format("zero: rank-order mismatch, the ranks made different calls: {}",
                            fmt::join(parts, ", ")),
                "ZeroTraceMismatch");
  }

  // A pass left the complete trace: drain, warn once per distinct deviation,
  // record again from here (the steps so far matched the trace).
  void deviate(const std::string& what) {
    ++invalidations_;
    if (warned_.insert(what).second) {
      ++warnings_;
      if (rank_ == 0)
        logger_->warn(
            "zero: the module order deviates from the recorded trace at {}; "
            "re-recording (warned once per distinct deviation)",
            what);
    }
    drain();
    free_idle(false);
    recorded_.assign(trace_.begin(),
                     trace_.begin() + static_cast<std::ptrdiff_t>(std::min(step_, trace_.size())));
    trace_.clear();
    queue_.clear();
    queue_pos_ = 0;
    prefix_numel_.clear();
    for (auto& p : params_) {
      p.uses.clear();
      p.fetched_through = -1;
    }
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].param != kNone && !slots_[s].bound) drop_slot(static_cast<std::int32_t>(s));
    mode_ = TraceMode::record;
  }

  void freeze_trace() {
    trace_ = recorded_;
    queue_.clear();
    prefix_numel_.assign(trace_.size() + 1, 0);
    for (auto& p : params_) p.uses.clear();
    for (std::size_t s = 0; s < trace_.size(); ++s) {
      const Module& m = modules_[trace_[s]];
      prefix_numel_[s + 1] = prefix_numel_[s] + m.numel;
      for (std::uint32_t pi : m.params) {
        queue_.push_back({pi, static_cast<std::int64_t>(s)});
        params_[pi].uses.push_back(static_cast<std::int64_t>(s));
      }
    }
    mode_ = TraceMode::complete;
  }

  // First trace step >= from that uses p, or -1.
  static std::int64_t next_use_of(const Parameter& p, std::int64_t from) {
    auto it = std::lower_bound(p.uses.begin(), p.uses.end(), from);
    return it == p.uses.end() ? -1 : *it;
  }

  // Prefetch upcoming parameters in trace order within the budget.
  void prefetch() {
    if (prefetch_bucket_ == 0) return;
    if (live_numel_ >= max_live_) return;
    // At the limit of outstanding gathers a prefetch waits for a later
    // fetch() rather than blocking this one on an earlier prefetch. The
    // count changes only with calls, so every rank decides the same.
    if (batches_.size() >= max_ongoing_) return;
    const std::size_t live_budget = max_live_ - live_numel_;
    std::size_t numel = 0, group_numel = 0;
    std::int64_t group_step = -1;
    prefetch_.clear();
    const std::uint64_t round = ++prefetch_round_;
    while (queue_pos_ < queue_.size()) {
      const QueueEntry& e = queue_[queue_pos_];
      Parameter& p = params_[e.param];
      if (p.status != ParameterStatus::not_available || p.chosen == round) {
        // Already there (or chosen): this use is covered as long as it is kept.
        p.fetched_through = std::max(p.fetched_through, e.step);
        ++queue_pos_;
        continue;
      }
      std::size_t n = p.persistent ? 0 : p.info.numel;
      if (numel + n > live_budget) break;
      if (numel + n > prefetch_bucket_ && numel > 0) break;
      // One gather per upcoming module (small ones share): a coalesced gather
      // completes as a whole, so the next module's parameters must not wait
      // behind a later module's.
      if (!prefetch_.empty() && e.step != group_step && group_numel >= kMinGatherNumel) {
        prefetched_params_ += prefetch_.size();
        issue_gather(prefetch_);
        prefetch_.clear();
        group_numel = 0;
        if (batches_.size() >= max_ongoing_) return;
      }
      prefetch_.push_back(e.param);
      p.chosen = round;
      numel += n;
      group_numel += p.info.numel;
      group_step = e.step;
      p.fetched_through = std::max(p.fetched_through, e.step);
      ++queue_pos_;
    }
    if (!prefetch_.empty()) {
      prefetched_params_ += prefetch_.size();
      issue_gather(prefetch_);
    }
  }

  void ensure_slots() {
    if (!slots_.empty()) return;
    for (const auto& p : params_)
      if (p.on_nvme) slot_bytes_ = std::max(slot_bytes_, p.shard_bytes());
    if (slot_bytes_ == 0) return;
    slots_.resize(nvme_buffer_count_);
    for (auto& s : slots_) s.host = accel_->allocate(slot_bytes_, MemoryKind::pinned_host);
  }

  void free_slots() {
    for (auto& s : slots_) {
      if (s.param != kNone) {
        try {
          if (s.job) nvme_->wait(*s.job);
        } catch (const Error&) {
          // Abandoned read; reported again if the shard is fetched.
        }
        params_[s.param].slot = -1;
      }
      accel_->deallocate(s.host, MemoryKind::pinned_host);
    }
    slots_.clear();
    slot_bytes_ = 0;
  }

  void drop_slot(std::int32_t s) {
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    if (slot.job && !slot.job->done.load(std::memory_order_acquire)) {
      try {
        nvme_->wait(*slot.job);
      } catch (const Error&) {
        // The read is abandoned; a later fetch reads again and reports it.
      }
    }
    params_[slot.param].slot = -1;
    slot.param = kNone;
    slot.job.reset();
    slot.bound = false;
  }

  // Reads the shards of upcoming NVMe parameters into free buffers.
  void read_ahead() {
    ensure_slots();
    std::size_t free_count = 0;
    for (const auto& s : slots_) free_count += s.param == kNone;
    if (free_count == 0) return;
    // Look a bounded distance ahead so the scan stays cheap.
    const std::size_t window = std::min(queue_.size(), queue_pos_ + 4 * nvme_buffer_count_ + 16);
    for (std::size_t q = queue_pos_; q < window && free_count > 0; ++q) {
      std::uint32_t pi = queue_[q].param;
      Parameter& p = params_[pi];
      if (!p.on_nvme || p.slot >= 0 || p.status != ParameterStatus::not_available) continue;
      std::size_t s = 0;
      while (slots_[s].param != kNone) ++s;
      Slot& slot = slots_[s];
      slot.param = pi;
      slot.bound = false;
      slot.job = nvme_->submit(p.info.id, slot.host, p.shard_bytes());
      p.slot = static_cast<std::int32_t>(s);
      ++nvme_reads_;
      ++nvme_prefetch_reads_;
      --free_count;
    }
  }

  // Issues one coalesced gather for `which` (all not available).
  void issue_gather(const std::vector<std::uint32_t>& which) {
    while (batches_.size() >= max_ongoing_) {
      auto t0 = Clock::now();
      retire_through(batches_.front().id);
      fetch_wait_ns_ += elapsed_ns(t0);
    }
    Batch b = take_spare_batch();
    b.id = next_batch_;
    items_.clear();
    // NVMe shards first: a failed read leaves nothing changed.
    sources_.clear();
    try {
      for (std::uint32_t pi : which)
        sources_.push_back(params_[pi].on_nvme ? stage_nvme_shard(pi, b) : params_[pi].shard);
    } catch (...) {
      comm_stream_->synchronize();
      for (void* s : b.staging) accel_->deallocate(s, MemoryKind::device);
      for (void* h : b.host_temp) accel_->deallocate(h, MemoryKind::pinned_host);
      for (std::int32_t s : b.slots) drop_slot(s);
      b.staging.clear();
      b.host_temp.clear();
      b.slots.clear();
      spare_.push_back(std::move(b));
      throw;
    }
    ++next_batch_;
    for (std::size_t k = 0; k < which.size(); ++k) {
      const std::uint32_t pi = which[k];
      Parameter& p = params_[pi];
      const std::size_t full_bytes = p.shard_bytes() * static_cast<std::size_t>(world_);
      p.full = accel_->allocate(full_bytes, MemoryKind::device);
      items_.push_back(GatherItem{sources_[k], p.full, p.shard_numel, p.info.type});
      p.status = ParameterStatus::inflight;
      p.batch = b.id;
      if (p.persistent) {
        persistent_numel_ += p.info.numel;
      } else {
        live_numel_ += p.info.numel;
        (p.users.empty() ? idle_numel_ : active_numel_) += p.info.numel;
      }
      gathered_numel_ += p.info.numel;
      b.params.push_back(pi);
    }
    b.handle = comm_->all_gather_coalesced(items_, *comm_stream_);
    if (compute_stream_) {
      b.event = accel_->create_event();
      b.event->record(*comm_stream_);
    }
    ++gathers_;
    batches_.push_back(std::move(b));
    peak_inflight_ = std::max(peak_inflight_, batches_.size());
  }

  // Brings an NVMe shard to the device for a gather; returns the device copy.
  const void* stage_nvme_shard(std::uint32_t pi, Batch& b) {
    Parameter& p = params_[pi];
    const void* host = nullptr;
    if (p.slot >= 0) {
      Slot& slot = slots_[static_cast<std::size_t>(p.slot)];
      auto t0 = Clock::now();
      try {
        nvme_->wait(*slot.job);
      } catch (...) {
        drop_slot(p.slot);
        throw;
      }
      fetch_wait_ns_ += elapsed_ns(t0);
      slot.bound = true;
      b.slots.push_back(p.slot);
      host = slot.host;
    } else {
      void* temp = accel_->allocate(p.shard_bytes(), MemoryKind::pinned_host);
      try {
        auto t0 = Clock::now();
        nvme_->read(p.info.id, temp, p.shard_bytes());
        fetch_wait_ns_ += elapsed_ns(t0);
      } catch (...) {
        accel_->deallocate(temp, MemoryKind::pinned_host);
        throw;
      }
      ++nvme_reads_;
      b.host_temp.push_back(temp);
      host = temp;
    }
    void* staging = accel_->allocate(p.shard_bytes(), MemoryKind::device);
    b.staging.push_back(staging);
    accel_->copy_async(staging, host, p.shard_bytes(), CopyKind::host_to_device, *comm_stream_);
    return staging;
  }

  // Waits for a gather; its parameters become available.
  void finish(Batch& b) {
    if (b.done) return;
    b.handle->wait();
    for (std::uint32_t pi : b.params) params_[pi].status = ParameterStatus::available;
    if (compute_stream_ && b.event) compute_stream_->wait_event(*b.event);
    for (void* s : b.staging) accel_->deallocate(s, MemoryKind::device);
    for (void* h : b.host_temp) accel_->deallocate(h, MemoryKind::pinned_host);
    for (std::int32_t s : b.slots) drop_slot(s);
    b.staging.clear();
    b.host_temp.clear();
    b.slots.clear();
    b.done = true;
  }

  // Finishes and retires gather `id` and every gather issued before it.
  void retire_through(std::uint64_t id) {
    while (!batches_.empty() && batches_.front().id <= id) {
      Batch& b = batches_.front();
      finish(b);
      for (std::uint32_t pi : b.params) params_[pi].batch = 0;
      b.handle.reset();
      b.event.reset();
      b.params.clear();
      b.done = false;
      spare_.push_back(std::move(b));  // keeps its vectors' capacity for the next gather
      batches_.pop_front();
    }
  }

  // Finishes the gathers that have completed, oldest first, without blocking
  // (they stay outstanding until a call retires them).
  void reap_completed_batches() {
    for (auto& b : batches_) {
      if (b.done) continue;
      if (!b.handle->query()) break;
      finish(b);
    }
  }

  Batch take_spare_batch() {
    if (spare_.empty()) return Batch{};
    Batch b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }

  void drain() {
    if (!batches_.empty()) retire_through(batches_.back().id);
  }

  // Frees a gathered copy (available, no users).
  void free_copy(std::uint32_t pi) {
    Parameter& p = params_[pi];
    if (p.status != ParameterStatus::available) return;
    if (p.persistent) {
      persistent_numel_ -= p.info.numel;
    } else {
      live_numel_ -= p.info.numel;
      (p.users.empty() ? idle_numel_ : active_numel_) -= p.info.numel;
    }
    if (compute_stream_) {
      auto ev = accel_->create_event();
      ev->record(*compute_stream_);
      pending_frees_.push_back({p.full, std::move(ev)});
    } else {
      accel_->deallocate(p.full, MemoryKind::device);
    }
    p.full = nullptr;
    p.status = ParameterStatus::not_available;
    ++released_params_;
  }

  void free_idle(bool include_persistent) {
    for (std::uint32_t i = 0; i < params_.size(); ++i) {
      Parameter& p = params_[i];
      if (p.users.empty() && (include_persistent || !p.persistent)) free_copy(i);
    }
  }

  void reap_frees() {
    while (!pending_frees_.empty() && pending_frees_.front().event->query()) {
      accel_->deallocate(pending_frees_.front().pointer, MemoryKind::device);
      pending_frees_.pop_front();
    }
  }

  // Configuration.
  std::size_t prefetch_bucket_ = 0;
  std::size_t max_live_ = 0;
  std::size_t max_reuse_ = 0;
  std::size_t persistence_threshold_ = 0;
  std::size_t max_ongoing_ = 2;
  std::size_t nvme_buffer_count_ = 5;
  std::string nvme_path_;

  std::shared_ptr<spdlog::logger> logger_;
  std::shared_ptr<Accelerator> accel_;
  std::shared_ptr<Communicator> comm_;
  int rank_ = 0;
  int world_ = 1;
  std::shared_ptr<Stream> comm_stream_;
  std::shared_ptr<Stream> copy_stream_;
  std::shared_ptr<Stream> compute_stream_;
  std::unique_ptr<NvmeStore> nvme_;

  std::vector<Parameter> params_;
  std::unordered_map<ParameterId, std::uint32_t> param_index_;
  std::vector<Module> modules_;
  std::unordered_map<ModuleId, std::uint32_t> module_index_;
  std::size_t largest_module_ = 0;
  std::size_t active_modules_ = 0;

  // Trace.
  TraceMode mode_ = TraceMode::record;
  std::vector<std::uint32_t> recorded_;
  std::vector<std::uint32_t> trace_;
  std::vector<QueueEntry> queue_;
  std::size_t queue_pos_ = 0;
  std::vector<std::size_t> prefix_numel_;  // elements of trace modules before each step
  std::size_t step_ = 0;
  std::uint64_t pass_hash_ = 0;
  std::set<std::string> warned_;

  // Gathers in flight, oldest first.
  std::deque<Batch> batches_;
  std::vector<Batch> spare_;
  std::uint64_t next_batch_ = 1;
  std::deque<PendingFree> pending_frees_;

  // NVMe read-ahead buffers.
  std::vector<Slot> slots_;
  std::size_t slot_bytes_ = 0;

  // Scratch vectors reused across calls (no allocation on the hot path).
  std::vector<std::uint32_t> demand_;
  std::vector<std::uint32_t> prefetch_;
  std::vector<std::pair<std::int64_t, std::uint32_t>> keep_;
  std::vector<GatherItem> items_;
  std::vector<const void*> sources_;
  std::uint64_t prefetch_round_ = 0;

  // Accounting and statistics.
  std::size_t live_numel_ = 0;
  std::size_t idle_numel_ = 0;
  std::size_t active_numel_ = 0;
  std::size_t persistent_numel_ = 0;
  std::size_t peak_live_ = 0;
  std::size_t peak_idle_ = 0;
  std::size_t peak_inflight_ = 0;
  std::uint64_t passes_ = 0;
  std::uint64_t gathers_ = 0;
  std::uint64_t demand_params_ = 0;
  std::uint64_t prefetched_params_ = 0;
  std::uint64_t gathered_numel_ = 0;
  std::uint64_t released_params_ = 0;
  std::uint64_t retained_params_ = 0;
  std::uint64_t fetch_wait_ns_ = 0;
  std::uint64_t invalidations_ = 0;
  std::uint64_t warnings_ = 0;
  std::uint64_t nvme_reads_ = 0;
  std::uint64_t nvme_prefetch_reads_ = 0;
  std::uint64_t nvme_writes_ = 0;
};

static constexpr ParamSpec kSchema[] = {
    {"prefetch_bucket_size", ParamType::floating, param_has_min, "50000000", 0, 0, nullptr,
     "Elements gathered ahead per fetch with a complete trace (DeepSpeed "
     "stage3_prefetch_bucket_size); 0 turns prefetch off"},
    {"max_live_parameters", ParamType::floating, param_has_min, "1000000000", 0, 0, nullptr,
     "Limit on gathered elements: prefetch keeps all of them within it, copies kept by "
     "release() never make the unused ones exceed it (DeepSpeed stage3_max_live_parameters)"},
    {"max_reuse_distance", ParamType::floating, param_has_min, "1000000000", 0, 0, nullptr,
     "A released parameter used again within this many elements of upcoming trace stays "
     "gathered (DeepSpeed stage3_max_reuse_distance)"},
    {"param_persistence_threshold", ParamType::floating, param_has_min, "100000", 0, 0, nullptr,
     "Parameters of at most this many elements stay gathered once fetched (DeepSpeed "
     "stage3_param_persistence_threshold)"},
    {"max_ongoing_fetch_events", ParamType::integer, param_has_min, "2", 1, 0, nullptr,
     "Gathers outstanding at once (issued, not yet waited for by the fetch that needs them); "
     "prefetch stops at the limit (DeepSpeed hard-codes 2)"},
    {"nvme_path", ParamType::string, 0, "\"\"", 0, 0, nullptr,
     "Directory for shard files (NVMe offload, one rank<r>/ folder per rank); empty keeps "
     "shards in device memory"},
    {"nvme_buffer_count", ParamType::integer, param_has_min, "5", 1, 0, nullptr,
     "Host buffers for reading NVMe shards ahead of use (DeepSpeed offload_param "
     "buffer_count)"},
};

}  // namespace
}  // namespace ductile::zero

DUCTILE_PLUGIN(ductile::zero::PartitionedCoordinator, "partitioned", "1.0.0",
               "ZeRO-3 partitioned parameters: trace, prefetch, release, NVMe offload",
               ductile::zero::kSchema)
