// Device tests shared by the device backends (compiled once per backend with
// DUCTILE_TEST_BACKEND = "cuda" or "level_zero"), run under mpirun. Data is
// moved only with the accelerator's own copies, so they hold for device
// memory the host cannot read. On a machine without the device, every case
// prints "[skipped] <why>" (ctest's SKIP_REGULAR_EXPRESSION) and returns.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"

namespace {

struct Device {
  std::shared_ptr<ductile::Accelerator> accel;
  std::string unavailable;  // why not, when accel is null
};

Device& device() {
  static Device instance = [] {
    Device d;
    try {
      static auto runtime = ductile::core::Runtime::from_string(
          std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
              "\"]\n[accelerator]\nbackend = \"" DUCTILE_TEST_BACKEND "\"\ntimeout = 60\n",
          "device.toml");
      d.accel = runtime.get<ductile::Accelerator>();
      // NCCL refuses two ranks on one device ("Duplicate GPU detected"):
      // more local ranks than devices is a machine this suite cannot run on.
      const char* local_ranks = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
      if (local_ranks && std::atoi(local_ranks) > d.accel->device_count()) {
        d.unavailable = std::string(local_ranks) + " ranks on this host but " +
                        std::to_string(d.accel->device_count()) +
                        " device(s): the collectives need one device per rank";
        d.accel.reset();
      }
    } catch (const ductile::Error& error) {
      d.unavailable = error.what();
    }
    return d;
  }();
  return instance;
}

bool skip_without_device() {
  if (device().accel) return false;
  std::printf("[skipped] no %s device: %s\n", DUCTILE_TEST_BACKEND, device().unavailable.c_str());
  return true;
}

// Device memory freed on scope exit.
struct DeviceBuffer {
  DeviceBuffer(ductile::Accelerator& a, std::size_t n) : accel(a), bytes(n) {
    data = accel.allocate(n, ductile::MemoryKind::device);
  }
  ~DeviceBuffer() { accel.deallocate(data, ductile::MemoryKind::device); }
  ductile::Accelerator& accel;
  std::size_t bytes;
  void* data;
};

std::vector<float> download(ductile::Accelerator& accel, const void* src, std::size_t count,
                            ductile::Stream& stream) {
  std::vector<float> host(count);
  accel.copy_async(host.data(), src, count * 4, ductile::CopyKind::device_to_host, stream);
  stream.synchronize();
  return host;
}

void upload(ductile::Accelerator& accel, void* dst, const std::vector<float>& host,
            ductile::Stream& stream) {
  accel.copy_async(dst, host.data(), host.size() * 4, ductile::CopyKind::host_to_device, stream);
  stream.synchronize();
}

float value(int rank, std::size_t i) {
  return static_cast<float>((rank + 1) * 1000 + i % 997);
}

}  // namespace

