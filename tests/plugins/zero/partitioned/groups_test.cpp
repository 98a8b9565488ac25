// Parameter groups of the partitioned coordinator on the real cpu backend
// under mpirun with 1, 2 and 3 ranks: several tensors sharded one by one,
// gathered in one collective, each whole and back to back in the copy.
#include <algorithm>
#include <numeric>

#include "temp_dir.hpp"
#include "zero_support.hpp"

using namespace zero_test;

namespace {

// A group of `numels` members of `type`, its full values (the members back
// to back) set from param_bytes(id, ..., version).
std::vector<std::uint8_t> register_group(ParameterCoordinator& zero, ParameterId id,
                                         const std::vector<std::size_t>& numels, DataType type,
                                         int version = 0) {
  const std::size_t numel = std::accumulate(numels.begin(), numels.end(), std::size_t{0});
  zero.register_group({id, numel, type}, numels);
  auto bytes = param_bytes(id, numel * size_of(type), version);
  zero.set_full(id, bytes.data(), bytes.size());
  return bytes;
}

// This rank's shard of the members of `full`: each member's slice, padded.
std::vector<std::uint8_t> expected_shard(const std::vector<std::uint8_t>& full,
                                         const std::vector<std::size_t>& numels, DataType type,
                                         int rank, int world) {
  const std::size_t es = size_of(type);
  std::vector<std::uint8_t> out;
  std::size_t at = 0;
  for (std::size_t n : numels) {
    const std::size_t shard = (n + world - 1) / world, first = rank * shard;
    for (std::size_t i = first; i < first + shard; ++i) {
      for (std::size_t b = 0; b < es; ++b) out.push_back(i < n ? full[(at + i) * es + b] : 0);
    }
    at += n;
  }
  return out;
}

}  // namespace

TEST_CASE("a group's members are sharded one by one and gathered whole, back to back") {
  auto& e = env();
  ZeroConfig config;
  config.param_persistence_threshold = 0;
  auto zero = make_coordinator(config);
  const std::vector<std::size_t> numels = {1, 5, 7, 100, 13, 4099};
  const std::vector<std::size_t> small = {3, 2};
  auto full = register_group(*zero, 10, numels, DataType::f32);
  auto full16 = register_group(*zero, 11, small, DataType::bf16);
  register_f32(*zero, 12, 9);  // a plain parameter beside them
  zero->register_module(0, std::vector<ParameterId>{10});
  zero->register_module(1, std::vector<ParameterId>{11, 12});

  std::size_t shard = 0;
  for (std::size_t n : numels) shard += (n + e.size - 1) / e.size;
  CHECK(zero->shard_numel(10) == shard);
  std::vector<std::uint8_t> got(shard * 4);
  zero->read_shard(10, got.data(), got.size());
  CHECK(got == expected_shard(full, numels, DataType::f32, e.rank, e.size));
  got.assign(zero->shard_numel(11) * 2, 0);
  zero->read_shard(11, got.data(), got.size());
  CHECK(got == expected_shard(full16, small, DataType::bf16, e.rank, e.size));

  for (int pass = 0; pass < 3; ++pass) {
    for (ModuleId m : {0, 1, 1, 0}) {
      const auto gathers = zero->stats().gathers;
      zero->fetch(m);
      if (m == 0 && pass == 0) CHECK(zero->stats().gathers == gathers + 1);  // one collective
      for (ParameterId id : m == 0 ? std::vector<ParameterId>{10} : std::vector<ParameterId>{11}) {
        const auto& members = id == 10 ? numels : small;
        const auto& values = id == 10 ? full : full16;
        const DataType type = id == 10 ? DataType::f32 : DataType::bf16;
        const std::size_t es = size_of(type);
        CHECK(gathered_matches(*zero, id, values.size(), 0));
        // The copy: member i at world * (s_0 + ... + s_{i-1}), whole, then padding.
        const auto* copy = static_cast<const std::uint8_t*>(zero->full_data(id));
        std::size_t at = 0, offset = 0;
        for (std::size_t n : members) {
          const std::size_t s = (n + e.size - 1) / e.size;
          CHECK(std::memcmp(copy + e.size * offset * es, values.data() + at * es, n * es) == 0);
          CHECK(std::all_of(copy + (e.size * offset + n) * es, copy + e.size * (offset + s) * es,
                            [](std::uint8_t b) { return b == 0; }));
          at += n;
          offset += s;
        }
      }
      if (m == 1) CHECK(gathered_matches(*zero, 12, 9 * 4, 0));
      zero->release(m);
      zero->check_invariants();
    }
    zero->end_step();
  }
  CHECK(zero->trace_mode() == TraceMode::complete);
}

