// Collectives of the cpu accelerator under mpirun with 1, 2 and 3 ranks
// (3 gives shards that do not divide evenly): every result checked exactly,
// for several sizes (0 and sizes not divisible by the rank count) and types.
// Every rank runs the same test cases in the same order.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include "accel_test_support.hpp"
#include "half.hpp"

using namespace accel_test;
using ductile::DataType;
using ductile::ReduceOp;

namespace {

// Small integers, exact in every type (and after the reductions below).
std::int64_t small_value(int rank, std::size_t index, int seed) {
  return static_cast<std::int64_t>((static_cast<std::size_t>(rank + 1) * 3 + index + seed) % 7 + 1);
}

void encode(DataType type, double value, void* base, std::size_t index) {
  switch (type) {
    case DataType::f32:
      static_cast<float*>(base)[index] = static_cast<float>(value);
      return;
    case DataType::f64:
      static_cast<double*>(base)[index] = value;
      return;
    case DataType::f16:
      static_cast<std::uint16_t*>(base)[index] =
          ductile::accel::float_to_half(static_cast<float>(value));
      return;
    case DataType::bf16:
      static_cast<std::uint16_t*>(base)[index] =
          ductile::accel::float_to_bf16(static_cast<float>(value));
      return;
    case DataType::i32:
      static_cast<std::int32_t*>(base)[index] = static_cast<std::int32_t>(value);
      return;
    case DataType::i64:
      static_cast<std::int64_t*>(base)[index] = static_cast<std::int64_t>(value);
      return;
    case DataType::u8:
      static_cast<std::uint8_t*>(base)[index] =
          static_cast<std::uint8_t>(static_cast<std::int64_t>(value) & 0xff);
      return;
  }
}

double reduce_ranks(ReduceOp op, int size, std::size_t index, int seed) {
  double result = static_cast<double>(small_value(0, index, seed));
  for (int r = 1; r < size; ++r) {
    double v = static_cast<double>(small_value(r, index, seed));
    switch (op) {
      case ReduceOp::sum:
        result += v;
        break;
      case ReduceOp::prod:
        result *= v;
        break;
      case ReduceOp::min:
        result = std::min(result, v);
        break;
      case ReduceOp::max:
        result = std::max(result, v);
        break;
    }
  }
  return result;
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::prod:
      return "prod";
    case ReduceOp::min:
      return "min";
    case ReduceOp::max:
      return "max";
  }
  return "?";
}

constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max};

}  // namespace

TEST_CASE("world: rank and size match the launcher") {
  Env& e = env();
  ductile::LaunchInfo launch = ductile::detect_launch();
  REQUIRE(launch.from_launcher());
  CHECK(e.world->size() == launch.size);
  CHECK(e.world->rank() == launch.rank);
  CHECK(e.accel->backend() == "cpu");
  // The same communicator object for every caller.
  CHECK(e.accel->world() == e.world);
}

TEST_CASE("all_gather: exact for every type and for uneven and zero sizes") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  for (DataType type : kAllTypes) {
    for (std::size_t count :
         {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{65537}}) {
      CAPTURE(type_name(type));
      CAPTURE(count);
      std::size_t block = count * ductile::size_of(type);
      Buffer send(*e.accel, block), recv(*e.accel, block * size);
      fill_pattern(send.as(), block, rank, static_cast<int>(count));
      std::memset(recv.as(), 0xEE, recv.bytes());
      auto handle = e.world->all_gather(send.as(), recv.as(), count, type, *e.stream);
      handle->wait();
      CHECK(handle->query());
      for (int r = 0; r < size; ++r)
        CHECK(first_mismatch(recv.as() + r * block, block, r, static_cast<int>(count)) == -1);
    }
  }
}

TEST_CASE("all_gather: in place (input already at this rank's offset)") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  std::size_t count = 3001;  // i32 elements
  std::size_t block = count * 4;
  Buffer buffer(*e.accel, block * size);
  std::memset(buffer.as(), 0, buffer.bytes());
  fill_pattern(buffer.as() + rank * block, block, rank, 5);
  e.world->all_gather(buffer.as() + rank * block, buffer.as(), count, DataType::i32, *e.stream)
      ->wait();
  for (int r = 0; r < size; ++r) CHECK(first_mismatch(buffer.as() + r * block, block, r, 5) == -1);
}

