// The cpu accelerator: "device" memory is host memory, each stream is a
// worker thread, and the world communicator runs on Open MPI through the
// shared MpiEngine (or is a single-process world when no launcher started
// the process).
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "accelerator_base.hpp"
#include "ductile/accelerator.hpp"
#include "host_stream.hpp"
#include "library_pin.hpp"

namespace ductile::accel {
namespace {

constexpr ParamSpec kSchema[] = {
    {.key = "communicator",
     .type = ParamType::string,
     .default_value = "\"auto\"",
     .allowed_values = kCommunicatorModes,
     .doc = "World communicator: \"mpi\" (Open MPI), \"local\" (single process, no MPI), \"host\" "
            "(the embedding program's, e.g. torch.distributed's process group) or \"auto\" (the "
            "host's when it offers one, else MPI when started by a launcher such as mpirun or when "
            "MPI "
            "is already initialised)"},
    {.key = "timeout",
     .type = ParamType::floating,
     .flags = param_has_min,
     .default_value = "600",
     .doc = "Seconds a collective (and MPI_Finalize at exit) may take before it fails with a "
            "communication error, so that a dead peer ends the job instead of hanging it; 0 waits "
            "forever"},
    {.key = "exchange_max_ranks",
     .type = ParamType::integer,
     .flags = param_has_min,
     .default_value = "32",
     .doc =
         "Up to this many ranks all_gather is a point-to-point exchange (as fast as the blocking "
         "MPI_Allgather); with more, MPI_Iallgather; 0 always uses MPI_Iallgather"},
};

constexpr std::size_t kAlignment = 64;

std::string read_cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto start = line.find_first_not_of(' ', colon + 1);
        if (start != std::string::npos) return line.substr(start);
      }
    }
  }
  return "host cpu";
}

std::size_t read_available_memory() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::size_t value = 0;
  std::string unit;
  while (in >> key >> value >> unit)
    if (key == "MemAvailable:") return value * 1024;
  return 0;
}

std::size_t total_memory() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)
                               : 0;
}

class CpuAccelerator final : public AcceleratorBase {
 public:
  explicit CpuAccelerator(const HostContext& context)
      : AcceleratorBase(context, "cpu", "cpu",
                        static_cast<int>(std::min<std::int64_t>(
                            context.params().get_int("exchange_max_ranks"), 1 << 30))) {
    // Streams and communicators own threads running this library's code and
    // may outlive the host's handle on it: keep the library loaded.
    pin_library_of(reinterpret_cast<const void*>(&read_cpu_model));
    logger()->debug("cpu accelerator: {} world, collective timeout {} s",
                    mode() == CommMode::mpi    ? "MPI"
                    : mode() == CommMode::host ? "host-supplied"
                                               : "single-process",
                    timeout());
  }

  int device_count() const override { return 1; }
  int current_device() const override { return 0; }

  void deallocate(void* pointer, MemoryKind) noexcept override { std::free(pointer); }

  std::shared_ptr<Stream> create_stream() override { return std::make_shared<HostStream>("cpu"); }
  std::shared_ptr<Event> create_event() override { return std::make_shared<HostEvent>("cpu"); }

 private:
  DeviceInfo do_device_info(int) const override {
    DeviceInfo info;
    info.name = read_cpu_model();
    info.total_memory = total_memory();
    info.free_memory = read_available_memory();
    return info;
  }

  void* do_allocate(std::size_t bytes, MemoryKind) override {
    std::size_t rounded =
        bytes == 0 ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
    if (rounded < bytes)
      throw Error(ErrorKind::invalid_argument,
                  "allocate: " + std::to_string(bytes) + " bytes is not a valid size");
    // Like a device, the cpu cannot hand out more than it has (and asking the
    // allocator for absurd sizes aborts under AddressSanitizer).
    std::size_t total = total_memory();
    if (total > 0 && bytes > total)
      throw Error(ErrorKind::incompatible, "allocate: " + std::to_string(bytes) +
                                               " bytes exceed the host's memory (" +
                                               std::to_string(total) + " bytes)");
    void* pointer = std::aligned_alloc(kAlignment, rounded);
    if (pointer == nullptr)
      throw Error(ErrorKind::incompatible,
                  "allocate: out of host memory allocating " + std::to_string(bytes) + " bytes");
    return pointer;
  }

  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind,
                     Stream& stream) override {
    as_host_stream(stream, "copy_async").enqueue([=](bool failed) {
      if (!failed && bytes) std::memmove(dst, src, bytes);
    });
  }

  void do_memset_async(void* dst, int value, std::size_t bytes, Stream& stream) override {
    as_host_stream(stream, "memset_async").enqueue([=](bool failed) {
      if (!failed && bytes) std::memset(dst, value, bytes);
    });
  }
};

}  // namespace
}  // namespace ductile::accel

DUCTILE_PLUGIN(ductile::accel::CpuAccelerator, "cpu", "1.0.0",
               "Host memory, worker-thread streams and Open MPI collectives with background "
               "progress",
               ductile::accel::kSchema)
