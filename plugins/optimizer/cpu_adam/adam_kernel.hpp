// The Adam/AdamW update of a range of elements, one entry point per
// instruction set. Each is compiled in a file of its own with that set's
// flags (adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp) and called only
// on a CPU that has it, so the plugin loads on any x86-64 (and any other
// architecture, scalar only).
#pragma once

#include <cstddef>
#include <cstdint>

namespace ductile::cpu_adam {

enum class Decay : std::uint8_t { none, decoupled, l2 };
enum class CopyOut : std::uint8_t { none, bf16, f16 };

// One step's constants, computed once per call in double and rounded to
// float as torch rounds the Python scalars it passes to its kernels.
struct AdamConstants {
  float lerp_weight;            // 1 - beta1: exp_avg.lerp_(grad, 1 - beta1)
  bool lerp_small;              // |weight| < 0.5 picks torch's form of lerp
  float beta2;                  // exp_avg_sq.mul_(beta2)
  float one_minus_beta2;        // .addcmul_(grad, grad, value=1 - beta2)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step), or 1
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step), or -lr
  float decay_factor;   // 1 - lr x weight_decay (Decay::decoupled)
  float weight_decay;   // Decay::l2: grad + weight_decay x param
  float grad_scale;
  bool scale_grads;  // grad_scale != 1
  Decay decay;
  CopyOut copy_out;
};

// The buffers of one range, already offset to its first element.
struct AdamRange {
  float* params;
  const float* grads;
  float* exp_avg;
  float* exp_avg_sq;
  std::uint16_t* copy_out;  // null unless AdamConstants::copy_out != none
  std::size_t numel;
};

using AdamKernel = void (*)(const AdamConstants&, const AdamRange&);

void adam_scalar(const AdamConstants& c, const AdamRange& r);
#if defined(__x86_64__) || defined(_M_X64)
#define DUCTILE_CPU_ADAM_X86 1
void adam_avx2(const AdamConstants& c, const AdamRange& r);
void adam_avx512(const AdamConstants& c, const AdamRange& r);
#endif

}  // namespace ductile::cpu_adam