TEST_CASE("all_gather_coalesced: several tensors of different types and sizes, one collective") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  struct Spec {
    std::size_t count;
    DataType type;
  };
  const Spec specs[] = {{5, DataType::f32},
                        {0, DataType::i64},
                        {1023, DataType::bf16},
                        {1, DataType::u8},
                        {4097, DataType::f64}};
  std::vector<std::unique_ptr<Buffer>> sends, recvs;
  std::vector<ductile::GatherItem> items;
  int seed = 0;
  for (const Spec& spec : specs) {
    std::size_t block = spec.count * ductile::size_of(spec.type);
    sends.push_back(std::make_unique<Buffer>(*e.accel, block));
    recvs.push_back(std::make_unique<Buffer>(*e.accel, block * size));
    fill_pattern(sends.back()->as(), block, rank, seed++);
    std::memset(recvs.back()->as(), 0xEE, recvs.back()->bytes());
    items.push_back({sends.back()->as(), recvs.back()->as(), spec.count, spec.type});
  }
  e.world->all_gather_coalesced(items, *e.stream)->wait();
  for (std::size_t i = 0; i < items.size(); ++i) {
    CAPTURE(i);
    std::size_t block = specs[i].count * ductile::size_of(specs[i].type);
    for (int r = 0; r < size; ++r)
      CHECK(first_mismatch(recvs[i]->as() + r * block, block, r, static_cast<int>(i)) == -1);
  }
  // An empty list is a valid (no-op) collective too.
  e.world->all_gather_coalesced({}, *e.stream)->wait();
}

TEST_CASE("all_gather: MPI_Iallgather path (exchange_max_ranks = 0), plain, in place, coalesced") {
  Env& e = env();
  ductile::Params params;
  params.set("exchange_max_ranks", std::int64_t{0});
  auto accel = e.runtime.create<ductile::Accelerator>("cpu", params);
  auto world = accel->world();
  auto stream = accel->create_stream();
  int size = world->size(), rank = world->rank();
  for (std::size_t count : {std::size_t{0}, std::size_t{7}, std::size_t{300001}}) {
    CAPTURE(count);
    std::size_t block = count * 4;
    Buffer send(*accel, block), recv(*accel, block * size);
    fill_pattern(send.as(), block, rank, 11);
    std::memset(recv.as(), 0xEE, recv.bytes());
    world->all_gather(send.as(), recv.as(), count, DataType::f32, *stream)->wait();
    for (int r = 0; r < size; ++r) CHECK(first_mismatch(recv.as() + r * block, block, r, 11) == -1);
    std::memset(recv.as(), 0, recv.bytes());
    fill_pattern(recv.as() + rank * block, block, rank, 12);
    world->all_gather(recv.as() + rank * block, recv.as(), count, DataType::f32, *stream)->wait();
    for (int r = 0; r < size; ++r) CHECK(first_mismatch(recv.as() + r * block, block, r, 12) == -1);
  }
  Buffer a(*accel, 12), b(*accel, 4099), ra(*accel, 12 * size), rb(*accel, 4099 * size);
  fill_pattern(a.as(), 12, rank, 13);
  fill_pattern(b.as(), 4099, rank, 14);
  ductile::GatherItem items[] = {{a.as(), ra.as(), 3, DataType::i32},
                                 {b.as(), rb.as(), 4099, DataType::u8}};
  world->all_gather_coalesced(items, *stream)->wait();
  for (int r = 0; r < size; ++r) {
    CHECK(first_mismatch(ra.as() + r * 12, 12, r, 13) == -1);
    CHECK(first_mismatch(rb.as() + r * 4099, 4099, r, 14) == -1);
  }
}

TEST_CASE("reduce_scatter: every op and type, exact") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  for (DataType type : kAllTypes) {
    for (ReduceOp op : kOps) {
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{333}}) {
        CAPTURE(type_name(type));
        CAPTURE(op_name(op));
        CAPTURE(count);
        std::size_t element = ductile::size_of(type);
        Buffer send(*e.accel, count * size * element), recv(*e.accel, count * element);
        Buffer expected(*e.accel, count * element);
        for (std::size_t i = 0; i < count * size; ++i)
          encode(type, static_cast<double>(small_value(rank, i, 1)), send.as(), i);
        for (std::size_t i = 0; i < count; ++i)
          encode(type, reduce_ranks(op, size, rank * count + i, 1), expected.as(), i);
        e.world->reduce_scatter(send.as(), recv.as(), count, type, op, *e.stream)->wait();
        CHECK(std::memcmp(recv.as(), expected.as(), count * element) == 0);
      }
    }
  }
}

