// Shared by the cpu accelerator tests: the runtime with the real plugin, and
// deterministic per-rank test data.
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

namespace accel_test {

// The configuration text selecting the cpu backend with extra keys.
inline std::string cpu_config(const std::string& extra = "") {
  return std::string("[plugins]\npath = [\"") + DUCTILE_PLUGIN_DIR +
         "\"]\n[accelerator]\nbackend = \"cpu\"\n" + extra;
}

// One runtime and accelerator per process, kept for every test case: the
// world communicator is created once (a collective every rank makes in the
// same test order).
struct Env {
  ductile::core::Runtime runtime;
  std::shared_ptr<ductile::Accelerator> accel;
  std::shared_ptr<ductile::Communicator> world;
  std::shared_ptr<ductile::Stream> stream;
};

inline Env& env() {
  // A short timeout: a failing rank ends the job in bounded time.
  static Env instance = [] {
    auto runtime = ductile::core::Runtime::from_string(cpu_config("timeout = 60\n"), "test.toml");
    auto accel = runtime.get<ductile::Accelerator>();
    auto world = accel->world();
    auto stream = accel->create_stream();
    return Env{std::move(runtime), accel, world, stream};
  }();
  return instance;
}

// Memory from the accelerator, released on scope exit.
class Buffer {
 public:
  Buffer(ductile::Accelerator& accel, std::size_t bytes)
      : accel_(&accel), bytes_(bytes), data_(accel.allocate(bytes, ductile::MemoryKind::device)) {}
  ~Buffer() { accel_->deallocate(data_, ductile::MemoryKind::device); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  template <class T = std::byte>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  ductile::Accelerator* accel_;
  std::size_t bytes_;
  void* data_;
};

// A byte pattern that differs per rank, element and seed.
inline std::uint8_t pattern_byte(int rank, std::size_t index, int seed) {
  return static_cast<std::uint8_t>((rank * 131 + index * 7 + seed * 29 + (index >> 8) * 3) & 0xff);
}

inline void fill_pattern(void* data, std::size_t bytes, int rank, int seed) {
  auto* p = static_cast<std::uint8_t*>(data);
  for (std::size_t i = 0; i < bytes; ++i) p[i] = pattern_byte(rank, i, seed);
}

// Index of the first byte differing from the pattern, or -1.
inline long long first_mismatch(const void* data, std::size_t bytes, int rank, int seed) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  for (std::size_t i = 0; i < bytes; ++i)
    if (p[i] != pattern_byte(rank, i, seed)) return static_cast<long long>(i);
  return -1;
}

inline const char* type_name(ductile::DataType type) {
  switch (type) {
    case ductile::DataType::f32:
      return "f32";
    case ductile::DataType::f64:
      return "f64";
    case ductile::DataType::f16:
      return "f16";
    case ductile::DataType::bf16:
      return "bf16";
    case ductile::DataType::i32:
      return "i32";
    case ductile::DataType::i64:
      return "i64";
    case ductile::DataType::u8:
      return "u8";
  }
  return "?";
}

inline constexpr ductile::DataType kAllTypes[] = {
    ductile::DataType::f32, ductile::DataType::f64, ductile::DataType::f16, ductile::DataType::bf16,
    ductile::DataType::i32, ductile::DataType::i64, ductile::DataType::u8};

}  // namespace accel_test