TEST_CASE("a group's shard written in place is what its next gather returns") {
  auto& e = env();
  auto zero = make_coordinator(ZeroConfig{});
  const std::vector<std::size_t> numels = {6, 1, 11};
  register_group(*zero, 1, numels, DataType::f32);
  zero->register_module(1, std::vector<ParameterId>{1});
  // Each member's elements become 100 * member + its index; padding stays 0.
  auto* data = static_cast<float*>(zero->shard_data(1));
  std::size_t offset = 0;
  for (std::size_t k = 0; k < numels.size(); ++k) {
    const std::size_t s = (numels[k] + e.size - 1) / e.size;
    for (std::size_t i = 0; i < s; ++i) {
      const std::size_t index = e.rank * s + i;
      data[offset + i] = index < numels[k] ? static_cast<float>(100 * k + index) : 0.0f;
    }
    offset += s;
  }
  zero->shard_written(1);
  zero->fetch(1);
  std::vector<float> got(18);
  zero->read_full(1, got.data(), got.size() * sizeof(float));
  std::vector<float> want;
  for (std::size_t k = 0; k < numels.size(); ++k)
    for (std::size_t i = 0; i < numels[k]; ++i) want.push_back(static_cast<float>(100 * k + i));
  CHECK(got == want);
  zero->release(1);
  zero->end_step();
}

TEST_CASE("a group's shard in an NVMe file round-trips and gathers") {
  auto& e = env();
  ductile::test::TempDir dir;
  ZeroConfig config;
  config.nvme_path = dir.path().string();
  auto zero = make_coordinator(config);
  const std::vector<std::size_t> numels = {300, 7, 64};
  auto full = register_group(*zero, 5, numels, DataType::f32, 2);
  zero->register_module(0, std::vector<ParameterId>{5});
  std::vector<std::uint8_t> got(zero->shard_numel(5) * 4);
  zero->read_shard(5, got.data(), got.size());
  CHECK(got == expected_shard(full, numels, DataType::f32, e.rank, e.size));
  for (int pass = 0; pass < 2; ++pass) {
    zero->fetch(0);
    CHECK(gathered_matches(*zero, 5, full.size(), 2));
    zero->release(0);
    zero->end_step();
  }
  CHECK(zero->stats().nvme_reads > 0);
}

TEST_CASE("a bad group is refused with what is valid, and registers nothing") {
  auto zero = make_coordinator(ZeroConfig{});
  auto refused = [&](std::size_t numel, std::vector<std::size_t> members, const char* says) {
    try {
      zero->register_group({7, numel, DataType::f32}, members);
      FAIL("no error");
    } catch (const Error& err) {
      CHECK(err.kind() == ErrorKind::invalid_argument);
      CHECK_MESSAGE(std::string(err.what()).find(says) != std::string::npos, err.what());
    }
  };
  refused(10, {}, "0 members");
  refused(10, {4, 5}, "9 elements in all");
  refused(10, {10, 0}, "a member of 0 elements");
  // Nothing was registered: the id is still free.
  zero->register_group({7, 10, DataType::f32}, std::vector<std::size_t>{4, 6});
  CHECK(zero->shard_numel(7) > 0);
}
