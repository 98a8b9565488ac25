// The ParameterCoordinator interface (plugin kind PluginKind::zero): ZeRO-3
// partitioned parameters. Each rank of the accelerator's world communicator
// owns one equal, zero-padded shard of every registered parameter; the
// coordinator gathers a module's parameters before it runs (fetch), frees the
// gathered copies after (release), records the order of modules during the
// first forward+backward pass (the trace) and, once that trace is complete,
// prefetches the parameters of upcoming modules and keeps the ones reused soon.
//
// Typical use by a training framework (same calls, same order, on every rank):
//
//   auto zero = runtime.get<ductile::ParameterCoordinator>();
//   zero->register_parameter({.id = 0, .numel = 4096, .type = DataType::f32});
//   zero->register_module(7, std::vector<ParameterId>{0, 1});
//   zero->set_full(0, host_values, bytes);          // or set_shard()
//   for (step...) {
//     for (module in forward, then backward order) {
//       zero->fetch(module);  auto* w = zero->full_data(0);  ... run ...
//       zero->release(module);
//     }
//     zero->end_step();
//   }
//
// Conventions for every call below unless the call says otherwise:
// - Threading: a coordinator is driven by one thread at a time (the training
//   loop); it is not safe to call two methods concurrently. It may own an
//   internal file-I/O thread (NVMe offload) that never calls back into the
//   caller.
// - Collectives: fetch() and end_step() may issue collectives on
//   the accelerator's world communicator, so every rank must make the same
//   calls with the same arguments in the same order. While a trace is being
//   recorded, every fetch() and end_step() first checks that all ranks are at
//   the same call (same module, same step) and throws the same error on
//   every rank if not, so a rank-order mismatch never leaves a rank waiting.
//   Once a trace is complete, a deviation seen by only some ranks cannot be
//   detected before the mismatched collective (as with MPI and NCCL).
// - Errors: throws ductile::Error. invalid_argument for an unknown or
//   duplicate id or a call out of order (fetch of a module already fetched,
//   release of a module not fetched); incompatible for a valid request the
//   current state cannot satisfy (reading a parameter that is not gathered);
//   io for a missing, short or unreadable NVMe file (the message names the
//   file, the parameter and the sizes); communication when a rank-order
//   mismatch is found or a collective fails; internal for a broken
//   invariant. After an error thrown by fetch() or end_step() the
//   coordinator's state is unspecified apart from being safe to destroy.
// - Ownership: the coordinator owns every shard, every gathered copy and
//   every buffer; pointers it returns stay valid as documented per call.
//   Its destructor waits for in-flight work and frees everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ductile/accelerator.hpp"
#include "ductile/plugin.hpp"

namespace ductile {

using ParameterId = std::uint64_t;
using ModuleId = std::uint64_t;

// Where a parameter's full data is.
enum class ParameterStatus : std::uint32_t {
  not_available,  // only this rank's shard exists
  inflight,       // a gather has been issued and has not been waited for
  available,      // the full parameter is readable on the device
};

DUCTILE_SDK_API inline const char* to_string(ParameterStatus s) noexcept {
  switch (s) {
    case ParameterStatus::not_available:
      return "not_available";
    case ParameterStatus::inflight:
      return "inflight";
    case ParameterStatus::available:
      return "available";
  }
  return "unknown";
}

// The state of the module-order trace.
enum class TraceMode : std::uint32_t {
  record,    // no frozen trace: the first pass, a pass that deviated, and the one after it
  complete,  // a frozen trace drives prefetch and release decisions
};

DUCTILE_SDK_API inline const char* to_string(TraceMode m) noexcept {
  return m == TraceMode::record ? "record" : "complete";
}

struct ParameterInfo {
  ParameterId id = 0;
  std::size_t numel = 0;          // elements of the full parameter (> 0)
  DataType type = DataType::f32;  // element type; its size is size_of(type)
};

// Where this rank's shard of a parameter lives (see shard_location()).
enum class ShardLocation : std::uint32_t {
  device,  // device memory (the default)
  host,    // pinned host memory: copied to the device for each gather
  nvme,    // a file under the coordinator's NVMe directory
};

DUCTILE_SDK_API inline const char* to_string(ShardLocation l) noexcept {
  switch (l) {
    case ShardLocation::device:
      return "device";
    case ShardLocation::host:
      return "host";
    case ShardLocation::nvme:
      return "nvme";
  }
  return "unknown";
}

// Counters and gauges of a coordinator, for tests, benchmarks and logs.
// "Live" elements are those of non-persistent parameters that are in flight
// or available; persistent parameters are counted separately.
struct CoordinatorStats {
  TraceMode trace_mode = TraceMode::record;
  std::size_t trace_length = 0;  // modules in the frozen trace (0 while recording)
  std::uint64_t step = 0;        // fetches so far in the current pass
  std::uint64_t passes = 0;      // end_step() calls so far

