// The Accelerator interface: device memory, streams, events and collective
// communication. Backends (cpu, cuda, level_zero) implement it as plugins of
// kind PluginKind::accelerator; the ZeRO-3 coordinator and embedding
// frameworks use it.
//
// Conventions for every call below unless a call says otherwise:
// - Errors: throws ductile::Error. ErrorKind::invalid_argument for a bad
//   argument (null pointer with a non-zero size, unknown device, mismatched
//   sizes), ErrorKind::unsupported when the backend lacks the feature,
//   ErrorKind::communication when a collective or peer fails, and
//   ErrorKind::internal when the device runtime reports an unexpected failure.
//   The message names the call and, for runtime failures, the runtime's own
//   error string.
// - Threading: an Accelerator may be used from several threads; a single
//   Stream, Event or CollectiveHandle is used by one thread at a time.
//   Communicators issue collectives in call order: every rank must issue the
//   same collectives in the same order (as with MPI and NCCL).
// - Ownership: objects are returned as shared_ptr and keep what they need of
//   the backend alive. Memory returned by allocate() is owned by the caller
//   and released with deallocate() on the same accelerator.
// - Asynchrony: *_async calls and collectives only enqueue work on a stream;
//   buffers they read or write must stay valid until that work completes
//   (observe it with a stream synchronize, an event, or the handle).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ductile/plugin.hpp"

namespace ductile {

// Element types understood by collectives. fp16 and bf16 are carried as raw
// 16-bit values; reductions on them are computed in fp32 by backends that
// reduce on the host.
enum class DataType : std::uint32_t { f32, f64, f16, bf16, i32, i64, u8 };

DUCTILE_SDK_API inline std::size_t size_of(DataType t) noexcept {
  switch (t) {
    case DataType::f32:
      return 4;
    case DataType::f64:
      return 8;
    case DataType::f16:
      return 2;
    case DataType::bf16:
      return 2;
    case DataType::i32:
      return 4;
    case DataType::i64:
      return 8;
    case DataType::u8:
      return 1;
  }
  return 0;
}

enum class ReduceOp : std::uint32_t { sum, prod, min, max };

enum class MemoryKind : std::uint32_t {
  device,       // memory of the current device
  pinned_host,  // page-locked host memory, fast to copy to and from the device
};

enum class CopyKind : std::uint32_t {
  host_to_device,
  device_to_host,
  device_to_device,
  host_to_host
};

struct DeviceInfo {
  std::string name;
  std::size_t total_memory = 0;  // bytes
  std::size_t free_memory = 0;   // bytes, as far as the backend can tell
};

class Event;

// An in-order queue of work.
class DUCTILE_SDK_API Stream {
 public:
  virtual ~Stream() = default;
  // Blocks until all work enqueued so far has completed. Rethrows (as
  // ductile::Error) the first failure of enqueued work. Host-executed
  // streams (cpu) keep the failure: later work is skipped and every later
  // synchronize() rethrows it; device streams follow their runtime.
  virtual void synchronize() = 0;
  // True when all work enqueued so far has completed. Non-blocking.
  virtual bool query() = 0;
  // Work enqueued after this call starts only once `event` has completed.
  virtual void wait_event(Event& event) = 0;
};

// A marker in a stream.
class DUCTILE_SDK_API Event {
 public:
  virtual ~Event() = default;
  // Captures the current end of `stream`; completes when everything enqueued
  // on it before this call has completed. Re-recording is allowed.
  virtual void record(Stream& stream) = 0;
  // True when the recorded work has completed (true if never recorded).
  virtual bool query() = 0;
  // Blocks until the recorded work has completed.
  virtual void synchronize() = 0;
};

// An asynchronous collective in progress.
class DUCTILE_SDK_API CollectiveHandle {
 public:
  virtual ~CollectiveHandle() = default;
  // True when the collective has completed and its output is readable by the
  // host (for host-visible memory) or by later work on its stream. Never
  // blocks; drives progress where the transport needs it.
  virtual bool query() = 0;
  // Blocks until complete. Throws ErrorKind::communication on failure.
  virtual void wait() = 0;
};

// One tensor of a coalesced all-gather: `count` elements of `type` from
// `send` on every rank, gathered into `recv` (size() * count elements, rank r's
// part at offset r * count).
struct GatherItem {
  const void* send;
  void* recv;
  std::size_t count;
  DataType type;
};

// Collectives over a fixed group of ranks.
//
// Every collective is enqueued on `stream` after the work already there;
// later work on the stream sees its output. It returns at once with a handle.
// In place: all_gather with send == recv + rank() * count elements, and
// all_reduce with send == recv; reduce_scatter buffers must not overlap.
// Counts are per rank; the cpu and level_zero backends (MPI) accept at most
// 2^31-1 elements per rank (ErrorKind::unsupported beyond). A null buffer is
// accepted only with a zero count. Argument errors are thrown before
// anything is issued, so the ranks' issue order is not disturbed.
// A collective that fails or exceeds the backend's timeout fails its handle
// (ErrorKind::communication), fails its stream (sticky, see Stream) and
// makes the communicator unusable: later collectives fail at once.
class DUCTILE_SDK_API Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // recv holds size() * count elements; rank r's `send` lands at r * count.
  virtual std::shared_ptr<CollectiveHandle> all_gather(const void* send, void* recv,
                                                       std::size_t count, DataType type,
                                                       Stream& stream) = 0;
  // Several all-gathers as one collective operation.
  virtual std::shared_ptr<CollectiveHandle> all_gather_coalesced(std::span<const GatherItem> items,
                                                                 Stream& stream) = 0;
  // send holds size() * count elements; rank r receives the reduction of
  // block r (count elements) over all ranks.
  virtual std::shared_ptr<CollectiveHandle> reduce_scatter(const void* send, void* recv,
                                                           std::size_t count, DataType type,
                                                           ReduceOp op, Stream& stream) = 0;
  // send may equal recv (in place).
  virtual std::shared_ptr<CollectiveHandle> all_reduce(const void* send, void* recv,
                                                       std::size_t count, DataType type,
                                                       ReduceOp op, Stream& stream) = 0;
  virtual std::shared_ptr<CollectiveHandle> broadcast(void* buffer, std::size_t count,
                                                      DataType type, int root, Stream& stream) = 0;
  virtual std::shared_ptr<CollectiveHandle> barrier(Stream& stream) = 0;
};

