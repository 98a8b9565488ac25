// The "partitioned" ZeRO-3 parameter coordinator: DeepSpeed's
// PartitionedParameterCoordinator re-created over the ductile Accelerator
// interface. This file binds the SDK interface to two halves:
// - the planner (planner.hpp): trace, prefetch and release decisions, exact
//   live-element accounting; pure, with no MPI, accelerator or threads;
// - the machinery that executes its plans: the gather pipeline on the
//   accelerator (gather_pipeline.hpp), the NVMe read-ahead
//   (nvme_read_ahead.hpp) and the cross-rank agreement of calls while a
//   trace is recorded (rank_agreement.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <spdlog/logger.h>

#include "ductile/accelerator.hpp"
#include "ductile/parameter_coordinator.hpp"
#include "ductile/plugin.hpp"
#include "gather_pipeline.hpp"
#include "nvme_read_ahead.hpp"
#include "nvme_store.hpp"
#include "planner.hpp"
#include "rank_agreement.hpp"

namespace ductile::zero {
namespace {

// A whole, non-negative number of elements from a [zero] key given as integer
// or float (DeepSpeed writes 5e7). The schema's bound (>= 0) is reported
// with every other key's problem by `config check`; this check adds what a
// schema cannot say (a whole number, at most 9e18) and keeps the cast below
// defined. The validate hook runs it before anything is created.
std::size_t element_count(const Params& params, const char* key) {
  double v = params.get_double(key);
  if (!std::isfinite(v) || v < 0 || v != std::floor(v) || v > 9.0e18)
    throw ParamError(
        ErrorKind::config, key,
        fmt::format("[zero] {} = {}: expected a whole number of elements from 0 to 9e18 (such "
                    "as 50000000 or 5e7)",
                    key, v));
  return static_cast<std::size_t>(v);
}

PlannerLimits limits_of(const Params& p) {
  return {.prefetch_bucket = element_count(p, "prefetch_bucket_size"),
          .max_live = element_count(p, "max_live_parameters"),
          .max_reuse = element_count(p, "max_reuse_distance"),
          .persistence_threshold = element_count(p, "param_persistence_threshold"),
          .max_ongoing = static_cast<std::size_t>(p.get_int("max_ongoing_fetch_events"))};
}

std::shared_ptr<Accelerator> required_accelerator(const HostContext& ctx) {
  auto accel = ctx.require<Accelerator>();
  if (!accel) throw Error(ErrorKind::config, "[zero] requires an accelerator; none is configured");
  return accel;
}

// a * b, or the largest size_t when that overflows (a bound that large is
// no bound).
std::size_t saturating_product(std::size_t a, std::size_t b) {
  constexpr std::size_t most = std::numeric_limits<std::size_t>::max();
  return a != 0 && b > most / a ? most : a * b;
}

class PartitionedCoordinator final : public ParameterCoordinator {
 public:
  // The plugin's validate hook: every [zero] value a run would refuse.
  static void validate(const Params& params, std::string_view) { limits_of(params); }

  explicit PartitionedCoordinator(const HostContext& ctx)
      : logger_(ctx.logger()),
        planner_(limits_of(ctx.params())),
        accel_(required_accelerator(ctx)),
        comm_(accel_->world()),
        rank_(comm_->rank()),
        world_(comm_->size()) {
    const std::string nvme_path = ctx.params().get_string("nvme_path");
    if (!nvme_path.empty())
      nvme_ = std::make_unique<NvmeReadAhead>(
          accel_, std::make_unique<NvmeStore>(nvme_path, rank_),
          static_cast<std::size_t>(ctx.params().get_int("nvme_buffer_count")));
    pipeline_ = std::make_unique<GatherPipeline>(accel_, comm_, nvme_.get());
    agreement_ = std::make_unique<RankAgreement>(accel_, comm_, pipeline_->comm_stream());
  }

  ~PartitionedCoordinator() override {
    try {
      plan_.clear();
      planner_.drain(plan_);
      pipeline_->execute(plan_, planner_, false);
    } catch (const std::exception& e) {
      logger_->error("zero: a gather failed during shutdown: {}", e.what());
    }
    agreement_.reset();  // waits for an agreement still in flight
    pipeline_.reset();   // frees the buffers, gives back the read-ahead buffers
    nvme_.reset();       // joins the I/O thread, then frees its buffers
  }