  std::size_t live_numel = 0;            // elements in flight or available (non-persistent)
  std::size_t idle_numel = 0;            // live elements used by no fetched module
  std::size_t active_numel = 0;          // live elements used by at least one fetched module
  std::size_t persistent_numel = 0;      // elements of gathered persistent parameters
  std::size_t peak_live_numel = 0;       // maximum of live_numel since creation
  std::size_t peak_idle_numel = 0;       // maximum of idle_numel since creation
  std::size_t max_live_numel = 0;        // the configured max_live_parameters
  std::size_t largest_module_numel = 0;  // elements of the largest registered module

  std::uint64_t gathers = 0;                 // coalesced gathers issued
  std::uint64_t demand_gathered_params = 0;  // parameters gathered by fetch() for its own module
  std::uint64_t prefetched_params = 0;       // parameters gathered ahead by prefetch
  std::uint64_t gathered_numel = 0;          // elements gathered in total
  std::size_t inflight_gathers = 0;          // gathers issued and not yet retired by a call
  std::size_t peak_inflight_gathers = 0;     // maximum of inflight_gathers
  std::uint64_t released_params = 0;         // gathered copies freed
  std::uint64_t retained_params = 0;         // release() decisions that kept a copy
  std::uint64_t fetch_wait_ns = 0;           // time fetch() spent blocked on gathers and reads

  std::uint64_t trace_invalidations = 0;  // deviations from a complete trace
  std::uint64_t trace_warnings = 0;       // distinct deviations warned about

  std::uint64_t nvme_reads = 0;           // shard files read
  std::uint64_t nvme_prefetch_reads = 0;  // of those, read ahead with the trace
  std::uint64_t nvme_writes = 0;          // shard files written
  std::size_t nvme_buffers_in_use = 0;    // read-ahead buffers holding or awaiting a shard
};

// Counters of the memory a coordinator gathers into, for tests and
// benchmarks (see gather_memory()).
struct GatherMemoryStats {
  std::uint64_t allocations = 0;     // device allocations made for gathered copies
  std::uint64_t reuses = 0;          // copies placed in a buffer kept from an earlier one
  std::uint64_t frees = 0;           // device buffers given back to the accelerator
  std::size_t in_use_bytes = 0;      // bytes of gathered copies alive (in flight or used)
  std::size_t idle_bytes = 0;        // bytes kept for reuse
  std::size_t high_water_bytes = 0;  // maximum of in_use_bytes
};

class DUCTILE_SDK_API ParameterCoordinator : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::zero;

  // --- Registration (local, no communication; identical on every rank) ---

  // Adds a parameter. Its shard (shard_numel() elements, zero-filled) is
  // allocated on the device, or created as a file under nvme_path when NVMe
  // offload is on and the parameter is not persistent. Parameters of at most
  // param_persistence_threshold elements are persistent: once gathered they
  // stay gathered. Throws invalid_argument for a duplicate id or numel 0, io
  // when the shard file cannot be created.
  virtual void register_parameter(const ParameterInfo& info) = 0;

  // Registers parameter `info.id` (info.numel elements of info.type) as a
  // group of tensors of `member_numels` elements each, in order; they must
  // sum to info.numel. A group is gathered, prefetched and released as one
  // parameter (one collective), so that a framework fetching a module's
  // parameters makes one gather and one materialisation a module instead of
  // one a tensor. Each member is partitioned on its own, as a parameter of
  // that many elements would be: with s_i = ceil(n_i / world size), rank r
  // holds elements [r * s_i, (r + 1) * s_i) of member i, zero-padded past
  // n_i. So:
  // - the shard (shard_numel() = s_0 + s_1 + ... elements; shard_data(),
  //   set_shard(), read_shard()) holds this rank's slices of the members
  //   back to back, member 0 first;
  // - the gathered copy (full_data(): world size * shard_numel() elements)
  //   holds each member whole, back to back: member i at element offset
  //   world size * (s_0 + ... + s_{i-1}), its first n_i elements meaningful
  //   and the rest of its world size * s_i elements padding;
  // - set_full() and read_full() take and give the members' n_i meaningful
  //   elements back to back (info.numel elements in all).
  // In every other respect (modules, persistence by info.numel, NVMe shard
  // files, prefetch and release) the group is one parameter; one coalesced
  // gather brings it. A single member is a plain parameter. Throws as
  // register_parameter(), and invalid_argument when `member_numels` is
  // empty, holds a 0 or does not sum to info.numel (nothing is registered).
  virtual void register_group(const ParameterInfo& info,
                              std::span<const std::size_t> member_numels) = 0;

