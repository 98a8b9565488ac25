// Optimizer "cpu_adam": Adam and AdamW over flat fp32 buffers on the host,
// vectorised (AVX-512 or AVX2 when the CPU has it, chosen when the plugin
// is created) and split over as many threads as the caller gives with the
// step (else its `threads` parameter): the process's OpenMP runtime when it
// has one loaded (loaded_openmp.hpp says why), else a pool of our own.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

#include "adam_kernel.hpp"
#include "ductile/optimizer.hpp"
#include "loaded_openmp.hpp"
#include "work_pool.hpp"

namespace ductile::cpu_adam {
namespace {

// Below this many elements a step runs on the caller's thread alone: waking
// a worker costs more than the work. A multiple of 64, so that chunks of
// different threads never share a cache line of any buffer (64 bytes: 16
// floats, 32 16-bit values) when the buffers are aligned.
constexpr std::size_t kMinChunk = 32 * 1024;
constexpr std::size_t kChunkAlign = 64;

struct Isa {
  const char* name;
  AdamKernel kernel;
  bool (*available)();
};

bool always() {
  return true;
}

#if defined(DUCTILE_CPU_ADAM_X86)
// libgcc's checks also ask the OS (XGETBV) whether it saves the registers.
bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && has_avx2();
}
#endif

// Best first.
constexpr Isa kIsas[] = {
#if defined(DUCTILE_CPU_ADAM_X86)
    {"avx512", &adam_avx512, &has_avx512},
    {"avx2", &adam_avx2, &has_avx2},
#endif
    {"scalar", &adam_scalar, &always},
};

const char* const kSimdChoices[] = {"auto", "avx512", "avx2", "scalar", nullptr};
const char* const kThreadingChoices[] = {"auto", "openmp", "pool", nullptr};

constexpr ParamSpec kSchema[] = {
    {.key = "threads",
     .type = ParamType::integer,
     .flags = param_has_min | param_has_max,
     .default_value = "0",
     .max_value = 4096,
     .doc = "Threads a step uses when the caller does not give a count with it (Python's "
            "DuctileCPUAdam gives torch.get_num_threads() unless this is set); 0: one per core "
            "this process may run on"},
    {.key = "simd",
     .type = ParamType::string,
     .default_value = "\"auto\"",
     .allowed_values = kSimdChoices,
     .doc =
         "Instruction set: \"auto\" (the best this CPU has: avx512, avx2, else scalar) or one of "
         "them, refused when the CPU lacks it"},
    {.key = "threading",
     .type = ParamType::string,
     .default_value = "\"auto\"",
     .allowed_values = kThreadingChoices,
     .doc = "Whose threads run a step: \"openmp\" (the OpenMP runtime this process has "
            "loaded, as torch does; refused when none is), \"pool\" (the plugin's own), or "
            "\"auto\" (openmp when a runtime is loaded when the plugin is created, else pool)"},
};

std::size_t usable_cores() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

std::string available_isas() {
  std::string out;
  for (const auto& isa : kIsas)
    if (isa.available()) out += (out.empty() ? "" : ", ") + std::string(isa.name);
  return out;
}

const Isa& choose_isa(const std::string& simd) {
  for (const auto& isa : kIsas)
    if (simd == "auto" ? isa.available() : simd == isa.name) {
      if (!isa.available()) break;
      return isa;
    }
  throw ParamError(ErrorKind::unsupported, "simd",
                   "cpu_adam: simd = \"" + simd + "\" is not available on this CPU; it has: " +
                       available_isas() + " (or use \"auto\")");
}

std::unique_ptr<LoadedOpenMP> choose_openmp(const std::string& threading) {
  if (threading == "pool") return nullptr;
  auto found = LoadedOpenMP::find();
  if (!found && threading == "openmp")
    throw ParamError(ErrorKind::unsupported, "threading",
                     "cpu_adam: threading = \"openmp\" needs an OpenMP runtime loaded in this "
                     "process, and none is (looked for " +
                         LoadedOpenMP::searched() + "); use \"auto\" or \"pool\"");
  return found;
}

// What one step hands each chunk.
struct StepWork {
  AdamKernel kernel;
  AdamConstants constants;
  AdamRange whole;
  std::size_t chunk;

