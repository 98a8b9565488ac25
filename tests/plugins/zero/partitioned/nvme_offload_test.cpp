// The partitioned coordinator with its shards in NVMe files (nvme_path):
// real files in a fresh folder, read ahead along the trace, and the errors of
// missing, short or unreadable files, on the real cpu backend under mpirun
// with 1, 2 and 3 ranks. Every rank runs the same test cases in the same
// order.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "temp_dir.hpp"
#include "zero_support.hpp"

using namespace zero_test;

TEST_CASE("shard_data: shards in NVMe files are refused as unsupported") {
  ductile::test::TempDir dir;
  ZeroConfig config;
  config.nvme_path = dir.path().string();
  auto zero = make_coordinator(config);
  register_f32(*zero, 1, 64);
  try {
    zero->shard_data(1);
    FAIL("no error");
  } catch (const Error& err) {
    CHECK(err.kind() == ErrorKind::unsupported);
    CHECK(std::string(err.what()).find("nvme_path") != std::string::npos);
  }
}

TEST_CASE("NVMe offload: shards in real files, read ahead with the trace") {
  auto& e = env();
  ductile::test::TempDir dir;
  ZeroConfig config;
  config.nvme_path = dir.path().string();
  config.nvme_buffer_count = 2;
  config.param_persistence_threshold = 4;
  config.prefetch_bucket_size = 400;
  config.max_reuse_distance = 0;
  auto zero = make_coordinator(config);
  const std::vector<std::size_t> sizes = {50, 173, 300, 99, 251, 3, 120};
  for (ParameterId p = 0; p < sizes.size(); ++p) register_f32(*zero, p, sizes[p], 0);
  for (ModuleId m = 0; m + 1 < sizes.size(); ++m)
    zero->register_module(m, std::vector<ParameterId>{m, m + 1});

  // One file per non-persistent shard, of the shard's size.
  for (ParameterId p = 0; p < sizes.size(); ++p) {
    auto file =
        dir.path() / ("rank" + std::to_string(e.rank)) / ("param_" + std::to_string(p) + ".shard");
    CHECK(std::filesystem::exists(file) == (p != 5));
    if (p != 5) CHECK(std::filesystem::file_size(file) == zero->shard_numel(p) * 4);
  }
  // read_shard reads the file back.
  for (ParameterId p = 0; p < sizes.size(); ++p)
    CHECK(shard_matches(*zero, e.rank, p, sizes[p] * 4, 0));

  for (int pass = 0; pass < 4; ++pass) {
    chain_pass(*zero, sizes, pass, [&] { CHECK(zero->stats().nvme_buffers_in_use <= 2); });
    for (ParameterId p = 0; p < sizes.size(); ++p) {
      auto bytes = param_bytes(p, sizes[p] * 4, pass + 1);
      zero->set_full(p, bytes.data(), bytes.size());
    }
  }
  auto stats = zero->stats();
  CHECK(stats.nvme_prefetch_reads > 0);
  CHECK(stats.nvme_reads >= stats.nvme_prefetch_reads);
  CHECK(stats.prefetched_params > 0);
}

