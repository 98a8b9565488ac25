// The level_zero accelerator: Level Zero driver and device discovery, device
// and host memory, immediate command lists as streams (a barrier after each
// operation keeps them in order), host-visible events, and collectives
// staged through host memory over the MPI communicator.
//
// Cost of staging: every collective copies its input device-to-host, waits
// for that copy on the host, runs the MPI collective on host buffers, and
// copies the output host-to-device: two extra PCIe transfers and a host round
// trip per collective. The device stream keeps running earlier work, and
// later work on it waits (on a host-signalled event) only for the collective.
#include <level_zero/ze_api.h>

#include <climits>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "accelerator_base.hpp"
#include "backend_object.hpp"
#include "checked_communicator.hpp"
#include "ductile/accelerator.hpp"
#include "host_stream.hpp"
#include "library_pin.hpp"

namespace ductile::accel {
namespace {

constexpr ParamSpec kSchema[] = {
    {.key = "device",
     .type = ParamType::integer,
     .flags = param_has_min,
     .default_value = "-1",
     .min_value = -1,
     .doc =
         "Device index within the first GPU driver; -1 picks the launcher's local rank modulo the "
         "number of devices"},
    {.key = "communicator",
     .type = ParamType::string,
     .default_value = "\"auto\"",
     .allowed_values = kCommunicatorModes,
     .doc = "Host communicator for the staged collectives: \"mpi\", \"local\" (one process) or "
            "\"auto\""},
    {.key = "timeout",
     .type = ParamType::floating,
     .flags = param_has_min,
     .default_value = "600",
     .doc = "Seconds a collective may take before it fails with a communication error; 0 waits "
            "forever"},
};

// The results worth naming in messages; any other prints as "a Level Zero error".
#define DUCTILE_ZE_RESULT(result) std::pair<ze_result_t, const char*>(result, #result)
constexpr std::pair<ze_result_t, const char*> kResultNames[] = {
    DUCTILE_ZE_RESULT(ZE_RESULT_SUCCESS),
    DUCTILE_ZE_RESULT(ZE_RESULT_NOT_READY),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_DEVICE_LOST),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_UNINITIALIZED),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_UNSUPPORTED_VERSION),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_UNSUPPORTED_FEATURE),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_INVALID_ARGUMENT),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_INVALID_NULL_HANDLE),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_INVALID_NULL_POINTER),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_INVALID_SIZE),
    DUCTILE_ZE_RESULT(ZE_RESULT_ERROR_UNKNOWN),
};
#undef DUCTILE_ZE_RESULT

const char* result_name(ze_result_t result) {
  for (const auto& [code, name] : kResultNames)
    if (code == result) return name;
  return "a Level Zero error";
}

[[noreturn]] void throw_ze(ze_result_t result, const char* call) {
  ErrorKind kind = (result == ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY ||
                    result == ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY)
                       ? ErrorKind::incompatible
                       : ErrorKind::internal;
  throw Error(
      kind, std::string("level_zero accelerator: ") + call + " failed: " + result_name(result) +
                " (0x" +
                [&] {
                  char hex[16];
                  std::snprintf(hex, sizeof hex, "%x", static_cast<unsigned>(result));
                  return std::string(hex);
                }() +
                ")");
}