  // Adds a module using `parameters` (registered ids; duplicates are ignored;
  // a parameter may belong to several modules). Throws invalid_argument for a
  // duplicate module id or an unknown parameter id. Modules registered after
  // the trace froze simply deviate from it when fetched.
  virtual void register_module(ModuleId id, std::span<const ParameterId> parameters) = 0;

  // --- Shard data ---

  // Elements of each rank's shard: ceil(numel / world size). The gathered
  // parameter holds world size * shard_numel() elements, the first numel of
  // which are the parameter. Throws invalid_argument for an unknown id.
  virtual std::size_t shard_numel(ParameterId id) const = 0;

  // Replaces this rank's shard with `bytes` bytes from host memory (exactly
  // shard_numel() * element size). A gathered copy that no fetched module
  // uses is dropped first (it would be stale); a persistent parameter is
  // gathered again on its next fetch. Throws invalid_argument for an unknown
  // id or a wrong size, incompatible while a fetched module uses the
  // parameter, io when the shard file cannot be written. Local, no
  // communication. Blocks until the data is stored.
  virtual void set_shard(ParameterId id, const void* host_data, std::size_t bytes) = 0;

  // Convenience: stores this rank's slice of a full parameter given in host
  // memory (numel * element size bytes); the padding of the last shard is
  // zero. Same errors and rules as set_shard().
  virtual void set_full(ParameterId id, const void* host_data, std::size_t bytes) = 0;

  // Copies this rank's shard into host memory (shard_numel() * element size
  // bytes). Throws invalid_argument for an unknown id or a wrong size, io
  // when the shard file cannot be read.
  virtual void read_shard(ParameterId id, void* host_out, std::size_t bytes) = 0;

  // Direct access to this rank's shard, so that a framework can keep its
  // optimizer's master weights in the shard itself instead of in a second
  // copy: a device pointer to the shard of `id` (shard_numel() elements of
  // the parameter's type, the padding of the last rank's shard included),
  // or a host pointer when the shard lives in host memory, valid as long as
  // the coordinator or until the shard moves (move_shard()). Reading is
  // allowed at any time; writing only while no gather is in flight (after
  // end_step() or release_all(), before the next fetch()), and every write
  // must be followed by shard_written(). Throws invalid_argument for an
  // unknown id, unsupported when the shard lives in a file (NVMe offload;
  // use set_shard()/read_shard() for those). Local, no communication.
  virtual void* shard_data(ParameterId id) = 0;

  // Says that the shard of `id` was written through shard_data(): what
  // set_shard() does, without the copy (a gathered copy no fetched module
  // uses is dropped; a persistent parameter is gathered again on its next
  // fetch). Throws invalid_argument for an unknown id, incompatible while a
  // fetched module uses the parameter. Local, no communication.
  virtual void shard_written(ParameterId id) = 0;

  // --- Shard placement (parameter offload; local, no communication) ---
  //
  // A shard lives in device memory unless moved to pinned host memory, per
  // parameter, so that a framework under a device-memory budget moves only
  // what does not fit, or in a file when NVMe offload is on. A host shard
  // is copied to a device buffer of shard_numel() elements for each gather
  // of its parameter (staging_bytes_bound() bounds those buffers), and the
  // host waits for such a gather before its module computes: the host may
  // write the shard after end_step() or release_all() without racing a
  // copy.

  // Where the shard of `id` lives. Throws invalid_argument for an unknown id.
  virtual ShardLocation shard_location(ParameterId id) const = 0;

  // Moves the shard of `id`, values kept, into device or pinned host memory
  // (`where`: device or host; the same place is a no-op). Allowed when
  // shard_data() allows writing (no module using the parameter is fetched);
  // a gathered copy no fetched module uses is dropped first. A pointer from
  // shard_data() is invalid afterwards. Throws invalid_argument for an
  // unknown id or `where` = nvme, unsupported for a shard in a file,
  // incompatible while a fetched module uses the parameter, and the
  // accelerator's error when the memory cannot be had (nothing moved).
  virtual void move_shard(ParameterId id, ShardLocation where) = 0;

  // The most bytes of device memory that the buffers staging host shards
  // for gathers take at once, for a framework that budgets device memory
  // before it registers its parameters: a buffer set for each gather in
  // flight (at most max_ongoing_fetch_events) and for the one fetch()
  // stages for its own module, each of at most the larger of
  // `largest_shard_numel` (the largest shard_numel() to be registered) and
  // a rank's share of a prefetch bucket (ceil(prefetch_bucket_size / world
  // size)) elements of `element_size` bytes. Depends only on the validated
  // configuration and the arguments; saturates at the largest size_t.
  // Never throws.
  virtual std::size_t staging_bytes_bound(std::size_t largest_shard_numel,
                                          std::size_t element_size) const = 0;

  // --- The training loop ---