  static void run_chunk(const void* context, std::size_t index) {
    const auto& w = *static_cast<const StepWork*>(context);
    const std::size_t begin = index * w.chunk;
    AdamRange r = w.whole;
    r.params += begin;
    r.grads += begin;
    r.exp_avg += begin;
    r.exp_avg_sq += begin;
    if (r.copy_out) r.copy_out += begin;
    r.numel = std::min(w.chunk, w.whole.numel - begin);
    w.kernel(w.constants, r);
  }
};

class CpuAdam final : public Optimizer {
 public:
  explicit CpuAdam(const HostContext& context)
      : isa_(choose_isa(context.params().get_string("simd"))),
        threads_(context.params().get_int("threads") > 0
                     ? static_cast<std::size_t>(context.params().get_int("threads"))
                     : usable_cores()),
        openmp_(choose_openmp(context.params().get_string("threading"))),
        pool_(openmp_ ? 0 : threads_ - 1) {
    // Now, not with the first step: torch's forward and backward before it
    // would otherwise run with workers that spin their full count
    // (loaded_openmp.hpp).
    if (openmp_ && threads_ > 1) openmp_->prepare();
    context.logger()->debug("optimizer cpu_adam: {}", implementation());
  }

  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }

  std::string implementation() const override {
    return std::string(isa_.name) + ", " + std::to_string(threads_) +
           (threads_ == 1 ? " thread" : " threads") +
           (openmp_ ? " (OpenMP: " + openmp_->soname() + ")" : std::string(" (own pool)"));
  }

  void step(const OptimizerBuffers& b, const OptimizerHyperParams& h, std::uint64_t step) override {
    check_optimizer_step(b, h, step, 2);
    if (b.numel == 0) return;
    // The caller's count wins: it knows how many cores are its share.
    const std::size_t threads = b.threads > 0 ? b.threads : threads_;
    StepWork work{isa_.kernel,
                  constants(b, h, step),
                  {b.params, b.grads, b.state[0], b.state[1],
                   static_cast<std::uint16_t*>(b.copy_out), b.numel},
                  chunk_size(b.numel, threads)};
    const std::size_t chunks = (b.numel + work.chunk - 1) / work.chunk;
    if (openmp_) {
      if (threads > 1 && chunks > 1) openmp_->prepare();
      openmp_->run(chunks, &StepWork::run_chunk, &work, threads);
    } else
      pool_.run(chunks, &StepWork::run_chunk, &work, threads);
  }

 private:
  // The scalars of torch's update (see adam_body.hpp): Python computes them
  // in double and each kernel of torch rounds its scalar to float.
  static AdamConstants constants(const OptimizerBuffers& b, const OptimizerHyperParams& h,
                                 std::uint64_t step) {
    const double t = static_cast<double>(step);
    const double bias_correction1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
    const double bias_correction2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
    AdamConstants c{};
    c.lerp_weight = static_cast<float>(1.0 - h.beta1);
    c.lerp_small = std::fabs(c.lerp_weight) < 0.5f;
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    c.bias_correction2_sqrt = static_cast<float>(std::pow(bias_correction2, 0.5));
    c.eps = static_cast<float>(h.eps);
    c.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
    c.decay_factor = static_cast<float>(1.0 - h.lr * h.weight_decay);
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.grad_scale = static_cast<float>(h.grad_scale);
    c.scale_grads = h.grad_scale != 1.0;
    c.decay = h.weight_decay == 0.0 ? Decay::none : h.adamw_mode ? Decay::decoupled : Decay::l2;
    c.copy_out = b.copy_out == nullptr              ? CopyOut::none
                 : b.copy_out_type == HalfType::f16 ? CopyOut::f16
                                                    : CopyOut::bf16;
    return c;
  }

  // About 16 chunks per thread, so that a thread slowed by others on its
  // core leaves its share to the rest, and the last chunk's wait is short.
  // (Chunks never change a result: each element's update is its own.)
  static std::size_t chunk_size(std::size_t numel, std::size_t threads) {
    std::size_t chunk = std::max(kMinChunk, numel / (threads * 16));
    return (chunk + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  }

  const Isa& isa_;
  std::size_t threads_;                   // when a step gives no count
  std::unique_ptr<LoadedOpenMP> openmp_;  // null: pool_ runs the steps
  WorkPool pool_;                         // no workers when openmp_ does
};

}  // namespace
}  // namespace ductile::cpu_adam

DUCTILE_PLUGIN(ductile::cpu_adam::CpuAdam, "cpu_adam", "1.0.0",
               "Adam and AdamW on flat fp32 host buffers: AVX-512/AVX2, multi-threaded, "
               "torch.optim.AdamW's results",
               ductile::cpu_adam::kSchema)
