// The update itself, written once over a vector type V and instantiated by
// each instruction set's file (adam_scalar.cpp, adam_avx2.cpp,
// adam_avx512.cpp) with its own V. Included only by those files.
//
// Everything here has internal linkage (an unnamed namespace, builtins
// instead of <cmath> and std::bit_cast): an inline function with external
// linkage compiled with AVX flags in one file could be the copy the linker
// keeps for all of them, and fault on a CPU without AVX.
//
// The operations and their order are torch.optim.Adam's (single-tensor, not
// capturable), one kernel of torch per line, with floats rounded where
// torch rounds them and fused where torch 2.13's CPU kernels fuse (checked
// element by element against them):
//   param.mul_(1 - lr * weight_decay)           (AdamW)
//   grad = grad.add(param, alpha=weight_decay)  (Adam: fma(param, wd, grad))
//   exp_avg.lerp_(grad, 1 - beta1)              (fma, in lerp's two forms)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//                                               (fma((1 - beta2) grad, grad, .))
//   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step_size)   ((value exp_avg) / denom)
// The files are compiled with -ffp-contract=off: no multiply and add are
// fused unless written as fma here, and every element of a range, vector
// body or scalar tail, is computed alike.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam_kernel.hpp"

namespace ductile::cpu_adam {
namespace {

inline std::uint32_t bits_of(float x) {
  return __builtin_bit_cast(std::uint32_t, x);
}
inline float float_of(std::uint32_t x) {
  return __builtin_bit_cast(float, x);
}

// A NaN becomes the quiet NaN of its sign, so that every path rounds it to
// the same 16-bit NaN (sign | 0x7FC0 in bf16, sign | 0x7E00 in fp16).
inline float quiet_nan_of(float x) {
  return x != x ? float_of((bits_of(x) & 0x80000000u) | 0x7FC00000u) : x;
}

// Round to nearest, ties to even (torch's c10::BFloat16 rounding).
inline std::uint16_t bf16_of(float x) {
  const std::uint32_t u = bits_of(quiet_nan_of(x));
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Round to nearest, ties to even, as F16C's vcvtps2ph does: overflow to
// infinity, subnormals kept.
inline std::uint16_t f16_of(float x) {
  const std::uint32_t u = bits_of(quiet_nan_of(x));
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (a >= 0x47800000u) return sign | 0x7C00u;  // 65536 and up: infinity
  if (a < 0x38800000u) {
    // Below 2^-14, fp16's smallest normal: adding 0.5 (whose last bit is
    // worth 2^-24, fp16's smallest subnormal) rounds to that grid in the
    // FPU's rounding, to nearest even; the low bits are the fp16 bits.
    const float rounded = float_of(a) + 0.5f;
    return sign | static_cast<std::uint16_t>(bits_of(rounded) - 0x3F000000u);
  }
  // Normal: drop 13 significand bits rounding to even, re-bias the
  // exponent from 127 to 15 (a carry into the exponent is right, up to
  // infinity).
  a += 0xFFFu + ((a >> 13) & 1u);
  a -= 112u << 23;
  return sign | static_cast<std::uint16_t>(a >> 13);
}

// One element at a time, for the scalar kernel and the vector kernels'
// tails.
struct ScalarOps {
  using F = float;
  static constexpr std::size_t width = 1;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F set(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F fma(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static void store_bf16(std::uint16_t* p, F x) { *p = bf16_of(x); }
  static void store_f16(std::uint16_t* p, F x) { *p = f16_of(x); }
};

template <class V, bool kScale, Decay kDecay, bool kSmall, CopyOut kOut>
void adam_elements(const AdamConstants& c, const AdamRange& r, std::size_t begin, std::size_t end) {
  using F = typename V::F;
  const F grad_scale = V::set(c.grad_scale);
  const F decay_factor = V::set(c.decay_factor);
  const F weight_decay = V::set(c.weight_decay);
  // lerp(m, g, w): m + w (g - m) for a small weight, else g + (w - 1)(g - m).
  const F lerp_coeff = V::set(kSmall ? c.lerp_weight : c.lerp_weight - 1.0f);
  const F beta2 = V::set(c.beta2);
  const F one_minus_beta2 = V::set(c.one_minus_beta2);
  const F bias_correction2_sqrt = V::set(c.bias_correction2_sqrt);
  const F eps = V::set(c.eps);
  const F neg_step_size = V::set(c.neg_step_size);
  // Locals: the vector stores may alias anything (their types are
  // may_alias), so fields of r would be reloaded on every iteration.
  float* const params = r.params;
  const float* const grads = r.grads;
  float* const exp_avg = r.exp_avg;
  float* const exp_avg_sq = r.exp_avg_sq;
  std::uint16_t* const copy_out = r.copy_out;
  std::size_t i = begin;
  for (; i + V::width <= end; i += V::width) {
    F g = V::load(grads + i);
    if constexpr (kScale) g = V::mul(g, grad_scale);
    F p = V::load(params + i);
    if constexpr (kDecay == Decay::decoupled) p = V::mul(p, decay_factor);
    if constexpr (kDecay == Decay::l2) g = V::fma(p, weight_decay, g);
    F m = V::load(exp_avg + i);
    m = V::fma(lerp_coeff, V::sub(g, m), kSmall ? m : g);
    F v = V::load(exp_avg_sq + i);
    v = V::fma(V::mul(one_minus_beta2, g), g, V::mul(v, beta2));
    const F denom = V::add(V::div(V::sqrt(v), bias_correction2_sqrt), eps);
    p = V::add(p, V::div(V::mul(neg_step_size, m), denom));
    V::store(params + i, p);
    V::store(exp_avg + i, m);
    V::store(exp_avg_sq + i, v);
    if constexpr (kOut == CopyOut::bf16) V::store_bf16(copy_out + i, p);
    if constexpr (kOut == CopyOut::f16) V::store_f16(copy_out + i, p);
  }
  if constexpr (V::width > 1) adam_elements<ScalarOps, kScale, kDecay, kSmall, kOut>(c, r, i, end);
}

template <class V, bool kScale, Decay kDecay, bool kSmall>
void adam_with_copy_out(const AdamConstants& c, const AdamRange& r) {
  switch (c.copy_out) {
    case CopyOut::none:
      return adam_elements<V, kScale, kDecay, kSmall, CopyOut::none>(c, r, 0, r.numel);
    case CopyOut::bf16:
      return adam_elements<V, kScale, kDecay, kSmall, CopyOut::bf16>(c, r, 0, r.numel);
    case CopyOut::f16:
      return adam_elements<V, kScale, kDecay, kSmall, CopyOut::f16>(c, r, 0, r.numel);
  }
}

template <class V, bool kScale, Decay kDecay>
void adam_with_decay(const AdamConstants& c, const AdamRange& r) {
  if (c.lerp_small)
    adam_with_copy_out<V, kScale, kDecay, true>(c, r);
  else
    adam_with_copy_out<V, kScale, kDecay, false>(c, r);
}

template <class V, bool kScale>
void adam_with_scale(const AdamConstants& c, const AdamRange& r) {
  switch (c.decay) {
    case Decay::none:
      return adam_with_decay<V, kScale, Decay::none>(c, r);
    case Decay::decoupled:
      return adam_with_decay<V, kScale, Decay::decoupled>(c, r);
    case Decay::l2:
      return adam_with_decay<V, kScale, Decay::l2>(c, r);
  }
}

// The kernel of one instruction set: every element of r.
template <class V>
void adam_range(const AdamConstants& c, const AdamRange& r) {
  if (c.scale_grads)
    adam_with_scale<V, true>(c, r);
  else
    adam_with_scale<V, false>(c, r);
}

}  // namespace
}  // namespace ductile::cpu_adam