  // Makes every parameter of `module` available and waits only for those;
  // with a complete trace, then prefetches the parameters of upcoming
  // modules in trace order (up to min(max_live_parameters - live,
  // prefetch_bucket_size) elements; a single parameter larger than the
  // bucket may go alone if it fits the live limit) and reads upcoming NVMe
  // shards ahead. At most max_ongoing_fetch_events gathers are outstanding
  // (issued and not yet waited for by a fetch() of a module that needs
  // them): a prefetch at the limit is left to a later fetch(), a gather this
  // module needs first waits for the oldest. What is gathered depends only
  // on the calls made, never on timing, so all ranks issue the same
  // collectives. A module that deviates from a complete trace invalidates
  // it: in-flight gathers are drained, one warning is logged per distinct
  // deviation, the rest of the pass runs without a trace, and the next pass
  // records a new one (a deviating pass never becomes the trace: an
  // evaluation pass between training passes costs one invalidation). If a compute
  // stream was set, its later work waits for the gathers. Throws
  // invalid_argument for an unknown module or one already fetched, io for
  // an NVMe read failure, communication for a rank-order mismatch while
  // recording (naming the step and the module of every rank).
  virtual void fetch(ModuleId module) = 0;

  // Ends the use of `module`'s parameters. Each gathered copy is freed unless
  // it is persistent, still used by another fetched module, or (complete
  // trace) needed again within max_reuse_distance elements of upcoming
  // trace or already prefetched for a later use; copies kept that way never
  // push the idle elements above max_live_parameters (of this module's
  // parameters, the ones needed last are freed first; copies kept earlier
  // are not reconsidered). Local, no communication. Throws invalid_argument when
  // the module is not fetched.
  virtual void release(ModuleId module) = 0;

  // Ends one forward+backward pass. While recording, checks that every rank
  // recorded the same module order and, unless the pass deviated from a
  // trace, freezes it as the trace (a mismatch throws
  // communication on every rank, naming the first differing step and the
  // modules of each rank). With a complete trace, a pass shorter than the
  // trace is a deviation (invalidation, as in fetch()). Then waits for every
  // in-flight gather and frees every non-persistent gathered copy. Throws
  // invalid_argument while a module is still fetched.
  virtual void end_step() = 0;

  // Waits for in-flight gathers and frees every non-persistent gathered
  // copy used by no fetched module, persistent ones too when
  // `include_persistent`. Keeps the trace. Local apart from waiting.
  virtual void release_all(bool include_persistent) = 0;

  // Drives in-flight gathers and file reads without blocking. Transports
  // without a progress thread (Open MPI's non-blocking collectives) only
  // overlap communication with computation when someone polls: call this
  // from long computations. Cheap when nothing is in flight.
  virtual void progress() = 0;

  // Optional stream on which the framework computes: after fetch() its later
  // work waits for the gathers, and gathered copies are freed only after
  // work enqueued on it before release() has completed. Null (the default)
  // means the caller computes synchronously on the host side of each call.
  virtual void set_compute_stream(std::shared_ptr<Stream> stream) = 0;

  // --- Queries (no communication) ---

  virtual ParameterStatus status(ParameterId id) const = 0;
  // Ids of the fetched modules currently using the parameter, sorted.
  virtual std::vector<ModuleId> active_modules(ParameterId id) const = 0;
  virtual bool is_persistent(ParameterId id) const = 0;

  // Device pointer to the gathered parameter (world size * shard_numel()
  // elements, the first numel meaningful), valid until the copy is freed
  // (release(), end_step(), release_all(), set_shard()). Throws incompatible
  // unless status(id) == available.
  virtual void* full_data(ParameterId id) = 0;

  // Copies the gathered parameter's first numel elements into host memory
  // (numel * element size bytes) and waits for the copy. Throws incompatible
  // unless available, invalid_argument for a wrong size.
  virtual void read_full(ParameterId id, void* host_out, std::size_t bytes) = 0;

  virtual TraceMode trace_mode() const = 0;
  // The frozen module order (empty while recording).
  virtual std::vector<ModuleId> trace() const = 0;

  virtual CoordinatorStats stats() const = 0;

  // The device memory the gathered copies are made in: what is allocated,
  // reused, in use and kept idle for reuse.
  virtual GatherMemoryStats gather_memory() const = 0;
  // Frees the buffers kept for reuse (none is in use by a gathered copy).
  // Local, no communication.
  virtual void trim_gather_memory() = 0;

  // Recomputes the accounting from scratch and checks every invariant: live
  // elements equal the sum over non-persistent parameters in flight or
  // available; idle elements never exceed max_live_parameters (so live never
  // exceeds max_live_parameters plus the elements of the fetched modules);
  // every in-flight parameter has exactly one gather; the users of each
  // parameter are fetched modules using it; NVMe buffers in use never exceed
  // nvme_buffer_count. Throws internal describing the first violation.
  virtual void check_invariants() const = 0;
};

}  // namespace ductile
