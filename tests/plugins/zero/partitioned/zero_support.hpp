// Shared by the ZeRO coordinator tests: one runtime (real cpu accelerator,
// real plugins) per process, coordinators created with explicit [zero]
// parameters, and deterministic parameter contents.
#pragma once

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ductile/accelerator.hpp"
#include "ductile/core/runtime.hpp"
#include "ductile/parameter_coordinator.hpp"

namespace zero_test {

using namespace ductile;

struct Env {
  core::Runtime runtime;
  std::shared_ptr<Accelerator> accel;
  std::shared_ptr<Communicator> world;
  int rank = 0;
  int size = 1;
};

// One runtime per process (every rank creates the world communicator once,
// in the same test order). A short collective timeout: a rank that fails a
// check ends the job in bounded time instead of hanging it.
inline Env& env() {
  static Env instance = [] {
    auto runtime =
        core::Runtime::from_string(std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
                                       "\"]\n[accelerator]\nbackend = \"cpu\"\n"
                                       "timeout = 60\n[zero]\n",
                                   "zero_test.toml");
    auto accel = runtime.get<Accelerator>();
    auto world = accel->world();
    int rank = world->rank(), size = world->size();
    return Env{std::move(runtime), accel, world, rank, size};
  }();
  return instance;
}

struct ZeroConfig {
  double prefetch_bucket_size = 5e7;
  double max_live_parameters = 1e9;
  double max_reuse_distance = 1e9;
  double param_persistence_threshold = 0;
  std::int64_t max_ongoing_fetch_events = 2;
  std::string nvme_path;
  std::int64_t nvme_buffer_count = 5;
};

inline std::shared_ptr<ParameterCoordinator> make_coordinator(const ZeroConfig& c) {
  Params p;
  p.set("prefetch_bucket_size", c.prefetch_bucket_size);
  p.set("max_live_parameters", c.max_live_parameters);
  p.set("max_reuse_distance", c.max_reuse_distance);
  p.set("param_persistence_threshold", c.param_persistence_threshold);
  p.set("max_ongoing_fetch_events", c.max_ongoing_fetch_events);
  p.set("nvme_path", c.nvme_path);
  p.set("nvme_buffer_count", c.nvme_buffer_count);
  return env().runtime.create<ParameterCoordinator>("partitioned", p);
}

// Bytes of parameter `id` in version `version`: differ per parameter,
// element and version (element size independent).
inline std::vector<std::uint8_t> param_bytes(ParameterId id, std::size_t bytes, int version) {
  std::vector<std::uint8_t> out;
  out.reserve(bytes);
  for (std::size_t i = 0; i < bytes; ++i)
    out.push_back(static_cast<std::uint8_t>(
        (id * 151 + i * 13 + (i >> 8) * 7 + static_cast<std::size_t>(version) * 101 + 1) & 0xff));
  return out;
}

inline void register_f32(ParameterCoordinator& zero, ParameterId id, std::size_t numel,
                         int version = 0) {
  zero.register_parameter({id, numel, DataType::f32});
  auto bytes = param_bytes(id, numel * 4, version);
  zero.set_full(id, bytes.data(), bytes.size());
}

// True when the parameter has a gathered copy (fetched, prefetched or kept).
inline bool gathered(ParameterCoordinator& zero, ParameterId id) {
  return zero.status(id) != ParameterStatus::not_available;
}

// True when the gathered copy equals the original bytes of `version`.
inline bool gathered_matches(ParameterCoordinator& zero, ParameterId id, std::size_t bytes,
                             int version) {
  std::vector<std::uint8_t> got(bytes);
  zero.read_full(id, got.data(), got.size());
  return got == param_bytes(id, bytes, version);
}

// One training pass over a chain model (module m uses parameters m and
// m + 1), forward then backward, ended by end_step(): every copy gathered
// holds the bytes of `version`, and `after_release` runs after each
// module's release.
template <class AfterRelease>
void chain_pass(ParameterCoordinator& zero, const std::vector<std::size_t>& sizes, int version,
                AfterRelease&& after_release) {
  const ModuleId modules = sizes.size() - 1;
  std::vector<ModuleId> order;
  for (ModuleId m = 0; m < modules; ++m) order.push_back(m);
  for (ModuleId m = modules; m-- > 0;) order.push_back(m);
  for (ModuleId m : order) {
    zero.fetch(m);
    for (ParameterId p : {m, m + 1}) CHECK(gathered_matches(zero, p, sizes[p] * 4, version));
    zero.release(m);
    zero.check_invariants();
    after_release();
  }
  zero.end_step();
}

// True when this rank's shard (read_shard()) holds its slice of the
// original bytes of `version`, zero-padded past the parameter's end.
inline bool shard_matches(ParameterCoordinator& zero, int rank, ParameterId id, std::size_t bytes,
                          int version) {
  std::vector<std::uint8_t> shard(zero.shard_numel(id) * 4);
  zero.read_shard(id, shard.data(), shard.size());
  auto full = param_bytes(id, bytes, version);
  const std::size_t first = static_cast<std::size_t>(rank) * shard.size();
  for (std::size_t i = 0; i < shard.size(); ++i)
    if (shard[i] != (first + i < full.size() ? full[first + i] : 0)) return false;
  return true;
}

}  // namespace zero_test
