#include "half.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <type_traits>

namespace ductile::accel {

float half_to_float(std::uint16_t h) noexcept {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf or nan (payload kept)
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {
    // Subnormal: value = mantissa * 2^-24, exact in fp32.
    float value = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -value : value;
  }
  return std::bit_cast<float>(bits);
}

std::uint16_t float_to_half(float value) noexcept {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  std::uint32_t abs = bits & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan
    if (abs == 0x7f800000u) return sign | 0x7c00u;
    return sign | 0x7e00u | static_cast<std::uint16_t>((abs >> 13) & 0x3ffu);
  }
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: overflow
  if (abs < 0x38800000u) {
    // Result is subnormal or zero: round abs * 2^24 to nearest even.
    float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // exact
    float rounded = std::nearbyint(scaled);                  // default mode: ties to even
    return sign | static_cast<std::uint16_t>(rounded);
  }
  std::uint32_t exponent = (abs >> 23) - 112;
  std::uint32_t mantissa = abs & 0x7fffffu;
  std::uint32_t result = (exponent << 10) | (mantissa >> 13);
  std::uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (result & 1u))) ++result;  // may carry into exponent
  return sign | static_cast<std::uint16_t>(result);
}

float bf16_to_float(std::uint16_t bits) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t float_to_bf16(float value) noexcept {
  std::uint32_t bits = std::bit_cast<std::uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>(bits >> 16);
}

namespace {

// Integer sums and products wrap around (as MPI's do): computed unsigned.
template <class T>
struct Arithmetic {
  using type = T;
};
template <class T>
requires std::is_integral_v<T>
struct Arithmetic<T> {
  using type = std::make_unsigned_t<decltype(T{} + T{})>;
};

template <class T>
T apply(ReduceOp op, T a, T b) noexcept {
  using Wide = typename Arithmetic<T>::type;
  switch (op) {
    case ReduceOp::sum:
      return static_cast<T>(static_cast<Wide>(a) + static_cast<Wide>(b));
    case ReduceOp::prod:
      return static_cast<T>(static_cast<Wide>(a) * static_cast<Wide>(b));
    case ReduceOp::min:
      return std::min(a, b);
    case ReduceOp::max:
      return std::max(a, b);
  }
  return a;
}

template <class T>
void reduce_plain(const void* in, void* inout, std::size_t count, ReduceOp op) noexcept {
  const auto* a = static_cast<const T*>(in);
  auto* b = static_cast<T*>(inout);
  for (std::size_t i = 0; i < count; ++i) b[i] = apply(op, a[i], b[i]);
}

template <float (*ToFloat)(std::uint16_t), std::uint16_t (*FromFloat)(float)>
void reduce_16(const void* in, void* inout, std::size_t count, ReduceOp op) noexcept {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (std::size_t i = 0; i < count; ++i) b[i] = FromFloat(apply(op, ToFloat(a[i]), ToFloat(b[i])));
}

}  // namespace

void reduce_into(const void* in, void* inout, std::size_t count, DataType type,
                 ReduceOp op) noexcept {
  switch (type) {
    case DataType::f32:
      return reduce_plain<float>(in, inout, count, op);
    case DataType::f64:
      return reduce_plain<double>(in, inout, count, op);
    case DataType::i32:
      return reduce_plain<std::int32_t>(in, inout, count, op);
    case DataType::i64:
      return reduce_plain<std::int64_t>(in, inout, count, op);
    case DataType::u8:
      return reduce_plain<std::uint8_t>(in, inout, count, op);
    case DataType::f16:
      return reduce_16<half_to_float, float_to_half>(in, inout, count, op);
    case DataType::bf16:
      return reduce_16<bf16_to_float, float_to_bf16>(in, inout, count, op);
  }
}

}  // namespace ductile::accel
