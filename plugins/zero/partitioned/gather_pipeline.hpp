// The machinery of the partitioned coordinator: executes the planner's
// plans on an Accelerator. It owns every device buffer (shards and gathered
// copies, the copies from a pool reused by size: copy_pool.hpp), issues
// coalesced all-gathers on its own communication stream (one item per
// member of a parameter group: one collective a group), keeps their
// handles until a retire step finishes them, and, with a compute stream:
// - a gather starts after the compute stream's work enqueued before it
//   (an optimizer step writing the shards on that stream comes first);
// - a retire step makes the compute stream's later work wait for the
//   gather (an event) and does not wait on the host: the host runs ahead
//   of the device, and the handle is polled later for errors (a gather
//   that read NVMe shards is still waited for: its host buffers go back);
// - a released copy goes back to the pool only once the compute stream has
//   passed the work enqueued before the release (record_stream semantics).
// Shards live in device memory, in pinned host memory (move_shard()) or
// on NVMe, from the read-ahead (nvme_read_ahead.hpp) when one is given. A
// host or NVMe shard is copied to a device buffer of the copy pool on the
// communication stream before its gather, and the host waits for such a
// gather before it returns the buffers: the host may write the shard once
// the gather is retired.
//
// Threading: the coordinator's thread. Errors: Error from the accelerator
// (communication, ...) or from NVMe reads (io). A gather that cannot be
// issued (its shard could not be read) is cancelled in the planner together
// with the later gathers of the plan, so planner and machinery agree again.
// Ownership: owns every buffer it allocates; the destructor waits for
// in-flight gathers and frees everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "copy_pool.hpp"
#include "ductile/accelerator.hpp"
#include "nvme_read_ahead.hpp"
#include "planner.hpp"

namespace ductile::zero {

class GatherPipeline {
 public:
  // `nvme` may be null (no offload); it must outlive the pipeline.
  GatherPipeline(std::shared_ptr<Accelerator> accel, std::shared_ptr<Communicator> comm,
                 NvmeReadAhead* nvme);
  ~GatherPipeline();
  GatherPipeline(const GatherPipeline&) = delete;
  GatherPipeline& operator=(const GatherPipeline&) = delete;

  const std::shared_ptr<Stream>& comm_stream() const { return comm_stream_; }

  // Parameter index `pi` (dense, in order), a group of tensors of
  // `member_numels` elements each (one for a plain parameter), each sharded
  // on its own (register_group() in the SDK): a zero-filled shard in device
  // or host memory (`where`), or none when the shard lives on NVMe.
  void add_parameter(std::uint32_t pi, std::span<const std::size_t> member_numels, DataType type,
                     ShardLocation where);
  std::size_t shard_numel(std::uint32_t pi) const { return params_[pi].shard_numel; }
  std::size_t shard_bytes(std::uint32_t pi) const {
    return params_[pi].shard_numel * params_[pi].element_size;
  }
  ShardLocation location(std::uint32_t pi) const { return params_[pi].location; }
  bool on_nvme(std::uint32_t pi) const { return location(pi) == ShardLocation::nvme; }
  // Moves the shard of `pi` between device and host memory, values kept
  // (`where`: device or host). The caller has retired its gathers and
  // dropped its copy. Throws the accelerator's error with nothing moved.
  void move_shard(std::uint32_t pi, ShardLocation where);
  void* full(std::uint32_t pi) const { return params_[pi].full; }
  void* shard(std::uint32_t pi) const { return params_[pi].shard; }
  void write_shard(std::uint32_t pi, const void* host, std::size_t bytes);
  void read_shard(std::uint32_t pi, void* host, std::size_t bytes);
  // This rank's shard of the members given whole and back to back in
  // `full` (the members' element counts summed), into `shard` (shard_bytes()).
  void slice_full(std::uint32_t pi, int rank, const unsigned char* full,
                  unsigned char* shard) const;
  // Waits for the compute stream, then copies a gathered parameter's members
  // out, back to back (the members' element counts summed).
  void read_full(std::uint32_t pi, void* host, std::size_t bytes);

