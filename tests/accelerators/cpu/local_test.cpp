// The cpu accelerator in a single process started without a launcher: the
// local world (no MPI), memory, streams, events, argument errors, the
// configuration keys, and the fp16/bf16 conversions used for reductions.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <limits>
#include <set>

#include "accel_test_support.hpp"
#include "half.hpp"

using namespace accel_test;
using ductile::DataType;
using ductile::ReduceOp;

namespace {

std::shared_ptr<ductile::Accelerator> make_cpu(const std::string& extra = "") {
  static std::vector<ductile::core::Runtime> keep;  // runtimes live for the process
  keep.push_back(ductile::core::Runtime::from_string(cpu_config(extra), "local.toml"));
  return keep.back().get<ductile::Accelerator>();
}

template <class Call>
ductile::Error catch_error(Call&& call) {
  try {
    call();
  } catch (const ductile::Error& error) {
    return error;
  }
  FAIL("expected a ductile::Error");
  return ductile::Error(ductile::ErrorKind::internal, "unreachable");
}

}  // namespace

TEST_CASE("local world: a process without a launcher is rank 0 of 1 and never starts MPI") {
  REQUIRE_FALSE(ductile::detect_launch().from_launcher());
  auto accel = make_cpu();
  auto world = accel->world();
  CHECK(world->rank() == 0);
  CHECK(world->size() == 1);
  CHECK(accel->world() == world);
  auto stream = accel->create_stream();
  for (DataType type : kAllTypes) {
    CAPTURE(type_name(type));
    std::size_t count = 1001, bytes = count * ductile::size_of(type);
    Buffer send(*accel, bytes), recv(*accel, bytes);
    fill_pattern(send.as(), bytes, 0, 1);
    world->all_gather(send.as(), recv.as(), count, type, *stream)->wait();
    CHECK(first_mismatch(recv.as(), bytes, 0, 1) == -1);
    std::memset(recv.as(), 0, bytes);
    world->reduce_scatter(send.as(), recv.as(), count, type, ReduceOp::sum, *stream)->wait();
    CHECK(first_mismatch(recv.as(), bytes, 0, 1) == -1);
    std::memset(recv.as(), 0, bytes);
    world->all_reduce(send.as(), recv.as(), count, type, ReduceOp::max, *stream)->wait();
    CHECK(first_mismatch(recv.as(), bytes, 0, 1) == -1);
    world->broadcast(recv.as(), count, type, 0, *stream)->wait();
    CHECK(first_mismatch(recv.as(), bytes, 0, 1) == -1);
  }
  Buffer a(*accel, 12), b(*accel, 12);
  fill_pattern(a.as(), 12, 0, 2);
  ductile::GatherItem items[] = {{a.as(), b.as(), 3, DataType::f32}};
  world->all_gather_coalesced(items, *stream)->wait();
  CHECK(first_mismatch(b.as(), 12, 0, 2) == -1);
  world->barrier(*stream)->wait();
  auto error = catch_error([&] { world->broadcast(a.as(), 3, DataType::f32, 1, *stream); });
  CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
  auto blob = accel->bootstrap()->broadcast(std::as_bytes(std::span("abc", 3)), 0);
  CHECK(std::string(reinterpret_cast<const char*>(blob.data()), blob.size()) == "abc");
}