#define DUCTILE_ZE_CHECK(call)                                                  \
  do {                                                                          \
    ze_result_t ductile_result_ = (call);                                       \
    if (ductile_result_ != ZE_RESULT_SUCCESS) throw_ze(ductile_result_, #call); \
  } while (0)

// A host-visible event with its own pool (pools are cheap; lifetimes simple).
class ZeEventHandle {
 public:
  explicit ZeEventHandle(ze_context_handle_t context) {
    ze_event_pool_desc_t pool_desc{ZE_STRUCTURE_TYPE_EVENT_POOL_DESC, nullptr,
                                   ZE_EVENT_POOL_FLAG_HOST_VISIBLE, 1};
    DUCTILE_ZE_CHECK(zeEventPoolCreate(context, &pool_desc, 0, nullptr, &pool_));
    ze_event_desc_t desc{ZE_STRUCTURE_TYPE_EVENT_DESC, nullptr, 0, ZE_EVENT_SCOPE_FLAG_HOST,
                         ZE_EVENT_SCOPE_FLAG_HOST};
    ze_result_t result = zeEventCreate(pool_, &desc, &event_);
    if (result != ZE_RESULT_SUCCESS) {
      zeEventPoolDestroy(pool_);
      throw_ze(result, "zeEventCreate");
    }
  }
  ~ZeEventHandle() {
    zeEventDestroy(event_);
    zeEventPoolDestroy(pool_);
  }
  ZeEventHandle(const ZeEventHandle&) = delete;
  ZeEventHandle& operator=(const ZeEventHandle&) = delete;
  ze_event_handle_t get() const noexcept { return event_; }
  bool signalled() const {
    ze_result_t result = zeEventQueryStatus(event_);
    if (result == ZE_RESULT_NOT_READY) return false;
    if (result != ZE_RESULT_SUCCESS) throw_ze(result, "zeEventQueryStatus");
    return true;
  }
  void host_wait() const { DUCTILE_ZE_CHECK(zeEventHostSynchronize(event_, UINT64_MAX)); }

 private:
  ze_event_pool_handle_t pool_ = nullptr;
  ze_event_handle_t event_ = nullptr;
};

class ZeEvent;

// An immediate command list. Level Zero may overlap commands of one list;
// a barrier after each keeps the stream in order. `marker_` is signalled
// behind the latest work for query()/synchronize().
class ZeStream final : public Stream {
 public:
  ZeStream(ze_context_handle_t context, ze_device_handle_t device, std::uint32_t ordinal)
      : context_(context), marker_(context), host_(std::make_shared<HostStream>("level_zero")) {
    ze_command_queue_desc_t desc{ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                                 nullptr,
                                 ordinal,
                                 0,
                                 0,
                                 ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS,
                                 ZE_COMMAND_QUEUE_PRIORITY_NORMAL};
    DUCTILE_ZE_CHECK(zeCommandListCreateImmediate(context, device, &desc, &list_));
  }
  ~ZeStream() override {
    try {
      synchronize();
    } catch (...) {
    }
    host_.reset();
    zeCommandListDestroy(list_);
  }

  void synchronize() override {
    std::lock_guard lock(mutex_);
    place_marker_locked();
    marker_.host_wait();
  }
  bool query() override {
    std::lock_guard lock(mutex_);
    place_marker_locked();
    return marker_.signalled();
  }
  void wait_event(Event& event) override;

  // Appends `append` (which records commands on the list) and a barrier.
  template <class Append>
  void append(Append&& append) {
    std::lock_guard lock(mutex_);
    append(list_);
    DUCTILE_ZE_CHECK(zeCommandListAppendBarrier(list_, nullptr, 0, nullptr));
    dirty_ = true;
  }
  ze_command_list_handle_t list() const noexcept { return list_; }
  ze_context_handle_t context() const noexcept { return context_; }
  // Runs the host side of staged collectives, in this stream's order.
  HostStream& host() { return *host_; }

 private:
  void place_marker_locked() {
    if (!dirty_) return;
    DUCTILE_ZE_CHECK(zeEventHostReset(marker_.get()));
    DUCTILE_ZE_CHECK(zeCommandListAppendBarrier(list_, marker_.get(), 0, nullptr));
    dirty_ = false;
  }

  ze_context_handle_t context_;
  ze_command_list_handle_t list_ = nullptr;
  std::mutex mutex_;
  bool dirty_ = false;
  ZeEventHandle marker_;
  std::shared_ptr<HostStream> host_;
};

class ZeEvent final : public Event {
 public:
  explicit ZeEvent(ze_context_handle_t context) : event_(context) {}
  void record(Stream& stream) override;
  bool query() override { return !recorded_ || event_.signalled(); }
  void synchronize() override {
    if (recorded_) event_.host_wait();
  }
  bool recorded() const noexcept { return recorded_; }
  ze_event_handle_t get() const noexcept { return event_.get(); }

 private:
  ZeEventHandle event_;
  bool recorded_ = false;
};

ZeStream& as_ze_stream(Stream& stream, const char* call) {
  return backend_object<ZeStream>(stream, call, "stream", "the level_zero accelerator");
}

void ZeStream::wait_event(Event& event) {
  auto& ze =
      backend_object<ZeEvent>(event, "Stream::wait_event", "event", "the level_zero accelerator");
  if (!ze.recorded()) return;
  ze_event_handle_t handle = ze.get();
  append([&](ze_command_list_handle_t list) {
    DUCTILE_ZE_CHECK(zeCommandListAppendWaitOnEvents(list, 1, &handle));
  });
}

void ZeEvent::record(Stream& stream) {
  ZeStream& ze = as_ze_stream(stream, "Event::record");
  DUCTILE_ZE_CHECK(zeEventHostReset(event_.get()));
  // A barrier signalling the event completes after all earlier commands.
  ze.append([&](ze_command_list_handle_t list) {
    DUCTILE_ZE_CHECK(zeCommandListAppendBarrier(list, event_.get(), 0, nullptr));
  });
  recorded_ = true;
}

// One staged collective: host buffers and the three events that hand the
// data from the device to MPI and back.
struct StagedOp {
  StagedOp(ze_context_handle_t context, std::size_t send_bytes, std::size_t recv_bytes)
      : context(context), ready(context), host_done(context), done(context) {
    ze_host_mem_alloc_desc_t desc{ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC, nullptr, 0};
    DUCTILE_ZE_CHECK(zeMemAllocHost(context, &desc, send_bytes ? send_bytes : 64, 64, &send));
    ze_result_t result = zeMemAllocHost(context, &desc, recv_bytes ? recv_bytes : 64, 64, &recv);
    if (result != ZE_RESULT_SUCCESS) {
      zeMemFree(context, send);
      throw_ze(result, "zeMemAllocHost");
    }
  }
  ~StagedOp() {
    zeMemFree(context, send);
    zeMemFree(context, recv);
  }
  ze_context_handle_t context;
  void* send = nullptr;
  void* recv = nullptr;
  ZeEventHandle ready;      // device: input copied to host
  ZeEventHandle host_done;  // host: MPI collective finished
  ZeEventHandle done;       // device: output copied back
};

class StagedHandle final : public CollectiveHandle {
 public:
  StagedHandle(std::shared_ptr<CollectiveHandle> host, std::shared_ptr<StagedOp> op)
      : host_(std::move(host)), op_(std::move(op)) {}
  bool query() override { return host_->query() && op_->done.signalled(); }
  void wait() override {
    host_->wait();
    op_->done.host_wait();
  }

 private:
  std::shared_ptr<CollectiveHandle> host_;
  std::shared_ptr<StagedOp> op_;
};

// A copy between device memory and a staging buffer.
struct Copy {
  void* dst;
  const void* src;
  std::size_t bytes;
};

class StagedCommunicator final : public CheckedCommunicator {
 public:
  // `max_count`: the host communicator's limit (MPI: INT_MAX), checked
  // before anything is appended to the device stream.
  StagedCommunicator(std::shared_ptr<Communicator> host, std::size_t max_count)
      : CheckedCommunicator(max_count), host_(std::move(host)) {}
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }

 private:
  std::shared_ptr<CollectiveHandle> do_all_gather(const void* send, void* recv, std::size_t count,
                                                  DataType type, Stream& stream) override {
    std::size_t bytes = count * size_of(type);
    std::size_t n = static_cast<std::size_t>(size());
    return staged(
        stream, "all_gather", bytes, bytes * n,
        [&](StagedOp& op) {
          return std::vector<Copy>{{op.send, send, bytes}};
        },
        [&](StagedOp& op) {
          return std::vector<Copy>{{recv, op.recv, bytes * n}};
        },
        [=, host = host_](StagedOp& op, Stream& host_stream) {
          return host->all_gather(op.send, op.recv, count, type, host_stream);
        });
  }

  std::shared_ptr<CollectiveHandle> do_all_gather_coalesced(std::span<const GatherItem> items,
                                                            std::size_t total,
                                                            Stream& stream) override {
    std::size_t n = static_cast<std::size_t>(size());
    std::vector<GatherItem> list(items.begin(), items.end());
    // Packed on the way out, unpacked per rank on the way back.
    return staged(
        stream, "all_gather_coalesced", total, total * n,
        [&](StagedOp& op) {
          std::vector<Copy> copies;
          std::size_t offset = 0;
          for (const GatherItem& item : list) {
            std::size_t bytes = item.count * size_of(item.type);
            copies.push_back({static_cast<char*>(op.send) + offset, item.send, bytes});
            offset += bytes;
          }
          return copies;
        },
        [&](StagedOp& op) {
          std::vector<Copy> copies;
          for (std::size_t r = 0; r < n; ++r) {
            std::size_t offset = r * total;
            for (const GatherItem& item : list) {
              std::size_t bytes = item.count * size_of(item.type);
              copies.push_back({static_cast<char*>(item.recv) + r * bytes,
                                static_cast<char*>(op.recv) + offset, bytes});
              offset += bytes;
            }
          }
          return copies;
        },
        [=, host = host_](StagedOp& op, Stream& host_stream) {
          return host->all_gather(op.send, op.recv, total, DataType::u8, host_stream);
        });
  }

  std::shared_ptr<CollectiveHandle> do_reduce_scatter(const void* send, void* recv,
                                                      std::size_t count, DataType type,
                                                      ReduceOp op_kind, Stream& stream) override {
    std::size_t bytes = count * size_of(type);
    std::size_t n = static_cast<std::size_t>(size());
    return staged(
        stream, "reduce_scatter", bytes * n, bytes,
        [&](StagedOp& op) {
          return std::vector<Copy>{{op.send, send, bytes * n}};
        },
        [&](StagedOp& op) {
          return std::vector<Copy>{{recv, op.recv, bytes}};
        },
        [=, host = host_](StagedOp& op, Stream& host_stream) {
          return host->reduce_scatter(op.send, op.recv, count, type, op_kind, host_stream);
        });
  }

  std::shared_ptr<CollectiveHandle> do_all_reduce(const void* send, void* recv, std::size_t count,
                                                  DataType type, ReduceOp op_kind,
                                                  Stream& stream) override {
    std::size_t bytes = count * size_of(type);
    return staged(
        stream, "all_reduce", bytes, bytes,
        [&](StagedOp& op) {
          return std::vector<Copy>{{op.send, send, bytes}};
        },
        [&](StagedOp& op) {
          return std::vector<Copy>{{recv, op.recv, bytes}};
        },
        [=, host = host_](StagedOp& op, Stream& host_stream) {
          return host->all_reduce(op.send, op.recv, count, type, op_kind, host_stream);
        });
  }

  std::shared_ptr<CollectiveHandle> do_broadcast(void* buffer, std::size_t count, DataType type,
                                                 int root, Stream& stream) override {
    std::size_t bytes = count * size_of(type);
    bool is_root = rank() == root;
    return staged(
        stream, "broadcast", bytes, 0,
        [&](StagedOp& op) {
          return is_root ? std::vector<Copy>{{op.send, buffer, bytes}} : std::vector<Copy>{};
        },
        [&](StagedOp& op) {
          return is_root ? std::vector<Copy>{} : std::vector<Copy>{{buffer, op.send, bytes}};
        },
        [=, host = host_](StagedOp& op, Stream& host_stream) {
          return host->broadcast(op.send, count, type, root, host_stream);
        });
  }

  std::shared_ptr<CollectiveHandle> do_barrier(Stream& stream) override {
    return staged(
        stream, "barrier", 0, 0, [](StagedOp&) { return std::vector<Copy>{}; },
        [](StagedOp&) { return std::vector<Copy>{}; },
        [host = host_](StagedOp&, Stream& host_stream) { return host->barrier(host_stream); });
  }

  // Device: copies in, signal `ready`, wait for `host_done`, copies out,
  // signal `done`. Host (the stream's helper thread, in issue order): wait
  // for `ready`, run the MPI collective (posted in call order: it is issued
  // here, on the caller's thread), signal `host_done` even on failure so the
  // device stream never blocks forever (the handle reports the failure).
  template <class CopiesIn, class CopiesOut, class HostCollective>
  std::shared_ptr<CollectiveHandle> staged(Stream& stream, const char* call, std::size_t send_bytes,
                                           std::size_t recv_bytes, CopiesIn&& copies_in,
                                           CopiesOut&& copies_out, HostCollective&& collective) {
    ZeStream& ze = as_ze_stream(stream, call);
    auto op = std::make_shared<StagedOp>(ze.context(), send_bytes, recv_bytes);
    ze.append([&](ze_command_list_handle_t list) {
      const auto append_copies = [&](const std::vector<Copy>& copies) {
        for (const Copy& copy : copies)
          if (copy.bytes)
            DUCTILE_ZE_CHECK(zeCommandListAppendMemoryCopy(list, copy.dst, copy.src, copy.bytes,
                                                           nullptr, 0, nullptr));
      };
      append_copies(copies_in(*op));
      DUCTILE_ZE_CHECK(zeCommandListAppendBarrier(list, op->ready.get(), 0, nullptr));
      ze_event_handle_t host_done = op->host_done.get();
      DUCTILE_ZE_CHECK(zeCommandListAppendWaitOnEvents(list, 1, &host_done));
      append_copies(copies_out(*op));
      DUCTILE_ZE_CHECK(zeCommandListAppendBarrier(list, op->done.get(), 0, nullptr));
    });
    HostStream& host = ze.host();
    host.enqueue([op](bool) { op->ready.host_wait(); });
    auto host_handle = collective(*op, host);
    host.enqueue([op](bool) {
      zeEventHostSignal(op->host_done.get());
      op->done.host_wait();  // keeps the staging buffers until the device is done with them
    });
    return std::make_shared<StagedHandle>(std::move(host_handle), op);
  }

  std::shared_ptr<Communicator> host_;
};