  // Brings the host sources of `params` (the module's own gather, next in
  // the plan the planner will give) to the device before the planner
  // commits; a failed NVMe read throws here with nothing changed.
  void stage_own(std::span<const std::uint32_t> params);
  // Runs the plan's steps in order; the time retire steps block the host
  // is added to wait_ns when `timed` (none when the compute stream is
  // ordered after a gather instead: see finish()).
  void execute(const Plan& plan, Planner& planner, bool timed);
  // A plan of free steps only (release() plans): frees the copies.
  void free_copies(const Plan& plan);
  // Completes the gathers found finished, oldest first, without blocking
  // (the planner is told; they stay outstanding until a retire step).
  void poll(Planner& planner);
  // Frees the copies whose compute-stream work has completed, and reports a
  // failed gather that the compute stream was ordered after (see finish()).
  void reap_frees();
  void set_compute_stream(std::shared_ptr<Stream> stream);
  // The shards may be written on the compute stream before the next gather
  // (a pass ended, or a shard was written): that gather waits for it.
  void after_shard_writes() { order_after_compute_ = true; }
  GatherMemoryStats memory_stats() const { return pool_.stats(); }
  // The pass has issued its last gather: the pool rests (copy_pool.hpp).
  void rest() { pool_.rest(); }
  // Frees the pool's idle buffers (after the pending frees that completed).
  void trim() {
    reap_frees();
    pool_.trim();
  }

  std::size_t outstanding() const { return batches_.size(); }
  // Throws internal when a buffer disagrees with the planner's status.
  void check_invariants(const Planner& planner) const;

  std::uint64_t wait_ns = 0;  // time retire steps of timed plans blocked the host

 private:
  struct Member {
    std::size_t numel = 0;   // elements of the tensor
    std::size_t shard = 0;   // of each rank's slice: ceil(numel / world)
    std::size_t offset = 0;  // of its slice in the shard (world * offset in the gathered copy)
  };
  struct DeviceParameter {
    std::size_t shard_numel = 0;  // sum of the members' slices
    std::size_t element_size = 0;
    DataType type = DataType::f32;
    ShardLocation location = ShardLocation::device;
    std::vector<Member> members;
    void* shard = nullptr;  // device or pinned host memory (none on NVMe)
    void* full = nullptr;   // gathered copy, world * shard_numel elements, member-major
  };
  struct DeviceCopy {
    void* pointer;
    std::size_t bytes;
  };
  // Sources of one gather and what holds them until it completes.
  struct Staging {
    std::vector<const void*> sources;
    std::vector<DeviceCopy> device;  // of host and NVMe shards, from the pool
    StagedShards shards;
    void clear() {
      sources.clear();
      device.clear();
      shards.host_temp.clear();
      shards.slots.clear();
    }
  };
  struct Batch {
    std::uint64_t id = 0;
    bool done = false;
    std::shared_ptr<CollectiveHandle> handle;
    std::shared_ptr<Event> event;  // recorded after the gather (with a compute stream)
    Staging staging;
  };
  // A gather the compute stream was ordered after without the host
  // waiting: its handle is polled later, so that a failed collective is
  // still reported (by the next fetch or end of a pass).
  struct Ordered {
    std::shared_ptr<CollectiveHandle> handle;
  };
  struct PendingFree {
    void* pointer;
    std::size_t bytes;
    std::shared_ptr<Event> event;
  };

  // No shard lives on the host or NVMe: a gather reads the shards themselves.
  bool all_on_device() const { return !nvme_ && host_shards_ == 0; }
  void stage(std::span<const std::uint32_t> params, Staging& out);
  void unstage(Staging& staging);
  void issue(const Plan& plan, const Step& step, Batch& b);
  void finish(Batch& b);
  // Polls the gathers finished without a host wait (see Ordered); with
  // `all`, waits for them.
  void check_ordered(bool all);
  void retire_through(std::uint64_t id);
  void free_copy(std::uint32_t pi);

  std::shared_ptr<Accelerator> accel_;
  std::shared_ptr<Communicator> comm_;
  NvmeReadAhead* nvme_;
  std::size_t world_ = 1;
  std::shared_ptr<Stream> comm_stream_;
  std::shared_ptr<Stream> copy_stream_;
  std::shared_ptr<Stream> compute_stream_;

  CopyPool pool_;  // before params_ and pending_frees_: outlives what they give back
  std::vector<DeviceParameter> params_;
  std::deque<Batch> batches_;   // issued, not yet retired, oldest first
  std::vector<Staging> spare_;  // of retired gathers, kept for their vectors' capacity
  std::deque<PendingFree> pending_frees_;
  std::deque<Ordered> ordered_;                       // oldest first
  std::vector<std::shared_ptr<Event>> spare_events_;  // of reaped frees, recorded again
  std::shared_ptr<Event> compute_done_;               // the compute stream's end at a gather
  bool order_after_compute_ = true;
  bool timing_ = false;  // a timed plan's retire step is running
  Staging own_;          // staged by stage_own() for the next own gather
  bool own_staged_ = false;
  std::vector<GatherItem> items_;  // scratch
  std::size_t host_shards_ = 0;    // parameters whose shard is in host memory
};

}  // namespace ductile::zero