  // --- Registration ---

  void register_parameter(const ParameterInfo& info) override {
    register_group(info, std::span(&info.numel, 1));
  }

  void register_group(const ParameterInfo& info,
                      std::span<const std::size_t> member_numels) override {
    // Every check before any change: a failed registration leaves nothing.
    planner_.check_new_parameter(info.id, info.numel);
    const std::size_t esize = size_of(info.type);
    if (esize == 0)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: parameter {} has an unknown element type {}", info.id,
                              static_cast<unsigned>(info.type)));
    const auto world = static_cast<std::size_t>(world_);
    std::size_t sum = 0, shard_numel = 0;
    for (std::size_t n : member_numels) {
      if (n == 0)
        throw Error(ErrorKind::invalid_argument,
                    fmt::format("zero: group {} has a member of 0 elements", info.id));
      sum += n;
      shard_numel += (n + world - 1) / world;
    }
    if (member_numels.empty() || sum != info.numel)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: group {} of {} elements has {} members of {} elements in all",
                              info.id, info.numel, member_numels.size(), sum));
    const bool on_nvme = nvme_ && info.numel > planner_.limits().persistence_threshold;
    const auto pi = static_cast<std::uint32_t>(planner_.parameter_count());
    if (on_nvme) {
      nvme_->store().create(info.id, shard_numel * esize);
      ++nvme_->writes;
      if (nvme_->add_parameter(pi, info.id, shard_numel * esize)) {
        // Larger buffers are needed: let the current ones go (reallocated lazily).
        run(&Planner::drain);
        nvme_->free_buffers();
      }
    }
    pipeline_->add_parameter(pi, member_numels, info.type,
                             on_nvme ? ShardLocation::nvme : ShardLocation::device);
    planner_.add_parameter(info.id, info.numel);
    types_.push_back(info.type);
  }

  void register_module(ModuleId id, std::span<const ParameterId> parameters) override {
    planner_.add_module(id, parameters);
  }

  // --- Shard data ---

  std::size_t shard_numel(ParameterId id) const override {
    return pipeline_->shard_numel(planner_.parameter_index(id));
  }

  void set_shard(ParameterId id, const void* host_data, std::size_t bytes) override {
    const std::uint32_t pi = planner_.parameter_index(id);
    check_bytes("set_shard", id, bytes, pipeline_->shard_bytes(pi), "shard_numel() * element size");
    if (bytes && !host_data)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: set_shard({}) got a null pointer", id));
    drop_copy("set_shard", pi);
    if (pipeline_->on_nvme(pi)) {
      nvme_->store().write(id, host_data, bytes);
      ++nvme_->writes;
    } else {
      pipeline_->write_shard(pi, host_data, bytes);
    }
  }

  void set_full(ParameterId id, const void* host_data, std::size_t bytes) override {
    const std::uint32_t pi = planner_.parameter_index(id);
    const std::size_t esize = size_of(types_[pi]), numel = planner_.numel(pi),
                      shard = pipeline_->shard_numel(pi);
    check_bytes("set_full", id, bytes, numel * esize, "numel * element size");
    if (bytes && !host_data)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: set_full({}) got a null pointer", id));
    std::vector<unsigned char> slice(shard * esize, 0);
    pipeline_->slice_full(pi, rank_, static_cast<const unsigned char*>(host_data), slice.data());
    set_shard(id, slice.data(), slice.size());
  }

  void read_shard(ParameterId id, void* host_out, std::size_t bytes) override {
    const std::uint32_t pi = planner_.parameter_index(id);
    check_bytes("read_shard", id, bytes, pipeline_->shard_bytes(pi),
                "shard_numel() * element size");
    if (bytes && !host_out)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: read_shard({}) got a null pointer", id));
    if (pipeline_->on_nvme(pi)) {
      nvme_->store().read(id, host_out, bytes);
      ++nvme_->reads;
    } else {
      pipeline_->read_shard(pi, host_out, bytes);
    }
  }

  void* shard_data(ParameterId id) override {
    const std::uint32_t pi = planner_.parameter_index(id);
    if (pipeline_->on_nvme(pi))
      throw Error(ErrorKind::unsupported,
                  fmt::format("zero: shard_data({}): the shard lives in a file under nvme_path; "
                              "use set_shard()/read_shard()",
                              id));
    return pipeline_->shard(pi);
  }

  void shard_written(ParameterId id) override {
    drop_copy("shard_written", planner_.parameter_index(id));
  }

  // --- Shard placement ---

  ShardLocation shard_location(ParameterId id) const override {
    return pipeline_->location(planner_.parameter_index(id));
  }

  void move_shard(ParameterId id, ShardLocation where) override {
    const std::uint32_t pi = planner_.parameter_index(id);
    if (where == ShardLocation::nvme)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: move_shard({}, nvme): a shard goes to NVMe only at "
                              "registration ([zero] nvme_path); valid: device, host",
                              id));
    if (pipeline_->on_nvme(pi))
      throw Error(
          ErrorKind::unsupported,
          fmt::format("zero: move_shard({}): the shard lives in a file under nvme_path", id));
    if (pipeline_->location(pi) == where) return;
    drop_copy("move_shard", pi);
    pipeline_->move_shard(pi, where);
  }

  std::size_t staging_bytes_bound(std::size_t largest_shard_numel,
                                  std::size_t element_size) const override {
    // Staged at once: the buffers of every gather in flight, and those of
    // the module's own gather, staged before the oldest in flight retires.
    const PlannerLimits& limits = planner_.limits();
    const auto world = static_cast<std::size_t>(world_);
    const std::size_t bucket_share =
        limits.prefetch_bucket / world + (limits.prefetch_bucket % world != 0 ? 1 : 0);
    const std::size_t buffer = std::max(largest_shard_numel, bucket_share);
    return saturating_product(saturating_product(limits.max_ongoing + 1, buffer), element_size);
  }

  // --- The training loop ---

  void fetch(ModuleId module_id) override {
    const std::uint32_t mi = planner_.module_index(module_id);
    pipeline_->reap_frees();
    plan_.clear();
    const bool recording = planner_.begin_fetch(mi, plan_);
    after_deviation();
    if (recording) agreement_->agree_fetch(module_id, planner_.step());
    // The module's own shards are staged before the planner commits, so a
    // failed NVMe read leaves nothing changed and the call can be retried.
    if (nvme_) pipeline_->stage_own(planner_.missing(mi));
    plan_.clear();
    planner_.fetch(mi, plan_);
    pipeline_->execute(plan_, planner_, true);
    if (nvme_ && planner_.mode() == TraceMode::complete) nvme_->read_ahead(planner_);
  }

  void release(ModuleId module_id) override {
    const std::uint32_t mi = planner_.module_index(module_id);
    plan_.clear();
    planner_.release(mi, plan_);
    pipeline_->free_copies(plan_);
    // Every use of the trace is covered by a gather issued already: no
    // idle buffer is taken again before the next pass.
    if (planner_.mode() == TraceMode::complete && planner_.upcoming().empty()) pipeline_->rest();
  }

  void end_step() override {
    plan_.clear();
    planner_.begin_end_step(plan_);
    after_deviation();
    // Every rank must have run the same pass: same length, same order. A
    // pass that ran the complete trace is agreed without the host waiting
    // (checked at the next end of a pass); a recorded one before it
    // becomes the trace.
    const bool recording = planner_.mode() == TraceMode::record;
    if (world_ > 1) {
      order_.clear();
      for (std::uint32_t mi : planner_.pass_order())
        order_.push_back(static_cast<std::int64_t>(planner_.module_id(mi)));
      if (recording)
        agreement_->agree_end(planner_.step(), planner_.pass_hash(), order_);
      else
        agreement_->agree_end_later(planner_.step(), planner_.pass_hash(), order_);
    }
    plan_.clear();
    planner_.end_step(plan_);
    pipeline_->execute(plan_, planner_, false);
    pipeline_->after_shard_writes();
    if (recording && planner_.mode() == TraceMode::complete)
      logger_->debug("zero: trace recorded ({} modules, {} parameter uses)",
                     planner_.trace().size(), planner_.upcoming().size());
    pipeline_->reap_frees();
  }

  void release_all(bool include_persistent) override {
    plan_.clear();
    planner_.release_all(include_persistent, plan_);
    pipeline_->execute(plan_, planner_, false);
  }

  void progress() override {
    pipeline_->poll(planner_);
    pipeline_->reap_frees();
  }

  void set_compute_stream(std::shared_ptr<Stream> stream) override {
    pipeline_->set_compute_stream(std::move(stream));
  }

  // --- Queries ---

  ParameterStatus status(ParameterId id) const override {
    return planner_.status(planner_.parameter_index(id));
  }

  std::vector<ModuleId> active_modules(ParameterId id) const override {
    std::vector<ModuleId> out;
    for (std::uint32_t mi : planner_.users(planner_.parameter_index(id)))
      out.push_back(planner_.module_id(mi));
    std::sort(out.begin(), out.end());
    return out;
  }

  bool is_persistent(ParameterId id) const override {
    return planner_.persistent(planner_.parameter_index(id));
  }

  void* full_data(ParameterId id) override {
    const std::uint32_t pi = planner_.parameter_index(id);
    require_available("full_data", id, pi);
    return pipeline_->full(pi);
  }

  void read_full(ParameterId id, void* host_out, std::size_t bytes) override {
    const std::uint32_t pi = planner_.parameter_index(id);
    check_bytes("read_full", id, bytes, planner_.numel(pi) * size_of(types_[pi]),
                "numel * element size");
    require_available("read_full", id, pi);
    if (bytes && !host_out)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: read_full({}) got a null pointer", id));
    pipeline_->read_full(pi, host_out, bytes);
  }

  TraceMode trace_mode() const override { return planner_.mode(); }

  std::vector<ModuleId> trace() const override {
    std::vector<ModuleId> out;
    for (std::uint32_t mi : planner_.trace()) out.push_back(planner_.module_id(mi));
    return out;
  }

  GatherMemoryStats gather_memory() const override { return pipeline_->memory_stats(); }
  void trim_gather_memory() override { pipeline_->trim(); }

  CoordinatorStats stats() const override {
    const PlannerCounters& c = planner_.counters();
    CoordinatorStats s;
    s.trace_mode = planner_.mode();
    s.trace_length = planner_.trace().size();
    s.step = planner_.step();
    s.passes = c.passes;
    s.live_numel = c.live_numel;
    s.idle_numel = c.idle_numel;
    s.active_numel = c.active_numel;
    s.persistent_numel = c.persistent_numel;
    s.peak_live_numel = c.peak_live_numel;
    s.peak_idle_numel = c.peak_idle_numel;
    s.max_live_numel = planner_.limits().max_live;
    s.largest_module_numel = planner_.largest_module_numel();
    s.gathers = c.gathers;
    s.demand_gathered_params = c.demand_gathered_params;
    s.prefetched_params = c.prefetched_params;
    s.gathered_numel = c.gathered_numel;
    s.inflight_gathers = planner_.outstanding_gathers();
    s.peak_inflight_gathers = c.peak_inflight_gathers;
    s.released_params = c.released_params;
    s.retained_params = c.retained_params;
    s.fetch_wait_ns = pipeline_->wait_ns;
    s.trace_invalidations = c.trace_invalidations;
    s.trace_warnings = c.trace_warnings;
    if (nvme_) {
      s.fetch_wait_ns += nvme_->wait_ns;
      s.nvme_reads = nvme_->reads;
      s.nvme_prefetch_reads = nvme_->prefetch_reads;
      s.nvme_writes = nvme_->writes;
      s.nvme_buffers_in_use = nvme_->buffers_in_use();
    }
    return s;
  }

  void check_invariants() const override {
    planner_.check_invariants();
    pipeline_->check_invariants(planner_);
    if (nvme_) nvme_->check_invariants(planner_);
  }

 private:
  // Executes a plan of begin_fetch()/begin_end_step(): the drain and frees
  // of a deviation (if any), its warning, and the read-ahead buffers that
  // the old trace chose.
  void after_deviation() {
    pipeline_->execute(plan_, planner_, false);
    if (!plan_.invalidated) return;
    if (!plan_.warning.empty() && rank_ == 0)
      logger_->warn(
          "zero: the module order deviates from the recorded trace at {}; "
          "re-recording (warned once per distinct deviation)",
          plan_.warning);
    if (nvme_) nvme_->drop_unbound();
  }

  // A stale gathered copy goes before the shard changes (see set_shard()).
  void drop_copy(const char* call, std::uint32_t pi) {
    plan_.clear();
    planner_.drop_copy(call, pi, plan_);
    pipeline_->execute(plan_, planner_, false);
    pipeline_->after_shard_writes();
    if (nvme_) nvme_->drop(pi);
  }

  void run(void (Planner::*call)(Plan&)) {
    plan_.clear();
    (planner_.*call)(plan_);
    pipeline_->execute(plan_, planner_, false);
  }

  static void check_bytes(const char* call, ParameterId id, std::size_t bytes, std::size_t expected,
                          const char* what) {
    if (bytes != expected)
      throw Error(ErrorKind::invalid_argument,
                  fmt::format("zero: {}({}) got {} bytes, expected {} ({})", call, id, bytes,
                              expected, what));
  }

  void require_available(const char* call, ParameterId id, std::uint32_t pi) const {
    const ParameterStatus st = planner_.status(pi);
    if (st != ParameterStatus::available)
      throw Error(ErrorKind::incompatible,
                  fmt::format("zero: {}({}): the parameter is {}; fetch a module using it first",
                              call, id, to_string(st)));
  }

  std::shared_ptr<spdlog::logger> logger_;
  Planner planner_;
  std::shared_ptr<Accelerator> accel_;
  std::shared_ptr<Communicator> comm_;
  int rank_ = 0;
  int world_ = 1;
  std::unique_ptr<NvmeReadAhead> nvme_;  // before pipeline_: destroyed after it
  std::unique_ptr<GatherPipeline> pipeline_;
  std::unique_ptr<RankAgreement> agreement_;
  std::vector<DataType> types_;  // by parameter index
  Plan plan_;                    // reused by every call
  std::vector<std::int64_t> order_;
};

