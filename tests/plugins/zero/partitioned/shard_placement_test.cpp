// The partitioned coordinator's shard placement (parameter offload to host
// memory) on the real cpu backend under mpirun with 1 and 3 ranks (3 gives
// shards that do not divide evenly). On the cpu backend device and host
// memory are both host memory; a host shard still takes the staging path
// (a copy into a pool buffer before its gather), which is what is checked.
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "temp_dir.hpp"
#include "zero_support.hpp"

using namespace zero_test;

namespace {

// The error `call` throws: its kind and message.
template <class Call>
Error error_of(Call call) {
  try {
    call();
  } catch (const Error& err) {
    return err;
  }
  FAIL("no error");
  return Error(ErrorKind::internal, "unreachable");
}

}  // namespace

TEST_CASE("shard placement: host shards gather what they hold, prefetched along the trace") {
  auto& e = env();
  ZeroConfig config;
  config.param_persistence_threshold = 4;  // parameter 5 stays gathered once fetched
  config.prefetch_bucket_size = 400;
  config.max_reuse_distance = 0;
  auto zero = make_coordinator(config);
  const std::vector<std::size_t> sizes = {50, 173, 300, 99, 251, 3, 120};
  for (ParameterId p = 0; p < sizes.size(); ++p) register_f32(*zero, p, sizes[p], 0);
  for (ModuleId m = 0; m + 1 < sizes.size(); ++m)
    zero->register_module(m, std::vector<ParameterId>{m, m + 1});

  // Every other shard to the host (the persistent one too), values kept.
  for (ParameterId p = 0; p < sizes.size(); ++p) {
    CHECK(zero->shard_location(p) == ShardLocation::device);
    if (p % 2 == 1 || p == 5) zero->move_shard(p, ShardLocation::host);
  }
  for (ParameterId p = 0; p < sizes.size(); ++p) {
    const bool host = p % 2 == 1 || p == 5;
    CHECK(zero->shard_location(p) == (host ? ShardLocation::host : ShardLocation::device));
    CHECK(shard_matches(*zero, e.rank, p, sizes[p] * 4, 0));
    // shard_data() points at what read_shard() copies (host memory for a host shard).
    std::vector<std::uint8_t> shard(zero->shard_numel(p) * 4);
    zero->read_shard(p, shard.data(), shard.size());
    CHECK(std::memcmp(zero->shard_data(p), shard.data(), shard.size()) == 0);
  }

  for (int pass = 0; pass < 4; ++pass) {
    chain_pass(*zero, sizes, pass, [] {});
    // The next version: through set_full() for half of them, written in
    // place through shard_data() (an optimizer's step) for the rest.
    for (ParameterId p = 0; p < sizes.size(); ++p) {
      auto bytes = param_bytes(p, sizes[p] * 4, pass + 1);
      if (p % 3 == 0) {
        zero->set_full(p, bytes.data(), bytes.size());
        continue;
      }
      const std::size_t shard = zero->shard_numel(p) * 4;
      const std::size_t first = static_cast<std::size_t>(e.rank) * shard;
      auto* data = static_cast<std::uint8_t*>(zero->shard_data(p));
      for (std::size_t i = 0; i < shard; ++i)
        data[i] = first + i < bytes.size() ? bytes[first + i] : 0;
      zero->shard_written(p);
    }
  }
  CHECK(zero->stats().prefetched_params > 0);
  // The staging buffers come from the gathered copies' pool and go back to it.
  CHECK(zero->gather_memory().in_use_bytes == zero->stats().persistent_numel * 4);

  // Back to the device, values kept: the gathers still return version 4.
  for (ParameterId p = 0; p < sizes.size(); ++p) zero->move_shard(p, ShardLocation::device);
  for (ParameterId p = 0; p < sizes.size(); ++p)
    CHECK(zero->shard_location(p) == ShardLocation::device);
  chain_pass(*zero, sizes, 4, [] {});
}

TEST_CASE("shard placement: what cannot move is an error naming the call and what is valid") {
  ductile::test::TempDir dir;
  ZeroConfig config;
  auto zero = make_coordinator(config);
  register_f32(*zero, 1, 64);
  zero->register_module(1, std::vector<ParameterId>{1});

  Error to_nvme = error_of([&] { zero->move_shard(1, ShardLocation::nvme); });
  CHECK(to_nvme.kind() == ErrorKind::invalid_argument);
  CHECK(std::string(to_nvme.what()).find("move_shard(1, nvme)") != std::string::npos);
  CHECK(std::string(to_nvme.what()).find("valid: device, host") != std::string::npos);
  CHECK(error_of([&] { zero->move_shard(77, ShardLocation::host); }).kind() ==
        ErrorKind::invalid_argument);
  CHECK(error_of([&] { (void)zero->shard_location(77); }).kind() == ErrorKind::invalid_argument);

  zero->fetch(1);
  Error in_use = error_of([&] { zero->move_shard(1, ShardLocation::host); });
  CHECK(in_use.kind() == ErrorKind::incompatible);
  CHECK(std::string(in_use.what()).find("move_shard(1)") != std::string::npos);
  CHECK(zero->shard_location(1) == ShardLocation::device);  // nothing moved
  zero->release(1);
  zero->end_step();
  zero->move_shard(1, ShardLocation::host);
  zero->move_shard(1, ShardLocation::host);  // already there: nothing to do
  CHECK(zero->shard_location(1) == ShardLocation::host);

  // A shard in a file stays there.
  ZeroConfig on_nvme;
  on_nvme.nvme_path = dir.path().string();
  auto nvme = make_coordinator(on_nvme);
  register_f32(*nvme, 1, 64);
  CHECK(nvme->shard_location(1) == ShardLocation::nvme);
  Error from_file = error_of([&] { nvme->move_shard(1, ShardLocation::host); });
  CHECK(from_file.kind() == ErrorKind::unsupported);
  CHECK(std::string(from_file.what()).find("nvme_path") != std::string::npos);
}

TEST_CASE("shard placement: the staging bound follows the gathers in flight and the bucket") {
  const auto world = static_cast<std::size_t>(env().size);
  ZeroConfig config;
  config.max_ongoing_fetch_events = 3;
  config.prefetch_bucket_size = 1200;
  auto zero = make_coordinator(config);
  // Four buffer sets (three gathers in flight and the fetch's own), each of
  // a rank's share of the bucket or the largest shard, whichever is larger.
  const std::size_t share = (1200 + world - 1) / world;
  CHECK(zero->staging_bytes_bound(1, 4) == 4 * share * 4);
  CHECK(zero->staging_bytes_bound(share + 7, 2) == 4 * (share + 7) * 2);

  config.max_ongoing_fetch_events = 1;
  config.prefetch_bucket_size = 0;  // no prefetch: the largest shard alone
  auto unbucketed = make_coordinator(config);
  CHECK(unbucketed->staging_bytes_bound(10, 8) == 2 * 10 * 8);

  // The largest bucket the schema takes does not wrap around.
  config.prefetch_bucket_size = 9e18;
  auto huge = make_coordinator(config);
  CHECK(huge->staging_bytes_bound(1, 8) == std::numeric_limits<std::size_t>::max());
}