TEST_CASE("device: copies and memset round-trip exactly") {
  if (skip_without_device()) return;
  auto& accel = *device().accel;
  CHECK(accel.backend() == DUCTILE_TEST_BACKEND);
  CHECK(accel.device_count() >= 1);
  CHECK(accel.device_info(accel.current_device()).total_memory > 0);
  auto stream = accel.create_stream();
  std::size_t count = 1 << 20;
  std::vector<float> host(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = value(0, i);
  DeviceBuffer a(accel, count * 4), b(accel, count * 4);
  upload(accel, a.data, host, *stream);
  accel.copy_async(b.data, a.data, count * 4, ductile::CopyKind::device_to_device, *stream);
  CHECK(download(accel, b.data, count, *stream) == host);
  accel.memset_async(b.data, 0, count * 4, *stream);
  auto zeros = download(accel, b.data, count, *stream);
  CHECK(std::all_of(zeros.begin(), zeros.end(), [](float x) { return x == 0.0f; }));
}

TEST_CASE("device: events order two streams") {
  if (skip_without_device()) return;
  auto& accel = *device().accel;
  auto producer = accel.create_stream();
  auto consumer = accel.create_stream();
  std::size_t bytes = 64 << 20;
  DeviceBuffer a(accel, bytes), b(accel, bytes);
  for (int v = 1; v <= 4; ++v) accel.memset_async(a.data, v, bytes, *producer);
  auto event = accel.create_event();
  event->record(*producer);
  consumer->wait_event(*event);
  accel.copy_async(b.data, a.data, bytes, ductile::CopyKind::device_to_device, *consumer);
  std::vector<std::uint8_t> host(bytes);
  accel.copy_async(host.data(), b.data, bytes, ductile::CopyKind::device_to_host, *consumer);
  consumer->synchronize();
  CHECK(event->query());
  CHECK(std::all_of(host.begin(), host.end(), [](std::uint8_t x) { return x == 4; }));
}

TEST_CASE("device: collectives give exact results") {
  if (skip_without_device()) return;
  auto& accel = *device().accel;
  auto world = accel.world();
  auto stream = accel.create_stream();
  int rank = world->rank(), size = world->size();
  for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{1001}}) {
    CAPTURE(count);
    std::vector<float> mine(count);
    for (std::size_t i = 0; i < count; ++i) mine[i] = value(rank, i);
    DeviceBuffer send(accel, count * 4 * size), recv(accel, count * 4 * size);
    upload(accel, send.data, mine, *stream);
    world->all_gather(send.data, recv.data, count, ductile::DataType::f32, *stream)->wait();
    auto gathered = download(accel, recv.data, count * size, *stream);
    for (int r = 0; r < size; ++r)
      for (std::size_t i = 0; i < count; ++i) CHECK(gathered[r * count + i] == value(r, i));

    std::vector<float> blocks(count * size);
    for (std::size_t i = 0; i < blocks.size(); ++i) blocks[i] = value(rank, i);
    upload(accel, send.data, blocks, *stream);
    world
        ->reduce_scatter(send.data, recv.data, count, ductile::DataType::f32,
                         ductile::ReduceOp::sum, *stream)
        ->wait();
    auto reduced = download(accel, recv.data, count, *stream);
    for (std::size_t i = 0; i < count; ++i) {
      float expected = 0;
      for (int r = 0; r < size; ++r) expected += value(r, rank * count + i);
      CHECK(reduced[i] == expected);
    }

    upload(accel, send.data, mine, *stream);
    world
        ->all_reduce(send.data, send.data, count, ductile::DataType::f32, ductile::ReduceOp::max,
                     *stream)
        ->wait();
    auto maxed = download(accel, send.data, count, *stream);
    for (std::size_t i = 0; i < count; ++i) CHECK(maxed[i] == value(size - 1, i));

    if (rank == size - 1) upload(accel, send.data, mine, *stream);
    world->broadcast(send.data, count, ductile::DataType::f32, size - 1, *stream)->wait();
    auto broadcast = download(accel, send.data, count, *stream);
    for (std::size_t i = 0; i < count; ++i) CHECK(broadcast[i] == value(size - 1, i));
  }
  // Coalesced: two tensors, one collective.
  DeviceBuffer s1(accel, 12), s2(accel, 20), r1(accel, 12 * size), r2(accel, 20 * size);
  upload(accel, s1.data, {value(rank, 0), value(rank, 1), value(rank, 2)}, *stream);
  upload(accel, s2.data,
         {value(rank, 3), value(rank, 4), value(rank, 5), value(rank, 6), value(rank, 7)}, *stream);
  ductile::GatherItem items[] = {{s1.data, r1.data, 3, ductile::DataType::f32},
                                 {s2.data, r2.data, 5, ductile::DataType::f32}};
  world->all_gather_coalesced(items, *stream)->wait();
  auto g1 = download(accel, r1.data, 3 * size, *stream);
  auto g2 = download(accel, r2.data, 5 * size, *stream);
  for (int r = 0; r < size; ++r) {
    for (int i = 0; i < 3; ++i) CHECK(g1[r * 3 + i] == value(r, i));
    for (int i = 0; i < 5; ++i) CHECK(g2[r * 5 + i] == value(r, 3 + i));
  }
  world->barrier(*stream)->wait();
}

TEST_CASE("device: a large posted gather is observed pending, then complete") {
  if (skip_without_device()) return;
  auto& accel = *device().accel;
  auto world = accel.world();
  auto stream = accel.create_stream();
  std::size_t count = std::size_t{16} << 20;
  DeviceBuffer send(accel, count * 4), recv(accel, count * 4 * world->size());
  accel.memset_async(send.data, world->rank() + 1, count * 4, *stream);
  auto handle = world->all_gather(send.data, recv.data, count, ductile::DataType::f32, *stream);
  bool pending = !handle->query();
  while (!handle->query()) {
  }
  CHECK(pending);
  handle->wait();
}