class LevelZeroAccelerator final : public AcceleratorBase {
 public:
  explicit LevelZeroAccelerator(const HostContext& context)
      : AcceleratorBase(context, "level_zero", "level_zero") {
    ze_result_t result = zeInit(ZE_INIT_FLAG_GPU_ONLY);
    if (result != ZE_RESULT_SUCCESS)
      throw Error(ErrorKind::unsupported,
                  std::string("level_zero accelerator: no usable Level Zero driver (zeInit: ") +
                      result_name(result) +
                      "); a GPU driver such as Intel's compute runtime is required");
    std::uint32_t drivers = 0;
    result = zeDriverGet(&drivers, nullptr);
    if (result != ZE_RESULT_SUCCESS || drivers == 0)
      throw Error(
          ErrorKind::unsupported,
          std::string("level_zero accelerator: no usable Level Zero driver (zeDriverGet: ") +
              (result != ZE_RESULT_SUCCESS ? result_name(result) : "0 drivers") + ")");
    drivers = 1;
    DUCTILE_ZE_CHECK(zeDriverGet(&drivers, &driver_));
    std::uint32_t count = 0;
    DUCTILE_ZE_CHECK(zeDeviceGet(driver_, &count, nullptr));
    if (count == 0)
      throw Error(
          ErrorKind::unsupported,
          "level_zero accelerator: no usable Level Zero driver: the driver reports no device");
    devices_.resize(count);
    DUCTILE_ZE_CHECK(zeDeviceGet(driver_, &count, devices_.data()));
    device_ = choose_device(context, static_cast<int>(count), "Level Zero");
    ze_context_desc_t context_desc{ZE_STRUCTURE_TYPE_CONTEXT_DESC, nullptr, 0};
    DUCTILE_ZE_CHECK(zeContextCreate(driver_, &context_desc, &context_));
    ordinal_ = compute_ordinal(devices_[device_]);
    pin_library_of(reinterpret_cast<const void*>(&result_name));
    logger()->debug("level_zero accelerator: device {} of {}", device_, count);
  }
  ~LevelZeroAccelerator() override {
    if (context_ != nullptr) zeContextDestroy(context_);
  }