TEST_CASE("all_reduce: every op and type, in and out of place, exact") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  for (DataType type : kAllTypes) {
    for (ReduceOp op : kOps) {
      for (bool in_place : {false, true}) {
        std::size_t count = in_place ? 1001 : 64;
        CAPTURE(type_name(type));
        CAPTURE(op_name(op));
        CAPTURE(in_place);
        std::size_t element = ductile::size_of(type);
        Buffer send(*e.accel, count * element), recv(*e.accel, count * element);
        Buffer expected(*e.accel, count * element);
        for (std::size_t i = 0; i < count; ++i) {
          encode(type, static_cast<double>(small_value(rank, i, 2)), send.as(), i);
          encode(type, reduce_ranks(op, size, i, 2), expected.as(), i);
        }
        void* out = in_place ? send.as() : recv.as();
        e.world->all_reduce(send.as(), out, count, type, op, *e.stream)->wait();
        CHECK(std::memcmp(out, expected.as(), count * element) == 0);
      }
    }
  }
  // Zero elements.
  e.world->all_reduce(nullptr, nullptr, 0, DataType::f32, ReduceOp::sum, *e.stream)->wait();
}

TEST_CASE("all_reduce: fp16 and bf16 values are reduced as numbers, not as bits") {
  Env& e = env();
  int size = e.world->size();
  // Summing 16-bit patterns as integers would give 0x3C00 * size; the sum of
  // 1.0 over the ranks is `size`. Products of 0.5 exercise the exponent.
  std::vector<std::uint16_t> values(4, ductile::accel::float_to_half(1.0f));
  e.world
      ->all_reduce(values.data(), values.data(), values.size(), DataType::f16, ReduceOp::sum,
                   *e.stream)
      ->wait();
  for (std::uint16_t v : values)
    CHECK(ductile::accel::half_to_float(v) == static_cast<float>(size));
  std::vector<std::uint16_t> bf(3, ductile::accel::float_to_bf16(0.5f));
  e.world->all_reduce(bf.data(), bf.data(), bf.size(), DataType::bf16, ReduceOp::prod, *e.stream)
      ->wait();
  for (std::uint16_t v : bf) CHECK(ductile::accel::bf16_to_float(v) == std::ldexp(1.0f, -size));
}

TEST_CASE("broadcast: from every root, several sizes") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  for (int root = 0; root < size; ++root) {
    for (std::size_t count : {std::size_t{0}, std::size_t{3}, std::size_t{100003}}) {
      CAPTURE(root);
      CAPTURE(count);
      Buffer buffer(*e.accel, count * 8);
      if (rank == root) {
        fill_pattern(buffer.as(), buffer.bytes(), root, 9);
      } else {
        std::memset(buffer.as(), 0, buffer.bytes());
      }
      e.world->broadcast(buffer.as(), count, DataType::i64, root, *e.stream)->wait();
      CHECK(first_mismatch(buffer.as(), buffer.bytes(), root, 9) == -1);
    }
  }
}

TEST_CASE("bootstrap: broadcasts a blob from the root - barrier orders file creation") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  auto bootstrap = e.accel->bootstrap();
  CHECK(bootstrap->size() == size);
  CHECK(bootstrap->rank() == rank);
  // Rank 0 picks a fresh directory; every rank learns its name.
  std::string name;
  if (rank == 0) {
    char pattern[] = "/tmp/ductile-barrier-XXXXXX";
    REQUIRE(mkdtemp(pattern) != nullptr);
    name = pattern;
  }
  auto blob = bootstrap->broadcast(std::as_bytes(std::span(name.data(), name.size())), 0);
  std::string dir(reinterpret_cast<const char*>(blob.data()), blob.size());
  REQUIRE(dir.rfind("/tmp/ductile-barrier-", 0) == 0);
  // Ranks other than the last wait a little before writing, so that a barrier
  // that did not wait would let the last rank look too early.
  if (rank != size - 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  std::ofstream(dir + "/" + std::to_string(rank)).put('x');
  e.world->barrier(*e.stream)->wait();
  int present = 0;
  for (int r = 0; r < size; ++r) present += std::filesystem::exists(dir + "/" + std::to_string(r));
  CHECK(present == size);
  bootstrap->barrier();
  if (rank == 0) std::filesystem::remove_all(dir);
  // A large blob from the last rank, and an empty one.
  std::vector<std::byte> big(300000);
  fill_pattern(big.data(), big.size(), size - 1, 4);
  auto got = bootstrap->broadcast(big, size - 1);
  REQUIRE(got.size() == big.size());
  CHECK(first_mismatch(got.data(), got.size(), size - 1, 4) == -1);
  CHECK(bootstrap->broadcast({}, 0).empty());
}