// Where this process sits in a job, as its launcher tells it through the
// environment. Backends use it to decide whether to start MPI and which device
// to pick; embedders may use it the same way.
struct LaunchInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  // Which variables were found: "OMPI_COMM_WORLD" (Open MPI's mpirun),
  // "PMI" (MPICH/Hydra, Intel MPI), "RANK/WORLD_SIZE" (torchrun and similar),
  // or "" when the process was started without a launcher.
  std::string source;
  bool from_launcher() const noexcept { return !source.empty(); }
};

namespace detail {
inline bool read_env_int(const char* name, int& out) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return false;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  if (*end != '\0' || value < 0 || value > 1L << 30)
    throw Error(ErrorKind::invalid_argument, std::string("environment variable ") + name + "='" +
                                                 text + "' is not a non-negative integer");
  out = static_cast<int>(value);
  return true;
}
}  // namespace detail

// Reads, in order of preference, OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK,
// PMI_RANK/PMI_SIZE (local rank from MPI_LOCALRANKID), RANK/WORLD_SIZE
// (LOCAL_RANK). Throws ductile::Error (invalid_argument) naming the variable
// when one is set but is not a number, or when the rank is not below the size.
// Threading: reads the environment only; safe from any thread.
inline LaunchInfo detect_launch() {
  struct Scheme {
    const char* source;
    const char* rank;
    const char* size;
    const char* local_rank;
  };
  static constexpr Scheme kSchemes[] = {
      {"OMPI_COMM_WORLD", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
       "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"PMI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
      {"RANK/WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK"},
  };
  LaunchInfo info;
  for (const Scheme& scheme : kSchemes) {
    int rank = 0, size = 0;
    bool has_rank = detail::read_env_int(scheme.rank, rank);
    bool has_size = detail::read_env_int(scheme.size, size);
    if (!has_rank || !has_size) continue;
    if (size < 1 || rank >= size)
      throw Error(ErrorKind::invalid_argument,
                  std::string("launcher variables ") + scheme.rank + "=" + std::to_string(rank) +
                      " and " + scheme.size + "=" + std::to_string(size) +
                      " are inconsistent: the rank must be below the size");
    info.rank = rank;
    info.size = size;
    info.source = scheme.source;
    if (!detail::read_env_int(scheme.local_rank, info.local_rank)) info.local_rank = 0;
    return info;
  }
  return info;
}

// Out-of-band exchange among the ranks of the job, for setting up transports:
// an NCCL unique id, a Level Zero IPC handle, a host address.
//
// Threading: calls are collective and blocking; every rank makes the same
// calls in the same order, from one thread at a time.
// Errors: ductile::Error (communication) when a peer fails or times out;
// invalid_argument for a root outside [0, size()).
class DUCTILE_SDK_API Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Returns rank `root`'s blob on every rank (the blob passed by other ranks
  // is ignored; its size may differ).
  virtual std::vector<std::byte> broadcast(std::span<const std::byte> blob, int root = 0) = 0;
  virtual void barrier() = 0;
};

