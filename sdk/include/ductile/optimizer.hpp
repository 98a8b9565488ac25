// The Optimizer interface (plugin kind PluginKind::optimizer): one update
// step of an element-wise optimizer (Adam, AdamW, ...) over flat fp32
// buffers in host memory, as ZeRO-Offload steps the fp32 master weights on
// the CPU while the device trains.
//
// Per flat shard of parameters the caller (a torch optimizer, an offload
// engine) keeps the fp32 parameters, their fp32 gradients, one fp32 buffer
// per state the optimizer names (state_names(): "exp_avg", "exp_avg_sq" for
// Adam), all zero before the first step, and the count of steps taken. A
// step() updates the parameters and the states in place; it may also write
// the updated parameters rounded to bf16 or fp16 into a second buffer (the
// copy the device computes with under mixed precision), which saves a pass
// over the parameters.
//
// Typical use:
//
//   auto adam = runtime.get<ductile::Optimizer>();   // [optimizer] name = "cpu_adam"
//   std::vector<float> exp_avg(n), exp_avg_sq(n);    // zero: the state before step 1
//   float* state[] = {exp_avg.data(), exp_avg_sq.data()};  // in state_names() order
//   ductile::OptimizerHyperParams hyper{.lr = 1e-3, .weight_decay = 0.01};
//   for (std::uint64_t step = 1; ...; ++step)
//     adam->step({.params = w, .grads = g, .state = state, .numel = n}, hyper, step);
//
// Conventions for every call below:
// - Ownership: the caller owns every buffer. An optimizer keeps no pointer
//   to a buffer after the call that received it returns, and holds no
//   per-shard state: everything that persists between steps is in the
//   caller's buffers and step count (so a checkpoint is those buffers).
// - Threading: step() may be called concurrently, on one optimizer object,
//   from any number of threads, as long as the calls' buffers are disjoint:
//   no byte that one call writes (params, state, copy_out) is read or
//   written by another call in flight (gradients may be shared, read-only).
//   An offload engine may thus step one parameter group from a background
//   thread while the gradients of other groups are still arriving. A call
//   returns when its buffers are fully updated. An optimizer may split a
//   call's work over threads of its own: at most OptimizerBuffers::threads
//   of them when the caller gives that count (its own intra-op thread
//   count, torch.get_num_threads() in Python, read at every call so that a
//   change is followed), else as many as its parameters say. Several
//   processes on one node, each given its share of the cores, thus never
//   each take every core. (cpu_adam: see its README for whose threads.)
//   An optimizer never calls back into the caller.
//   Destroying it while a call is in flight is undefined: join the calling
//   threads first.
// - Errors: throws ductile::Error(ErrorKind::invalid_argument) naming the
//   field and its value for a bad call: a null buffer with numel > 0, a
//   state count other than state_names().size(), buffers that overlap, step
//   0, a hyper-parameter out of range (see OptimizerHyperParams). Every
//   check happens before anything is written, so a call that throws leaves
//   all buffers as they were. Values in the buffers are never errors: a
//   NaN or infinite gradient propagates as it does in torch.optim.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "ductile/plugin.hpp"

namespace ductile {

// The 16-bit types of the optional copy of the updated parameters. Both are
// rounded to nearest, ties to even, as torch's Tensor.to() rounds; NaN stays
// NaN.
enum class HalfType : std::uint32_t {
  bf16 = 0,  // bfloat16: fp32's exponent, 8 significand bits
  f16 = 1,   // IEEE 754 binary16
};

DUCTILE_SDK_API inline const char* to_string(HalfType type) noexcept {
  return type == HalfType::bf16 ? "bf16" : "f16";
}

// The buffers of one step: numel elements each, caller-owned, any alignment;
// and how many threads may work on them.
struct OptimizerBuffers {
  float* params = nullptr;       // fp32 parameters (the master copy), updated in place
  const float* grads = nullptr;  // fp32 gradients, read only
  // One fp32 buffer per state_names() entry, in that order, updated in place.
  std::span<float* const> state;
  std::size_t numel = 0;
  // Optional: when not null, also receives the updated parameters as
  // numel values of copy_out_type (2 bytes each).
  void* copy_out = nullptr;
  HalfType copy_out_type = HalfType::bf16;
  // At most this many threads work on the step at once (see Threading
  // above); 0: as many as the optimizer's parameters say.
  std::size_t threads = 0;
};

// The hyper-parameters of one step, named as torch.optim.Adam and
// DeepSpeedCPUAdam name them; an optimizer reads the ones its algorithm has
// and ignores the others. They may change between steps (a learning-rate
// schedule). Valid ranges (checked by check_optimizer_step()): lr,
// weight_decay and eps finite and >= 0, beta1 and beta2 in [0, 1),
// grad_scale finite and > 0.
struct OptimizerHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // true: decoupled weight decay (AdamW: parameters shrink by lr x
  // weight_decay); false: L2 (Adam: weight_decay x parameter added to the
  // gradient).
  bool adamw_mode = true;
  // Divide the moments by 1 - beta^step (torch always does).
  bool bias_correction = true;
  // Every gradient is multiplied by this before use: fold fp16 loss
  // unscaling and gradient clipping into the step instead of a pass of
  // their own. 1 reads the gradients unchanged.
  double grad_scale = 1.0;
};