TEST_CASE("streams: work and collectives run in order - events order streams") {
  Env& e = env();
  int size = e.world->size();
  std::size_t count = 1 << 20;  // 4 MiB of i32
  std::size_t bytes = count * 4;
  auto producer = e.accel->create_stream();
  auto consumer = e.accel->create_stream();
  Buffer source(*e.accel, bytes), staged(*e.accel, bytes), gathered(*e.accel, bytes * size);
  // Producer: several fills, the last one wins; then record.
  for (int value = 1; value <= 4; ++value)
    e.accel->memset_async(source.as(), value, bytes, *producer);
  auto ready = e.accel->create_event();
  ready->record(*producer);
  // Consumer waits for the event, copies, then gathers on the same stream:
  // the gather must see the copy's output.
  consumer->wait_event(*ready);
  e.accel->copy_async(staged.as(), source.as(), bytes, ductile::CopyKind::device_to_device,
                      *consumer);
  auto handle = e.world->all_gather(staged.as(), gathered.as(), count, DataType::i32, *consumer);
  auto done = e.accel->create_event();
  done->record(*consumer);
  done->synchronize();
  CHECK(done->query());
  CHECK(handle->query());
  CHECK(consumer->query());
  auto* out = gathered.as<std::uint8_t>();
  CHECK(std::all_of(out, out + gathered.bytes(), [](std::uint8_t b) { return b == 4; }));
  // A never-recorded event is complete and waiting on it is a no-op.
  auto fresh = e.accel->create_event();
  CHECK(fresh->query());
  consumer->wait_event(*fresh);
  consumer->synchronize();
}

TEST_CASE("issue order: collectives on different streams are posted in call order") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  auto slow = e.accel->create_stream();
  auto fast = e.accel->create_stream();
  std::size_t count = 1 << 18;
  Buffer a_send(*e.accel, count * 4), a_recv(*e.accel, count * 4 * size);
  Buffer b(*e.accel, 64 * 8);
  fill_pattern(a_send.as(), a_send.bytes(), rank, 11);
  // The slow stream is busy (large fills) before its gather; the fast stream's
  // all_reduce, called second, must still be posted second on every rank.
  Buffer scratch(*e.accel, 64 << 20);
  for (int i = 0; i < 4; ++i) e.accel->memset_async(scratch.as(), i, scratch.bytes(), *slow);
  auto gather = e.world->all_gather(a_send.as(), a_recv.as(), count, DataType::f32, *slow);
  for (std::size_t i = 0; i < 64; ++i) b.as<std::int64_t>()[i] = rank + 1;
  auto reduce = e.world->all_reduce(b.as(), b.as(), 64, DataType::i64, ReduceOp::sum, *fast);
  reduce->wait();
  gather->wait();
  for (std::size_t i = 0; i < 64; ++i) CHECK(b.as<std::int64_t>()[i] == size * (size + 1) / 2);
  for (int r = 0; r < size; ++r)
    CHECK(first_mismatch(a_recv.as() + r * count * 4, count * 4, r, 11) == -1);
}