// Optional capability of an accelerator: a world communicator supplied by
// the embedding program, so that a host framework's own communication
// (torch.distributed's process group, through ductile.torch.zero3) carries
// ductile's collectives instead of MPI or NCCL. Find it with
// dynamic_cast<HostWorld*>(accelerator.get()); it is a separate interface
// so that backends built against an SDK without it still load.
//
// Threading: call before the first world() or bootstrap(), from the thread
// that sets the accelerator up. Errors: ductile::Error (incompatible) when
// world() has already been made, invalid_argument for a null communicator.
class DUCTILE_SDK_API HostWorld {
 public:
  virtual ~HostWorld() = default;
  // Offers `world` as the world communicator. Taken (returns true) when the
  // accelerator's `communicator` key is "host" or "auto": world() and
  // bootstrap() then run over it, and MPI and NCCL are never started.
  // Declined (returns false, nothing changes) for "mpi" and "local".
  // The communicator must keep the Communicator contract, stream ordering
  // included; the accelerator keeps a reference to it.
  virtual bool offer_world(std::shared_ptr<Communicator> world) = 0;
};

// Optional capability of an accelerator: Streams over queues the embedding
// framework owns (for cuda, a cudaStream_t such as torch's current stream),
// so that ductile's work is ordered against the framework's with events
// instead of host synchronisation. Find it with
// dynamic_cast<NativeStreams*>(accelerator.get()).
//
// Ownership: the Stream does not own the native queue; the caller keeps it
// alive as long as the Stream. Threading: as for Stream. Errors: none beyond
// the backend's runtime errors; a null native handle is the backend's
// default queue (cuda's default stream).
class DUCTILE_SDK_API NativeStreams {
 public:
  virtual ~NativeStreams() = default;
  // synchronize(), query() and wait_event() act on `native`, events recorded
  // on the Stream mark its work, and work of this accelerator may be
  // enqueued on it.
  virtual std::shared_ptr<Stream> wrap_native_stream(void* native) = 0;
};

// Optional capability of an accelerator: the native queue under one of its
// Streams (for cuda, the cudaStream_t), so that a host framework's own
// collectives (torch.distributed's process group as a HostWorld) can be
// ordered after ductile's work on that stream, and ductile's after theirs,
// without host synchronisation. Find it with
// dynamic_cast<NativeStreamHandles*>(accelerator.get()); a separate
// interface so that backends built without it still load.
//
// Ownership: the handle stays owned by the Stream (valid as long as it).
// Threading: as for Stream. Errors: invalid_argument for a Stream of another
// accelerator.
class DUCTILE_SDK_API NativeStreamHandles {
 public:
  virtual ~NativeStreamHandles() = default;
  virtual void* native_handle(Stream& stream) = 0;
};

// A compute device with its memory, queues and communication.
class DUCTILE_SDK_API Accelerator : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::accelerator;

  // "cpu", "cuda", "level_zero".
  virtual std::string_view backend() const = 0;

  // Devices visible to this process and the one this instance uses.
  virtual int device_count() const = 0;
  virtual int current_device() const = 0;
  virtual DeviceInfo device_info(int device) const = 0;

  // Memory. allocate() of 0 bytes returns a unique non-null pointer that
  // must still be deallocated. Throws ErrorKind::incompatible when out of
  // memory.
  virtual void* allocate(std::size_t bytes, MemoryKind kind) = 0;
  virtual void deallocate(void* pointer, MemoryKind kind) noexcept = 0;

  virtual std::shared_ptr<Stream> create_stream() = 0;
  virtual std::shared_ptr<Event> create_event() = 0;

  virtual void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                          Stream& stream) = 0;
  virtual void memset_async(void* dst, int value, std::size_t bytes, Stream& stream) = 0;

  // The communicator over all ranks of the job (created on first call, which
  // every rank must make). Rank and size come from MPI or from the launcher's
  // variables; a single process without a launcher is rank 0 of 1.
  virtual std::shared_ptr<Communicator> world() = 0;

  // Blocking out-of-band exchange over the same ranks as world() (created on
  // first call, which every rank must make). Backends without one throw
  // ErrorKind::unsupported.
  virtual std::shared_ptr<Bootstrap> bootstrap() {
    throw Error(ErrorKind::unsupported,
                std::string("the ") + std::string(backend()) + " accelerator has no bootstrap");
  }
};

}  // namespace ductile
