// The cuda accelerator: CUDA runtime for memory, streams and events; NCCL for
// collectives, its unique id exchanged over the MPI bootstrap. Every runtime
// and NCCL call is checked; nothing on the collective path synchronizes the
// device (handles are CUDA events polled without blocking).
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "accelerator_base.hpp"
#include "backend_object.hpp"
#include "checked_communicator.hpp"
#include "ductile/accelerator.hpp"
#include "library_pin.hpp"

namespace ductile::accel {
namespace {

constexpr ParamSpec kSchema[] = {
    {.key = "device",
     .type = ParamType::integer,
     .flags = param_has_min,
     .default_value = "-1",
     .min_value = -1,
     .doc = "CUDA device ordinal; -1 picks the launcher's local rank modulo the number of devices"},
    {.key = "communicator",
     .type = ParamType::string,
     .default_value = "\"auto\"",
     .allowed_values = kCommunicatorModes,
     .doc = "How ranks are found for the NCCL bootstrap: \"mpi\", \"local\" (one process) or "
            "\"auto\"; "
            "\"host\" (or \"auto\" when the embedding program offers one): the host's communicator "
            "(e.g. torch.distributed's NCCL process group) carries the collectives instead"},
    {.key = "timeout",
     .type = ParamType::floating,
     .flags = param_has_min,
     .default_value = "600",
     .doc = "Seconds a collective may take in wait() before the NCCL communicator is aborted and a "
            "communication error thrown; 0 waits forever"},
};

std::string cuda_message(cudaError_t error) {
  return std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
}

[[noreturn]] void throw_cuda(cudaError_t error, const char* call) {
  ErrorKind kind =
      error == cudaErrorMemoryAllocation ? ErrorKind::incompatible : ErrorKind::internal;
  throw Error(kind, std::string("cuda accelerator: ") + call + " failed: " + cuda_message(error));
}

#define DUCTILE_CUDA_CHECK(call)                                          \
  do {                                                                    \
    cudaError_t ductile_error_ = (call);                                  \
    if (ductile_error_ != cudaSuccess) throw_cuda(ductile_error_, #call); \
  } while (0)

[[noreturn]] void throw_nccl(ncclResult_t result, const char* call, ncclComm_t comm) {
  std::string message =
      std::string("cuda accelerator: ") + call + " failed: " + ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') message += std::string(" (") + last + ")";
  throw Error(ErrorKind::communication, message);
}

#define DUCTILE_NCCL_CHECK(call, comm)                                            \
  do {                                                                            \
    ncclResult_t ductile_result_ = (call);                                        \
    if (ductile_result_ != ncclSuccess) throw_nccl(ductile_result_, #call, comm); \
  } while (0)

// NCCL's types and ops, indexed by DataType and ReduceOp (both checked by
// CheckedCommunicator before a collective gets here).
constexpr ncclDataType_t kNcclTypes[] = {ncclFloat32, ncclFloat64, ncclFloat16, ncclBfloat16,
                                         ncclInt32,   ncclInt64,   ncclUint8};
constexpr ncclRedOp_t kNcclOps[] = {ncclSum, ncclProd, ncclMin, ncclMax};

ncclDataType_t nccl_type(DataType type) {
  return kNcclTypes[static_cast<std::size_t>(type)];
}

ncclRedOp_t nccl_op(ReduceOp op) {
  return kNcclOps[static_cast<std::size_t>(op)];
}

// The runtime's current device is per host thread: set it on entry.
void use_device(int device) {
  DUCTILE_CUDA_CHECK(cudaSetDevice(device));
}

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int device) : device_(device) {
    use_device(device_);
    DUCTILE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  // A queue the embedder owns (NativeStreams): not destroyed here.
  CudaStream(int device, cudaStream_t external)
      : device_(device), stream_(external), owned_(false) {}
  ~CudaStream() override {
    if (!owned_) return;
    cudaSetDevice(device_);
    cudaStreamDestroy(stream_);  // returns at once; pending work still completes
  }
  void synchronize() override {
    use_device(device_);
    DUCTILE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  bool query() override {
    cudaError_t status = cudaStreamQuery(stream_);
    if (status == cudaErrorNotReady) return false;
    if (status != cudaSuccess) throw_cuda(status, "cudaStreamQuery");
    return true;
  }
  void wait_event(Event& event) override;
  cudaStream_t get() const noexcept { return stream_; }
  int device() const noexcept { return device_; }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = true;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int device) : device_(device) {
    use_device(device_);
    DUCTILE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void record(Stream& stream) override;
  bool query() override {
    cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    if (status != cudaSuccess) throw_cuda(status, "cudaEventQuery");
    return true;
  }
  void synchronize() override { DUCTILE_CUDA_CHECK(cudaEventSynchronize(event_)); }
  cudaEvent_t get() const noexcept { return event_; }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

CudaStream& as_cuda_stream(Stream& stream, const char* call) {
  return backend_object<CudaStream>(stream, call, "stream", "the cuda accelerator");
}

CudaEvent& as_cuda_event(Event& event, const char* call) {
  return backend_object<CudaEvent>(event, call, "event", "the cuda accelerator");
}

void CudaStream::wait_event(Event& event) {
  CudaEvent& cuda_event = as_cuda_event(event, "Stream::wait_event");
  DUCTILE_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda_event.get(), 0));
}

void CudaEvent::record(Stream& stream) {
  CudaStream& cuda_stream = as_cuda_stream(stream, "Event::record");
  DUCTILE_CUDA_CHECK(cudaEventRecord(event_, cuda_stream.get()));
}

// The NCCL communicator, shared by the Communicator and its handles so that
// a handle can abort it on timeout.
struct NcclState {
  ncclComm_t comm = nullptr;
  int device = 0;
  double timeout = 0;
  std::mutex mutex;  // NCCL calls on one communicator are not thread-safe
  bool aborted = false;
  std::string abort_reason;

  ~NcclState() {
    if (comm == nullptr) return;
    cudaSetDevice(device);
    if (!aborted) {
      // Flushes what was issued (blocking comm), then frees.
      ncclCommFinalize(comm);
      ncclCommDestroy(comm);
    }
  }
};

class NcclHandle final : public CollectiveHandle {
 public:
  NcclHandle(std::shared_ptr<NcclState> state, int device, cudaStream_t stream, std::string what)
      : state_(std::move(state)), what_(std::move(what)) {
    use_device(device);
    DUCTILE_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    DUCTILE_CUDA_CHECK(cudaEventRecord(done_, stream));
    start_ = std::chrono::steady_clock::now();
  }
  ~NcclHandle() override { cudaEventDestroy(done_); }

  bool query() override {
    cudaError_t status = cudaEventQuery(done_);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) throw_cuda(status, "cudaEventQuery");
    check_async();
    return false;
  }

  // Polls rather than blocking in cudaEventSynchronize, so that a dead peer
  // is noticed (NCCL's asynchronous error) and the timeout can abort. The
  // first 100 us spin: the shortest sleep lasts ~60 us on Linux (timer
  // slack), which made every small collective cost that much on an H100
  // (72 us for a 4-byte all-gather of one rank; accelerators/cuda/README.md).
  void wait() override {
    auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
    while (std::chrono::steady_clock::now() < spin_until) {
      if (query()) return;
      std::this_thread::yield();
    }
    auto pause = std::chrono::microseconds(5);
    while (!query()) {
      if (state_->timeout > 0 && std::chrono::steady_clock::now() - start_ >
                                     std::chrono::duration<double>(state_->timeout))
        abort(what_ +
              " did not complete within the collective timeout; the NCCL communicator "
              "was aborted (a peer has failed or did not issue the same collectives)");
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }

 private:
  void check_async() {
    std::lock_guard lock(state_->mutex);
    if (state_->aborted)
      throw Error(ErrorKind::communication, what_ + " failed: " + state_->abort_reason);
    ncclResult_t async = ncclSuccess;
    DUCTILE_NCCL_CHECK(ncclCommGetAsyncError(state_->comm, &async), state_->comm);
    if (async != ncclSuccess && async != ncclInProgress) {
      std::string reason = std::string("NCCL reported ") + ncclGetErrorString(async);
      state_->aborted = true;
      state_->abort_reason = reason;
      ncclCommAbort(state_->comm);
      throw Error(ErrorKind::communication, what_ + " failed: " + reason);
    }
  }

  [[noreturn]] void abort(const std::string& reason) {
    std::lock_guard lock(state_->mutex);
    if (!state_->aborted) {
      state_->aborted = true;
      state_->abort_reason = reason;
      ncclCommAbort(state_->comm);
    }
    throw Error(ErrorKind::communication, reason);
  }

  std::shared_ptr<NcclState> state_;
  std::string what_;
  cudaEvent_t done_ = nullptr;
  std::chrono::steady_clock::time_point start_;
};

class NcclCommunicator final : public CheckedCommunicator {
 public:
  NcclCommunicator(Bootstrap& bootstrap, int device, double timeout)
      : state_(std::make_shared<NcclState>()), rank_(bootstrap.rank()), size_(bootstrap.size()) {
    state_->device = device;
    state_->timeout = timeout;
    ncclUniqueId id{};
    if (rank_ == 0) DUCTILE_NCCL_CHECK(ncclGetUniqueId(&id), nullptr);
    auto blob = bootstrap.broadcast(std::as_bytes(std::span(&id, 1)), 0);
    if (blob.size() != sizeof(id))
      throw Error(ErrorKind::communication,
                  "cuda accelerator: the NCCL unique id from rank 0 has " +
                      std::to_string(blob.size()) + " bytes, expected " +
                      std::to_string(sizeof(id)));
    std::memcpy(&id, blob.data(), sizeof(id));
    use_device(device);
    DUCTILE_NCCL_CHECK(ncclCommInitRank(&state_->comm, size_, id, rank_), nullptr);
    DUCTILE_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
  }
  ~NcclCommunicator() override {
    cudaSetDevice(state_->device);
    cudaFree(scratch_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

 private:
  std::shared_ptr<CollectiveHandle> do_all_gather(const void* send, void* recv, std::size_t count,
                                                  DataType type, Stream& stream) override {
    return issue(stream, "all_gather", [&](ncclComm_t comm, cudaStream_t s) {
      DUCTILE_NCCL_CHECK(ncclAllGather(send, recv, count, nccl_type(type), comm, s), comm);
    });
  }

  std::shared_ptr<CollectiveHandle> do_all_gather_coalesced(std::span<const GatherItem> items,
                                                            std::size_t, Stream& stream) override {
    // One NCCL group: the gathers are fused into one launch.
    return issue(stream, "all_gather_coalesced", [&](ncclComm_t comm, cudaStream_t s) {
      DUCTILE_NCCL_CHECK(ncclGroupStart(), comm);
      ncclResult_t first = ncclSuccess;
      for (const GatherItem& item : items) {
        ncclResult_t r =
            ncclAllGather(item.send, item.recv, item.count, nccl_type(item.type), comm, s);
        if (r != ncclSuccess && first == ncclSuccess) first = r;
      }
      ncclResult_t end = ncclGroupEnd();
      if (first != ncclSuccess) throw_nccl(first, "ncclAllGather (in group)", comm);
      if (end != ncclSuccess) throw_nccl(end, "ncclGroupEnd", comm);
    });
  }

  std::shared_ptr<CollectiveHandle> do_reduce_scatter(const void* send, void* recv,
                                                      std::size_t count, DataType type, ReduceOp op,
                                                      Stream& stream) override {
    return issue(stream, "reduce_scatter", [&](ncclComm_t comm, cudaStream_t s) {
      DUCTILE_NCCL_CHECK(
          ncclReduceScatter(send, recv, count, nccl_type(type), nccl_op(op), comm, s), comm);
    });
  }

  std::shared_ptr<CollectiveHandle> do_all_reduce(const void* send, void* recv, std::size_t count,
                                                  DataType type, ReduceOp op,
                                                  Stream& stream) override {
    return issue(stream, "all_reduce", [&](ncclComm_t comm, cudaStream_t s) {
      DUCTILE_NCCL_CHECK(ncclAllReduce(send, recv, count, nccl_type(type), nccl_op(op), comm, s),
                         comm);
    });
  }

  std::shared_ptr<CollectiveHandle> do_broadcast(void* buffer, std::size_t count, DataType type,
                                                 int root, Stream& stream) override {
    return issue(stream, "broadcast", [&](ncclComm_t comm, cudaStream_t s) {
      DUCTILE_NCCL_CHECK(ncclBroadcast(buffer, buffer, count, nccl_type(type), root, comm, s),
                         comm);
    });
  }

  // NCCL has no barrier: a one-element all-reduce on device scratch memory.
  std::shared_ptr<CollectiveHandle> do_barrier(Stream& stream) override {
    return issue(stream, "barrier", [&](ncclComm_t comm, cudaStream_t s) {
      DUCTILE_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm, s), comm);
    });
  }

  template <class Enqueue>
  std::shared_ptr<CollectiveHandle> issue(Stream& stream, const char* call, Enqueue&& enqueue) {
    CudaStream& cuda_stream = as_cuda_stream(stream, call);
    std::lock_guard lock(state_->mutex);
    if (state_->aborted)
      throw Error(ErrorKind::communication, std::string(call) +
                                                ": the NCCL communicator was aborted earlier (" +
                                                state_->abort_reason + ")");
    use_device(state_->device);
    enqueue(state_->comm, cuda_stream.get());
    std::string what = std::string(call) + " (nccl communicator, rank " + std::to_string(rank_) +
                       " of " + std::to_string(size_) + ")";
    return std::make_shared<NcclHandle>(state_, state_->device, cuda_stream.get(), std::move(what));
  }

  std::shared_ptr<NcclState> state_;
  int rank_, size_;
  void* scratch_ = nullptr;
};

class CudaAccelerator final : public AcceleratorBase,
                              public NativeStreams,
                              public NativeStreamHandles {
 public:
  explicit CudaAccelerator(const HostContext& context)
      : AcceleratorBase(context, "cuda", "cuda bootstrap") {
    int count = 0;
    cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess || count == 0)
      throw Error(ErrorKind::unsupported,
                  "cuda accelerator: no usable CUDA device (cudaGetDeviceCount: " +
                      (status != cudaSuccess ? cuda_message(status) : std::string("0 devices")) +
                      "); a GPU and the NVIDIA driver are required");
    count_ = count;
    device_ = choose_device(context, count, "CUDA");
    use_device(device_);
    DUCTILE_CUDA_CHECK(cudaFree(nullptr));  // creates the primary context now, not mid-step
    pin_library_of(reinterpret_cast<const void*>(&nccl_type));
    logger()->debug("cuda accelerator: device {} of {}", device_, count_);
  }

  int device_count() const override { return count_; }
  int current_device() const override { return device_; }

  void deallocate(void* pointer, MemoryKind kind) noexcept override {
    if (pointer == nullptr) return;
    cudaSetDevice(device_);
    if (kind == MemoryKind::pinned_host) {
      cudaFreeHost(pointer);
    } else {
      cudaFree(pointer);
    }
  }

  std::shared_ptr<Stream> create_stream() override { return std::make_shared<CudaStream>(device_); }
  std::shared_ptr<Event> create_event() override { return std::make_shared<CudaEvent>(device_); }

  // A cudaStream_t of the embedder's (torch's current stream), on this
  // device; null is the default stream (torch's unless it set another).
  std::shared_ptr<Stream> wrap_native_stream(void* native) override {
    return std::make_shared<CudaStream>(device_, static_cast<cudaStream_t>(native));
  }

  void* native_handle(Stream& stream) override {
    return as_cuda_stream(stream, "native_handle").get();
  }

 private:
  DeviceInfo do_device_info(int device) const override {
    cudaDeviceProp properties{};
    DUCTILE_CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
    DeviceInfo info;
    info.name = properties.name;
    info.total_memory = properties.totalGlobalMem;
    use_device(device);
    std::size_t free_bytes = 0, total_bytes = 0;
    cudaError_t status = cudaMemGetInfo(&free_bytes, &total_bytes);
    use_device(device_);
    if (status != cudaSuccess) throw_cuda(status, "cudaMemGetInfo");
    info.free_memory = free_bytes;
    return info;
  }

  void* do_allocate(std::size_t bytes, MemoryKind kind) override {
    use_device(device_);
    // cudaMalloc(0) gives nullptr; the interface promises a unique pointer.
    std::size_t size = bytes == 0 ? 256 : bytes;
    void* pointer = nullptr;
    if (kind == MemoryKind::pinned_host) {
      DUCTILE_CUDA_CHECK(cudaMallocHost(&pointer, size));
    } else {
      DUCTILE_CUDA_CHECK(cudaMalloc(&pointer, size));
    }
    return pointer;
  }

  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                     Stream& stream) override {
    const char* call = "copy_async";
    cudaMemcpyKind cuda_kind = cudaMemcpyDefault;
    switch (kind) {
      case CopyKind::host_to_device:
        cuda_kind = cudaMemcpyHostToDevice;
        break;
      case CopyKind::device_to_host:
        cuda_kind = cudaMemcpyDeviceToHost;
        break;
      case CopyKind::device_to_device:
        cuda_kind = cudaMemcpyDeviceToDevice;
        break;
      case CopyKind::host_to_host:
        cuda_kind = cudaMemcpyHostToHost;
        break;
    }
    CudaStream& cuda_stream = as_cuda_stream(stream, call);
    if (bytes == 0) return;
    use_device(device_);
    DUCTILE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cuda_kind, cuda_stream.get()));
  }

  void do_memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override {
    CudaStream& cuda_stream = as_cuda_stream(stream, "memset_async");
    if (bytes == 0) return;
    use_device(device_);
    DUCTILE_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, cuda_stream.get()));
  }

  // NCCL's communicator, set up through the bootstrap over the host world.
  std::shared_ptr<Communicator> make_world() override {
    return std::make_shared<NcclCommunicator>(*bootstrap_locked(), device_, timeout());
  }

  int count_ = 0;
  int device_ = 0;
};

}  // namespace
}  // namespace ductile::accel

DUCTILE_PLUGIN(ductile::accel::CudaAccelerator, "cuda", "1.0.0",
               "CUDA devices with NCCL collectives (bootstrap over MPI)", ductile::accel::kSchema)