class DUCTILE_SDK_API Optimizer : public Plugin {
 public:
  static constexpr PluginKind kind = PluginKind::optimizer;

  // The names of the per-element fp32 states the caller keeps for each
  // shard, in the order step() takes them: torch's state_dict keys
  // ("exp_avg", "exp_avg_sq" for Adam). Constant for the object's life.
  // Never throws; thread-safe.
  virtual std::vector<std::string> state_names() const = 0;

  // How steps are computed, for logs and benchmarks (cpu_adam: "avx2, 8
  // threads"). Never throws; thread-safe.
  virtual std::string implementation() const = 0;

  // One step over `buffers` with `hyper`; `step` is the number of this step
  // counting from 1 (torch's state["step"] after its increment), which bias
  // correction uses. Blocks until done; see the conventions above for
  // threading and errors. numel == 0 does nothing (after the checks).
  virtual void step(const OptimizerBuffers& buffers, const OptimizerHyperParams& hyper,
                    std::uint64_t step) = 0;
};

// The argument checks every optimizer's step() makes first (the Errors
// convention above), for plugins to share. Throws Error(invalid_argument)
// naming the field, its value and what is valid.
DUCTILE_SDK_API inline void check_optimizer_step(const OptimizerBuffers& b,
                                                 const OptimizerHyperParams& h, std::uint64_t step,
                                                 std::size_t state_count) {
  auto fail = [](const std::string& what) {
    return Error(ErrorKind::invalid_argument, "optimizer step: " + what);
  };
  auto number = [&](const char* name, double v, bool ok, const char* need) {
    if (ok) return;
    char shown[32];
    std::snprintf(shown, sizeof shown, "%.9g", v);
    throw fail(std::string(name) + " = " + shown + " is invalid; need " + need);
  };
  number("lr", h.lr, std::isfinite(h.lr) && h.lr >= 0.0, "a finite number >= 0");
  number("beta1", h.beta1, h.beta1 >= 0.0 && h.beta1 < 1.0, "0 <= beta1 < 1");
  number("beta2", h.beta2, h.beta2 >= 0.0 && h.beta2 < 1.0, "0 <= beta2 < 1");
  number("eps", h.eps, std::isfinite(h.eps) && h.eps >= 0.0, "a finite number >= 0");
  number("weight_decay", h.weight_decay, std::isfinite(h.weight_decay) && h.weight_decay >= 0.0,
         "a finite number >= 0");
  number("grad_scale", h.grad_scale, std::isfinite(h.grad_scale) && h.grad_scale > 0.0,
         "a finite number > 0");
  if (step == 0) throw fail("step = 0 is invalid; steps count from 1");
  if (b.state.size() != state_count)
    throw fail(std::to_string(b.state.size()) + " state buffers given; this optimizer keeps " +
               std::to_string(state_count));
  if (b.numel == 0) return;
  if (b.numel > SIZE_MAX / sizeof(float))
    throw fail("numel = " + std::to_string(b.numel) + " is larger than memory");
  if (b.copy_out != nullptr && b.copy_out_type != HalfType::bf16 &&
      b.copy_out_type != HalfType::f16)
    throw fail("copy_out_type = " + std::to_string(static_cast<std::uint32_t>(b.copy_out_type)) +
               " is invalid; need HalfType::bf16 or HalfType::f16");
  // The buffers as byte ranges, in the order params, grads, state[0..],
  // copy_out; named only for a message (no allocation on the way through).
  const std::size_t states = b.state.size();
  const std::size_t count = 2 + states + (b.copy_out != nullptr ? 1 : 0);
  auto begin = [&](std::size_t k) -> std::uintptr_t {
    const void* p = k == 0           ? static_cast<const void*>(b.params)
                    : k == 1         ? static_cast<const void*>(b.grads)
                    : k < 2 + states ? static_cast<const void*>(b.state[k - 2])
                                     : b.copy_out;
    return reinterpret_cast<std::uintptr_t>(p);
  };
  auto bytes = [&](std::size_t k) { return b.numel * (k < 2 + states ? sizeof(float) : 2); };
  auto name = [&](std::size_t k) -> std::string {
    return k == 0           ? "params"
           : k == 1         ? "grads"
           : k < 2 + states ? "state[" + std::to_string(k - 2) + "]"
                            : "copy_out";
  };
  for (std::size_t k = 0; k < count; ++k)
    if (begin(k) == 0) throw fail(name(k) + " is null with numel = " + std::to_string(b.numel));
  // Gradients may not overlap anything written; nothing written may overlap
  // anything else.
  for (std::size_t i = 0; i < count; ++i)
    for (std::size_t j = i + 1; j < count; ++j)
      if (begin(i) < begin(j) + bytes(j) && begin(j) < begin(i) + bytes(i))
        throw fail(name(i) + " and " + name(j) +
                   " overlap; every buffer of a step must be distinct memory");
}

}  // namespace ductile