static constexpr ParamSpec kSchema[] = {
    {.key = "prefetch_bucket_size",
     .type = ParamType::floating,
     .flags = param_has_min,
     .default_value = "50000000",
     .doc = "Elements gathered ahead per fetch with a complete trace (DeepSpeed "
            "stage3_prefetch_bucket_size); 0 turns prefetch off"},
    {.key = "max_live_parameters",
     .type = ParamType::floating,
     .flags = param_has_min,
     .default_value = "1000000000",
     .doc =
         "Limit on gathered elements: prefetch keeps all of them within it, copies kept by "
         "release() never make the unused ones exceed it (DeepSpeed stage3_max_live_parameters)"},
    {.key = "max_reuse_distance",
     .type = ParamType::floating,
     .flags = param_has_min,
     .default_value = "1000000000",
     .doc = "A released parameter used again within this many elements of upcoming trace stays "
            "gathered (DeepSpeed stage3_max_reuse_distance)"},
    {.key = "param_persistence_threshold",
     .type = ParamType::floating,
     .flags = param_has_min,
     .default_value = "100000",
     .doc = "Parameters of at most this many elements stay gathered once fetched (DeepSpeed "
            "stage3_param_persistence_threshold)"},
    {.key = "max_ongoing_fetch_events",
     .type = ParamType::integer,
     .flags = param_has_min,
     .default_value = "2",
     .min_value = 1,
     .doc =
         "Gathers outstanding at once (issued, not yet waited for by the fetch that needs them); "
         "prefetch stops at the limit (DeepSpeed hard-codes 2)"},
    {.key = "nvme_path",
     .type = ParamType::string,
     .default_value = "\"\"",
     .doc = "Directory for shard files (NVMe offload, one rank<r>/ folder per rank); empty keeps "
            "shards in device memory"},
    {.key = "nvme_buffer_count",
     .type = ParamType::integer,
     .flags = param_has_min,
     .default_value = "5",
     .min_value = 1,
     .doc = "Host buffers for reading NVMe shards ahead of use (DeepSpeed offload_param "
            "buffer_count)"},
};

}  // namespace
}  // namespace ductile::zero

DUCTILE_PLUGIN(ductile::zero::PartitionedCoordinator, "partitioned", "1.0.0",
               "ZeRO-3 partitioned parameters: trace, prefetch, release, host and NVMe offload",
               ductile::zero::kSchema)