  int device_count() const override { return static_cast<int>(devices_.size()); }
  int current_device() const override { return device_; }

  void deallocate(void* pointer, MemoryKind) noexcept override {
    if (pointer != nullptr) zeMemFree(context_, pointer);
  }

  std::shared_ptr<Stream> create_stream() override {
    return std::make_shared<ZeStream>(context_, devices_[device_], ordinal_);
  }
  std::shared_ptr<Event> create_event() override { return std::make_shared<ZeEvent>(context_); }

 private:
  DeviceInfo do_device_info(int device) const override {
    ze_device_properties_t properties{};
    properties.stype = ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES;
    DUCTILE_ZE_CHECK(zeDeviceGetProperties(devices_[device], &properties));
    std::uint32_t count = 0;
    DUCTILE_ZE_CHECK(zeDeviceGetMemoryProperties(devices_[device], &count, nullptr));
    std::vector<ze_device_memory_properties_t> memories(count);
    for (auto& m : memories) m.stype = ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES;
    DUCTILE_ZE_CHECK(zeDeviceGetMemoryProperties(devices_[device], &count, memories.data()));
    DeviceInfo info;
    info.name = properties.name;
    for (const auto& m : memories) info.total_memory += m.totalSize;
    // The core API has no free-memory query (Sysman has): report the total.
    info.free_memory = info.total_memory;
    return info;
  }