TEST_CASE("NVMe offload: a missing, short or unreadable shard file is a clear error") {
  auto& e = env();
  ductile::test::TempDir dir;
  ZeroConfig config;
  config.nvme_path = dir.path().string();
  auto zero = make_coordinator(config);
  register_f32(*zero, 0, 100);
  register_f32(*zero, 1, 64);
  zero->register_module(0, std::vector<ParameterId>{0, 1});
  auto file = dir.path() / ("rank" + std::to_string(e.rank)) / "param_0.shard";
  const std::size_t bytes = zero->shard_numel(0) * 4;

  auto fetch_error = [&]() -> std::string {
    try {
      zero->fetch(0);
    } catch (const Error& error) {
      CHECK(error.kind() == ErrorKind::io);
      return error.what();
    }
    FAIL("fetch() did not report the broken shard file");
    return {};
  };
  auto restore = [&] {
    std::error_code ec;
    std::filesystem::remove_all(file, ec);
    auto values = param_bytes(0, 400, 0);
    zero->set_full(0, values.data(), values.size());
  };

  // Every rank breaks its own file the same way, so every rank fails the
  // same fetch before any gather.
  std::filesystem::remove(file);
  std::string missing = fetch_error();
  CHECK(missing.find(file.string()) != std::string::npos);
  CHECK(missing.find("is missing") != std::string::npos);
  CHECK(missing.find("parameter 0") != std::string::npos);
  CHECK(zero->active_modules(0).empty());
  CHECK(zero->status(1) == ParameterStatus::not_available);
  zero->check_invariants();

  restore();
  std::filesystem::resize_file(file, 3);
  std::string short_file = fetch_error();
  CHECK(short_file.find("has 3 bytes, expected " + std::to_string(bytes)) != std::string::npos);
  CHECK(short_file.find("short file") != std::string::npos);

  std::filesystem::remove(file);
  std::filesystem::create_directory(file);
  std::string not_regular = fetch_error();
  CHECK(not_regular.find("not a regular file") != std::string::npos);
  std::vector<std::uint8_t> shard(bytes);
  try {
    zero->read_shard(0, shard.data(), shard.size());
    FAIL("read_shard() did not report the broken file");
  } catch (const Error& error) {
    CHECK(error.kind() == ErrorKind::io);
  }

  // Repaired: the same call now works (the failed fetches left nothing behind).
  restore();
  zero->fetch(0);
  CHECK(gathered_matches(*zero, 0, 400, 0));
  CHECK(gathered_matches(*zero, 1, 256, 0));
  zero->release(0);
  zero->end_step();
  zero->check_invariants();
}

TEST_CASE("NVMe offload: a shard that cannot be read for a prefetch leaves a consistent state") {
  auto& e = env();
  ductile::test::TempDir dir;
  ZeroConfig config;
  config.nvme_path = dir.path().string();
  config.max_reuse_distance = 0;
  auto zero = make_coordinator(config);
  for (ParameterId p = 0; p < 4; ++p) {
    register_f32(*zero, p, 100);
    zero->register_module(p, std::vector<ParameterId>{p});
  }
  auto pass = [&](ModuleId from) {
    for (ModuleId m = from; m < 4; ++m) {
      zero->fetch(m);
      CHECK(gathered_matches(*zero, m, 400, 0));
      zero->release(m);
      zero->check_invariants();
    }
    zero->end_step();
  };
  pass(0);  // records the trace 0, 1, 2, 3
  REQUIRE(zero->trace_mode() == TraceMode::complete);

  // Every rank loses its own shard of parameter 2: fetch(0) gathers module
  // 0, then its prefetch of 1, 2, 3 fails to read 2 on every rank before any
  // rank issues that gather.
  auto file = dir.path() / ("rank" + std::to_string(e.rank)) / "param_2.shard";
  std::filesystem::remove(file);
  try {
    zero->fetch(0);
    FAIL("fetch() did not report the missing shard file");
  } catch (const Error& error) {
    CHECK(error.kind() == ErrorKind::io);
    CHECK(std::string(error.what()).find(file.string()) != std::string::npos);
  }
  // The prefetch was taken back: planner and buffers agree.
  zero->check_invariants();
  CHECK(zero->status(0) == ParameterStatus::available);
  CHECK(zero->status(2) == ParameterStatus::not_available);
  CHECK(zero->stats().inflight_gathers == 0);

  // With the file back, the pass goes on from module 0 as traced.
  auto values = param_bytes(2, 400, 0);
  zero->set_full(2, values.data(), values.size());
  CHECK(gathered_matches(*zero, 0, 400, 0));
  zero->release(0);
  zero->check_invariants();
  pass(1);
  zero->check_invariants();
  CHECK(zero->stats().live_numel == 0);
  CHECK(zero->stats().trace_invalidations == 0);
  pass(0);
}