TEST_CASE("memory: allocations are distinct, aligned and writable - absurd sizes are refused") {
  auto accel = make_cpu();
  CHECK(accel->backend() == "cpu");
  CHECK(accel->device_count() == 1);
  CHECK(accel->current_device() == 0);
  ductile::DeviceInfo info = accel->device_info(0);
  CHECK_FALSE(info.name.empty());
  CHECK(info.total_memory > 0);
  CHECK(info.free_memory <= info.total_memory);
  auto error = catch_error([&] { accel->device_info(1); });
  CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
  CHECK(std::string(error.what()).find("device 1") != std::string::npos);

  std::set<void*> seen;
  std::vector<std::pair<void*, ductile::MemoryKind>> blocks;
  for (auto kind : {ductile::MemoryKind::device, ductile::MemoryKind::pinned_host}) {
    for (std::size_t bytes : {0, 1, 63, 4096, 1 << 20}) {
      void* p = accel->allocate(bytes, kind);
      REQUIRE(p != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
      CHECK(seen.insert(p).second);
      std::memset(p, 0x5a, bytes);
      blocks.emplace_back(p, kind);
    }
  }
  for (auto& [p, kind] : blocks) accel->deallocate(p, kind);
  error = catch_error([&] { accel->allocate(info.total_memory + 1, ductile::MemoryKind::device); });
  CHECK(error.kind() == ductile::ErrorKind::incompatible);
  error = catch_error([&] { accel->allocate(16, static_cast<ductile::MemoryKind>(5)); });
  CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
}

TEST_CASE("streams: in-order execution, query and synchronize") {
  auto accel = make_cpu();
  auto stream = accel->create_stream();
  CHECK(stream->query());
  stream->synchronize();
  std::size_t bytes = 16 << 20;
  Buffer a(*accel, bytes), b(*accel, bytes), c(*accel, bytes);
  // Each step reads the previous step's output: any reordering shows.
  accel->memset_async(a.as(), 1, bytes, *stream);
  accel->copy_async(b.as(), a.as(), bytes, ductile::CopyKind::device_to_device, *stream);
  accel->memset_async(a.as(), 2, bytes, *stream);
  accel->copy_async(c.as(), b.as(), bytes, ductile::CopyKind::device_to_host, *stream);
  accel->memset_async(b.as(), 3, bytes / 2, *stream);
  stream->synchronize();
  CHECK(stream->query());
  auto all = [&](const Buffer& buffer, std::size_t from, std::size_t to, int value) {
    auto* p = buffer.as<std::uint8_t>();
    return std::all_of(p + from, p + to, [&](std::uint8_t x) { return x == value; });
  };
  CHECK(all(a, 0, bytes, 2));
  CHECK(all(c, 0, bytes, 1));
  CHECK(all(b, 0, bytes / 2, 3));
  CHECK(all(b, bytes / 2, bytes, 1));
  // Zero-byte operations with null pointers are valid; null with bytes is not.
  accel->copy_async(nullptr, nullptr, 0, ductile::CopyKind::host_to_device, *stream);
  accel->memset_async(nullptr, 0, 0, *stream);
  stream->synchronize();
  auto error = catch_error(
      [&] { accel->copy_async(nullptr, a.as(), 4, ductile::CopyKind::host_to_device, *stream); });
  CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
  CHECK(std::string(error.what()).find("copy_async") != std::string::npos);
  error = catch_error(
      [&] { accel->copy_async(b.as(), a.as(), 4, static_cast<ductile::CopyKind>(9), *stream); });
  CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
}

TEST_CASE("events: record, query, synchronize, and cross-stream waits") {
  auto accel = make_cpu();
  auto producer = accel->create_stream();
  auto consumer = accel->create_stream();
  std::size_t bytes = 32 << 20;
  Buffer a(*accel, bytes), b(*accel, bytes);
  auto event = accel->create_event();
  CHECK(event->query());  // never recorded
  event->synchronize();
  // Enough work on the producer that the consumer, if it did not wait,
  // would copy stale bytes.
  for (int value = 1; value <= 8; ++value) accel->memset_async(a.as(), value, bytes, *producer);
  event->record(*producer);
  consumer->wait_event(*event);
  accel->copy_async(b.as(), a.as(), bytes, ductile::CopyKind::device_to_device, *consumer);
  auto copied = accel->create_event();
  copied->record(*consumer);
  copied->synchronize();
  CHECK(copied->query());
  CHECK(event->query());
  auto* p = b.as<std::uint8_t>();
  CHECK(std::all_of(p, p + bytes, [](std::uint8_t x) { return x == 8; }));
  // Re-recording: the event reflects the latest record.
  accel->memset_async(a.as(), 9, bytes, *producer);
  event->record(*producer);
  event->synchronize();
  CHECK(a.as<std::uint8_t>()[bytes - 1] == 9);
  // Objects from another backend are refused.
  struct ForeignStream final : ductile::Stream {
    void synchronize() override {}
    bool query() override { return true; }
    void wait_event(ductile::Event&) override {}
  } foreign;
  auto error = catch_error([&] { event->record(foreign); });
  CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
  CHECK(std::string(error.what()).find("not created by this accelerator") != std::string::npos);
}

TEST_CASE("objects outlive the runtime that created them") {
  std::shared_ptr<ductile::Stream> stream;
  std::shared_ptr<ductile::Communicator> world;
  std::shared_ptr<ductile::Accelerator> accel;
  {
    auto runtime = ductile::core::Runtime::from_string(cpu_config(), "outlive.toml");
    accel = runtime.get<ductile::Accelerator>();
    stream = accel->create_stream();
    world = accel->world();
  }
  std::int32_t x[3] = {1, 2, 3}, y[3] = {};
  world->all_reduce(x, y, 3, DataType::i32, ReduceOp::sum, *stream)->wait();
  CHECK(y[2] == 3);
  accel.reset();
  world->barrier(*stream)->wait();
}

TEST_CASE("configuration: communicator modes and timeout are validated") {
  auto local = make_cpu("communicator = \"local\"\n");
  CHECK(local->world()->size() == 1);
  auto bad_mode = [] {
    ductile::core::Runtime::from_string(cpu_config("communicator = \"nccl\"\n"), "bad.toml")
        .get<ductile::Accelerator>();
  };
  try {
    bad_mode();
    FAIL("an unknown communicator mode must be refused");
  } catch (const std::exception& error) {
    std::string text = error.what();
    CHECK(text.find("communicator") != std::string::npos);
    CHECK(text.find("nccl") != std::string::npos);
  }
  try {
    ductile::core::Runtime::from_string(cpu_config("timeout = -1\n"), "bad.toml")
        .get<ductile::Accelerator>();
    FAIL("a negative timeout must be refused");
  } catch (const std::exception& error) {
    CHECK(std::string(error.what()).find("timeout") != std::string::npos);
  }
}

TEST_CASE("host world: a communicator the embedder offers is the world with auto and host") {
  // A real communicator to offer: another accelerator's single-process world.
  auto offered = make_cpu("communicator = \"local\"\n")->world();

  auto automatic = make_cpu();
  auto* host = dynamic_cast<ductile::HostWorld*>(automatic.get());
  REQUIRE(host != nullptr);
  CHECK(host->offer_world(offered));
  CHECK(automatic->world() == offered);
  CHECK(automatic->bootstrap()->size() == 1);  // the bootstrap runs over it too
  auto refused = catch_error([&] { host->offer_world(offered); });
  CHECK(refused.kind() == ductile::ErrorKind::incompatible);
  CHECK(std::string(refused.what()).find("before the first world()") != std::string::npos);

  auto forced = make_cpu("communicator = \"host\"\n");
  CHECK(dynamic_cast<ductile::HostWorld*>(forced.get())->offer_world(offered));
  CHECK(forced->world() == offered);

  // "local" and "mpi" decline: the accelerator keeps its own world.
  auto local = make_cpu("communicator = \"local\"\n");
  CHECK_FALSE(dynamic_cast<ductile::HostWorld*>(local.get())->offer_world(offered));
  CHECK(local->world() != offered);

  // "host" with nothing offered names the key and what to do.
  auto missing = make_cpu("communicator = \"host\"\n");
  auto error = catch_error([&] { missing->world(); });
  CHECK(error.kind() == ductile::ErrorKind::config);
  CHECK(std::string(error.what()).find("communicator = \"host\"") != std::string::npos);
  CHECK(std::string(error.what()).find("none was offered") != std::string::npos);

  auto null = catch_error([&] { host->offer_world(nullptr); });
  CHECK(null.kind() == ductile::ErrorKind::invalid_argument);
}

TEST_CASE("launch detection reads the launcher's variables and rejects malformed ones") {
  // Restored at the end: later cases must see no launcher.
  struct Restore {
    ~Restore() {
      unsetenv("RANK");
      unsetenv("WORLD_SIZE");
      unsetenv("LOCAL_RANK");
    }
  } restore;
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "1", 1);
  ductile::LaunchInfo info = ductile::detect_launch();
  CHECK(info.rank == 2);
  CHECK(info.size == 4);
  CHECK(info.local_rank == 1);
  CHECK(info.source == "RANK/WORLD_SIZE");
  // "local" cannot be forced under a multi-rank launcher.
  try {
    make_cpu("communicator = \"local\"\n");
    FAIL("local world under a 4-rank launcher must be refused");
  } catch (const std::exception& error) {
    CHECK(std::string(error.what()).find("4 ranks") != std::string::npos);
  }
  setenv("RANK", "x1", 1);
  auto error = catch_error([] { ductile::detect_launch(); });
  CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
  CHECK(std::string(error.what()).find("RANK='x1'") != std::string::npos);
  setenv("RANK", "4", 1);
  error = catch_error([] { ductile::detect_launch(); });
  CHECK(std::string(error.what()).find("inconsistent") != std::string::npos);
}