  void* do_allocate(std::size_t bytes, MemoryKind kind) override {
    std::size_t size = bytes == 0 ? 64 : bytes;
    void* pointer = nullptr;
    if (kind == MemoryKind::device) {
      ze_device_mem_alloc_desc_t desc{ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC, nullptr, 0, 0};
      DUCTILE_ZE_CHECK(zeMemAllocDevice(context_, &desc, size, 64, devices_[device_], &pointer));
    } else {
      ze_host_mem_alloc_desc_t desc{ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC, nullptr, 0};
      DUCTILE_ZE_CHECK(zeMemAllocHost(context_, &desc, size, 64, &pointer));
    }
    return pointer;
  }

  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind,
                     Stream& stream) override {
    ZeStream& ze = as_ze_stream(stream, "copy_async");
    if (bytes == 0) return;
    // Unified addressing: the direction follows from the pointers.
    ze.append([&](ze_command_list_handle_t list) {
      DUCTILE_ZE_CHECK(zeCommandListAppendMemoryCopy(list, dst, src, bytes, nullptr, 0, nullptr));
    });
  }

  void do_memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override {
    ZeStream& ze = as_ze_stream(stream, "memset_async");
    if (bytes == 0) return;
    auto pattern = static_cast<std::uint8_t>(value);
    ze.append([&](ze_command_list_handle_t list) {
      DUCTILE_ZE_CHECK(
          zeCommandListAppendMemoryFill(list, dst, &pattern, 1, bytes, nullptr, 0, nullptr));
    });
  }

  // Collectives staged through host memory over the host world.
  std::shared_ptr<Communicator> make_world() override {
    std::size_t max_count = mode() == CommMode::mpi ? static_cast<std::size_t>(INT_MAX)
                                                    : std::numeric_limits<std::size_t>::max();
    return std::make_shared<StagedCommunicator>(host_world_locked(), max_count);
  }

  static std::uint32_t compute_ordinal(ze_device_handle_t device) {
    std::uint32_t groups = 0;
    DUCTILE_ZE_CHECK(zeDeviceGetCommandQueueGroupProperties(device, &groups, nullptr));
    std::vector<ze_command_queue_group_properties_t> properties(groups);
    for (auto& p : properties) p.stype = ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES;
    DUCTILE_ZE_CHECK(zeDeviceGetCommandQueueGroupProperties(device, &groups, properties.data()));
    for (std::uint32_t i = 0; i < groups; ++i)
      if (properties[i].flags & ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE) return i;
    throw Error(ErrorKind::unsupported,
                "level_zero accelerator: the device has no compute queue group");
  }

  ze_driver_handle_t driver_ = nullptr;
  std::vector<ze_device_handle_t> devices_;
  int device_ = 0;
  ze_context_handle_t context_ = nullptr;
  std::uint32_t ordinal_ = 0;
};

}  // namespace
}  // namespace ductile::accel

DUCTILE_PLUGIN(ductile::accel::LevelZeroAccelerator, "level_zero", "1.0.0",
               "Level Zero devices; collectives staged through host memory over MPI",
               ductile::accel::kSchema)