TEST_CASE("progress: a large posted gather completes while the caller only polls query()") {
  Env& e = env();
  int size = e.world->size(), rank = e.world->rank();
  std::size_t count = std::size_t{8} << 20;  // 32 MiB of f32 per rank
  Buffer send(*e.accel, count * 4), recv(*e.accel, count * 4 * size);
  Buffer scratch(*e.accel, 64 << 20);
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    fill_pattern(send.as(), send.bytes(), rank, 13 + round);
    // Round 0: the stream is busy first (a large fill), so the gather is
    // certainly pending when first queried. Round 1: the stream is idle and
    // the gather is posted at once from this thread.
    if (round == 0) e.accel->memset_async(scratch.as(), 1, scratch.bytes(), *e.stream);
    auto handle = e.world->all_gather(send.as(), recv.as(), count, DataType::f32, *e.stream);
    // query() never calls MPI: completion can only come from background
    // progress while this thread computes and polls.
    bool seen_pending = !handle->query();
    long long polls = 0;
    volatile double work = 0;
    while (!handle->query()) {
      ++polls;
      for (int i = 0; i < 1000; ++i) work = work + i * 0.5;
    }
    if (round == 0) {
      CHECK(seen_pending);
      CHECK(polls > 0);
    }
    handle->wait();
    for (int r = 0; r < size; ++r)
      CHECK(first_mismatch(recv.as() + r * count * 4, count * 4, r, 13 + round) == -1);
  }
}

TEST_CASE("errors: bad arguments are refused before anything is posted") {
  Env& e = env();
  auto& w = *e.world;
  auto& s = *e.stream;
  float x[4] = {};
  auto expect_invalid = [](auto&& call, const char* needle) {
    try {
      call();
      FAIL("expected ductile::Error for " << needle);
    } catch (const ductile::Error& error) {
      CHECK(error.kind() == ductile::ErrorKind::invalid_argument);
      CHECK(std::string(error.what()).find(needle) != std::string::npos);
    }
  };
  expect_invalid([&] { w.all_gather(nullptr, x, 1, DataType::f32, s); }, "`send` is null");
  expect_invalid([&] { w.all_reduce(x, nullptr, 1, DataType::f32, ReduceOp::sum, s); },
                 "`recv` is null");
  expect_invalid([&] { w.broadcast(x, 1, DataType::f32, w.size(), s); }, "root");
  expect_invalid([&] { w.broadcast(x, 1, DataType::f32, -1, s); }, "root");
  expect_invalid([&] { w.all_gather(x, x, 1, static_cast<DataType>(99), s); }, "DataType 99");
  expect_invalid([&] { w.all_reduce(x, x, 1, DataType::f32, static_cast<ReduceOp>(7), s); },
                 "ReduceOp 7");
  ductile::GatherItem bad{nullptr, x, 2, DataType::f32};
  expect_invalid([&] { w.all_gather_coalesced(std::span(&bad, 1), s); }, "items[0].send");
  try {
    w.all_gather(x, x, std::size_t{1} << 31, DataType::u8, s);
    FAIL("expected an unsupported count");
  } catch (const ductile::Error& error) {
    CHECK(error.kind() == ductile::ErrorKind::unsupported);
  }
  // The communicator still works afterwards (nothing was posted).
  w.barrier(s)->wait();
}

TEST_CASE("errors: ranks that disagree on an all_gather's count get an error, never short data") {
  Env& e = env();
  if (e.world->size() < 2) {
    MESSAGE("needs 2 or more ranks (a single rank has nobody to disagree with)");
    return;
  }
  // The failure makes a communicator unusable: use one of its own.
  ductile::Params params;
  params.set("timeout", 30.0);
  auto accel = e.runtime.create<ductile::Accelerator>("cpu", params);
  auto world = accel->world();
  int rank = world->rank(), size = world->size();
  // Eager (small) and rendezvous (large) messages; every rank's count differs.
  for (std::size_t base : {std::size_t{100}, std::size_t{300000}}) {
    CAPTURE(base);
    auto stream = accel->create_stream();
    std::size_t count = base + static_cast<std::size_t>(rank);
    std::vector<std::int32_t> send(count, rank), recv(count * static_cast<std::size_t>(size), -1);
    try {
      world->all_gather(send.data(), recv.data(), count, DataType::i32, *stream)->wait();
      FAIL("the mismatched all_gather completed");
    } catch (const ductile::Error& error) {
      CHECK(error.kind() == ductile::ErrorKind::communication);
      CHECK(std::string(error.what()).find("did not issue the same collectives") !=
            std::string::npos);
    }
    // A new communicator for the second round (this one is broken now).
    if (base == 100) {
      accel = e.runtime.create<ductile::Accelerator>("cpu", params);
      world = accel->world();
    }
  }
}