TEST_CASE("fp16 and bf16 conversions round to nearest even and keep specials") {
  using namespace ductile::accel;
  CHECK(float_to_half(1.0f) == 0x3C00);
  CHECK(float_to_half(-2.0f) == 0xC000);
  CHECK(float_to_half(65504.0f) == 0x7BFF);
  CHECK(float_to_half(65520.0f) == 0x7C00);  // rounds up to infinity
  CHECK(float_to_half(std::ldexp(1.0f, -24)) == 0x0001);
  CHECK(float_to_half(std::ldexp(1.0f, -25)) == 0x0000);         // tie to even (zero)
  CHECK(float_to_half(std::ldexp(3.0f, -25)) == 0x0002);         // tie to even (2)
  CHECK(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);  // tie: stays even
  CHECK(float_to_half(1.0f + std::ldexp(3.0f, -11)) == 0x3C02);  // tie: rounds up to even
  CHECK(float_to_half(std::numeric_limits<float>::infinity()) == 0x7C00);
  CHECK((float_to_half(std::numeric_limits<float>::quiet_NaN()) & 0x7C00) == 0x7C00);
  CHECK((float_to_half(std::numeric_limits<float>::quiet_NaN()) & 0x03FF) != 0);
  CHECK(half_to_float(0x3555) == 0.333251953125f);
  CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(half_to_float(0xFC00) == -std::numeric_limits<float>::infinity());
  for (std::uint32_t bits = 0; bits < 0x10000; ++bits) {
    auto h = static_cast<std::uint16_t>(bits);
    if ((h & 0x7C00) == 0x7C00 && (h & 0x3FF)) continue;  // NaNs
    if (float_to_half(half_to_float(h)) != h) {
      FAIL("fp16 round trip fails for " << bits);
      break;
    }
  }
  CHECK(float_to_bf16(1.0f) == 0x3F80);
  CHECK(float_to_bf16(std::bit_cast<float>(0x3F808000u)) == 0x3F80);  // tie: stays even
  CHECK(float_to_bf16(std::bit_cast<float>(0x3F818000u)) == 0x3F82);  // tie: rounds to even
  CHECK(float_to_bf16(std::bit_cast<float>(0x3F808001u)) == 0x3F81);
  CHECK(bf16_to_float(0xC040) == -3.0f);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // Reductions of 16-bit values are done in fp32 and rounded once.
  std::uint16_t in[2] = {float_to_half(1.0f), float_to_half(2048.0f)};
  std::uint16_t inout[2] = {float_to_half(std::ldexp(1.0f, -11)), float_to_half(1.0f)};
  reduce_into(in, inout, 2, DataType::f16, ReduceOp::sum);
  CHECK(inout[0] == 0x3C00);                  // 1 + 2^-11 ties to 1
  CHECK(half_to_float(inout[1]) == 2048.0f);  // 2049 ties to even 2048
  std::int32_t big[1] = {std::numeric_limits<std::int32_t>::max()}, one[1] = {1};
  reduce_into(one, big, 1, DataType::i32, ReduceOp::sum);  // wraps like MPI's sum
  CHECK(big[0] == std::numeric_limits<std::int32_t>::min());
}
