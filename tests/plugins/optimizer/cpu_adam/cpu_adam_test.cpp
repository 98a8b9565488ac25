// cpu_adam's numbers: one step against a double-precision Adam/AdamW from
// the same inputs (relative 1e-6), every instruction set this CPU has
// against the scalar kernel bit for bit (sizes with every tail), the same
// bits with 1 and several threads (a step's own count winning over the
// parameter) and from concurrent callers, and the bf16/fp16 copy of the
// parameters against an independent rounding.
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu_adam_support.hpp"

using ductile::HalfType;
using ductile::Optimizer;
using ductile::OptimizerBuffers;
using ductile::OptimizerHyperParams;
using ductile::test::available_simd;
using ductile::test::cpu_adam;

namespace {

// One shard: parameters, gradients and Adam's two states.
struct Shard {
  std::vector<float> params, grads, exp_avg, exp_avg_sq;
  std::vector<std::uint16_t> copy;

  explicit Shard(std::size_t n, std::uint32_t seed)
      : params(n), grads(n), exp_avg(n), exp_avg_sq(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& p : params) p = normal(rng);
    new_grads(seed + 1);
  }
  void new_grads(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& g : grads) g = normal(rng) * 0.1f;
  }
  void step(Optimizer& opt, const OptimizerHyperParams& h, std::uint64_t t,
            HalfType* copy_type = nullptr, std::size_t threads = 0) {
    float* state[] = {exp_avg.data(), exp_avg_sq.data()};
    OptimizerBuffers b{.params = params.data(),
                       .grads = grads.data(),
                       .state = state,
                       .numel = params.size(),
                       .threads = threads};
    if (copy_type) {
      copy.assign(params.size(), 0);
      b.copy_out = copy.data();
      b.copy_out_type = *copy_type;
    }
    opt.step(b, h, t);
  }
  bool operator==(const Shard& o) const {
    auto same = [](const auto& a, const auto& b) {
      // memcmp's pointers must not be null, even for 0 bytes (an empty vector's may be).
      return a.size() == b.size() &&
             (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0);
    };
    return same(params, o.params) && same(exp_avg, o.exp_avg) && same(exp_avg_sq, o.exp_avg_sq) &&
           same(copy, o.copy);
  }
};

// Adam (L2) and AdamW (decoupled) as Kingma & Ba and Loshchilov & Hutter
// write them, in double, one step from the shard's current values.
struct Expected {
  std::vector<double> params, exp_avg, exp_avg_sq;
  // The magnitudes each value's rounding errors are relative to: the terms
  // summed into it, before any cancellation.
  std::vector<double> params_scale, exp_avg_scale, exp_avg_sq_scale;
};
Expected reference_step(const Shard& s, const OptimizerHyperParams& h, std::uint64_t t) {
  Expected e;
  const double bc1 = h.bias_correction ? 1 - std::pow(h.beta1, double(t)) : 1;
  const double bc2 = h.bias_correction ? 1 - std::pow(h.beta2, double(t)) : 1;
  for (std::size_t i = 0; i < s.params.size(); ++i) {
    double p = s.params[i], g = double(s.grads[i]) * h.grad_scale;
    if (h.adamw_mode)
      p *= 1 - h.lr * h.weight_decay;
    else
      g += h.weight_decay * p;
    const double m = h.beta1 * s.exp_avg[i] + (1 - h.beta1) * g;
    const double v = h.beta2 * s.exp_avg_sq[i] + (1 - h.beta2) * g * g;
    const double denom = std::sqrt(v) / std::sqrt(bc2) + h.eps;
    e.params.push_back(p - h.lr / bc1 * m / denom);
    e.exp_avg.push_back(m);
    e.exp_avg_sq.push_back(v);
    const double g_scale = std::abs(double(s.grads[i]) * h.grad_scale) +
                           (h.adamw_mode ? 0.0 : h.weight_decay * std::abs(p));
    const double m_scale = std::abs(s.exp_avg[i]) + g_scale;
    e.exp_avg_scale.push_back(m_scale);
    e.exp_avg_sq_scale.push_back(s.exp_avg_sq[i] + g_scale * g_scale);
    e.params_scale.push_back(std::abs(p) + h.lr / bc1 * m_scale / denom);
  }
  return e;
}

// Within 1e-6 relative of the terms that made the value (fp32 arithmetic's
// error, which a value near zero after cancellation cannot be held to on its
// own).
void check_close(const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<double>& scale, const std::string& what) {
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - want[i]) <= 1e-6 * scale[i])) {
      if (bad++ == 0) first = i;
    }
  INFO(what << ": " << bad << " of " << got.size() << " elements off; first at " << first << ": "
            << std::setprecision(9) << (bad ? got[first] : 0.0f) << " vs "
            << (bad ? want[first] : 0.0) << " (scale " << (bad ? scale[first] : 0.0) << ")");
  CHECK(bad == 0);
}

struct Case {
  const char* name;
  OptimizerHyperParams hyper;
};

std::vector<Case> cases() {
  OptimizerHyperParams adamw{.lr = 1e-3, .weight_decay = 0.01};
  OptimizerHyperParams adam = adamw;
  adam.adamw_mode = false;
  OptimizerHyperParams plain{.lr = 3e-4};
  OptimizerHyperParams no_correction = adamw;
  no_correction.bias_correction = false;
  // 1 - beta1 >= 0.5: torch's other form of lerp.
  OptimizerHyperParams low_beta{
      .lr = 1e-2, .beta1 = 0.3, .beta2 = 0.6, .eps = 1e-6, .weight_decay = 0.1};
  OptimizerHyperParams scaled = adam;
  scaled.grad_scale = 1.0 / 1024;
  return {{"adamw", adamw},           {"adam", adam},
          {"no weight decay", plain}, {"no bias correction", no_correction},
          {"beta1 0.3", low_beta},    {"grad_scale", scaled}};
}

const std::size_t kSizes[] = {1,  2,  3,  7,  8,   9,    15,   16,   17,    31,
                              33, 63, 64, 65, 100, 1000, 4097, 8191, 70001, 200003};

}  // namespace

TEST_CASE("each step equals Adam and AdamW computed in double, to 1e-6") {
  auto adam = cpu_adam("auto", 2);
  for (const Case& c : cases()) {
    for (std::size_t n :
         {std::size_t{1}, std::size_t{17}, std::size_t{1000}, std::size_t{200003}}) {
      INFO(std::string(c.name) << ", " << n << " elements, " << adam->implementation());
      Shard s(n, 7);
      for (std::uint64_t t = 1; t <= 4; ++t) {
        s.new_grads(100 + t);
        const Expected e = reference_step(s, c.hyper, t);
        s.step(*adam, c.hyper, t);
        check_close(s.params, e.params, e.params_scale, "params");
        check_close(s.exp_avg, e.exp_avg, e.exp_avg_scale, "exp_avg");
        check_close(s.exp_avg_sq, e.exp_avg_sq, e.exp_avg_sq_scale, "exp_avg_sq");
      }
    }
  }
}

TEST_CASE("every instruction set gives the scalar kernel's bits, whatever the tail") {
  const auto simd = available_simd();
  REQUIRE(simd.front() == "scalar");
  const std::string compared = simd.size() == 1   ? "none"
                               : simd.size() == 2 ? "avx2"
                                                  : "avx2, avx512";
  MESSAGE("instruction sets compared with the scalar kernel: " << compared);
  if (simd.size() < 3)
    MESSAGE("this CPU lacks " << (simd.size() == 1 ? "avx2 and avx512" : "avx512")
                              << ": that kernel is not exercised here");
  auto scalar = cpu_adam("scalar");
  for (std::size_t k = 1; k < simd.size(); ++k) {
    auto vector = cpu_adam(simd[k]);
    for (const Case& c : cases())
      for (std::size_t n : kSizes) {
        INFO(simd[k] << ", " << std::string(c.name) << ", " << n << " elements");
        Shard a(n, 11), b(n, 11);
        for (std::uint64_t t = 1; t <= 3; ++t) {
          a.new_grads(t);
          b.new_grads(t);
          a.step(*scalar, c.hyper, t);
          b.step(*vector, c.hyper, t);
        }
        CHECK(a == b);
      }
  }
}

namespace {

const OptimizerHyperParams kDecayed{.lr = 1e-3, .weight_decay = 0.01};

// `tested` leaves a shard of many chunks and a ragged last one as
// `reference` does, bit for bit, over 3 steps.
void check_same_bits(Optimizer& reference, Optimizer& tested, std::uint32_t seed) {
  const std::size_t n = 1'000'003;
  Shard a(n, seed), b(n, seed);
  for (std::uint64_t t = 1; t <= 3; ++t) {
    a.step(reference, kDecayed, t);
    b.step(tested, kDecayed, t);
  }
  CHECK(a == b);
}

// Four callers step their own shards on `tested` at the same time, as an
// offload engine steps parameter groups while others' gradients arrive;
// each shard ends as a lone caller on `reference` leaves it.
void check_concurrent_callers(Optimizer& reference, Optimizer& tested, std::uint32_t seed) {
  std::vector<Shard> alone, together;
  for (std::uint32_t k = 0; k < 4; ++k) {
    alone.emplace_back(300'000 + 17 * k, seed + k);
    together.emplace_back(300'000 + 17 * k, seed + k);
  }
  for (auto& s : alone)
    for (std::uint64_t t = 1; t <= 5; ++t) s.step(reference, kDecayed, t);
  std::vector<std::thread> callers;
  for (auto& s : together)
    callers.emplace_back([&s, &tested] {
      for (std::uint64_t t = 1; t <= 5; ++t) s.step(tested, kDecayed, t);
    });
  for (auto& c : callers) c.join();
  for (std::size_t k = 0; k < alone.size(); ++k) CHECK(alone[k] == together[k]);
}

}  // namespace

TEST_CASE("one thread or several, one caller or several at once: the same bits") {
  auto one = cpu_adam("auto", 1);
  auto three = cpu_adam("auto", 3);
  CHECK(one->implementation().find("1 thread") != std::string::npos);
  CHECK(three->implementation().find("3 threads") != std::string::npos);
  check_same_bits(*one, *three, 3);
  check_concurrent_callers(*one, *three, 50);
}

TEST_CASE("on the OpenMP runtime the process has loaded: the pool's bits, from several callers") {
  // As torch does: an OpenMP runtime loaded before the optimizer is made
  // (Debian's libgomp; torch's wheel carries its own of the same soname).
  // It stays loaded for the rest of this process.
  void* gomp = dlopen("libgomp.so.1", RTLD_NOW | RTLD_GLOBAL);
  REQUIRE_MESSAGE(gomp != nullptr, "libgomp.so.1 (gcc's runtime) is not installed: " << dlerror());
  auto pool = cpu_adam("auto", 3, "pool");
  auto openmp = cpu_adam("auto", 3, "openmp");
  auto chosen = cpu_adam("auto", 2);
  CHECK(pool->implementation().ends_with("3 threads (own pool)"));
  CHECK(openmp->implementation().ends_with("3 threads (OpenMP: libgomp.so.1)"));
  CHECK(chosen->implementation().ends_with("(OpenMP: libgomp.so.1)"));
  check_same_bits(*pool, *openmp, 5);
  check_concurrent_callers(*pool, *openmp, 70);  // a team each
  // The optimizers hold their own reference to the runtime: with the
  // test's handle gone, they still step.
  CHECK(dlclose(gomp) == 0);
  check_same_bits(*pool, *openmp, 6);
}

namespace {

// CPU time (user + system, clock ticks) of each thread of this process.
std::map<std::string, long> cpu_ticks_by_thread() {
  std::map<std::string, long> ticks;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(task.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto end_of_name = stat.rfind(')');
    if (end_of_name == std::string::npos) continue;  // the thread ended
    std::istringstream fields(stat.substr(end_of_name + 2));
    std::string field;
    long utime = 0, stime = 0;
    for (int k = 0; k < 13 && fields >> field; ++k)
      if (k == 11)
        utime = std::stol(field);
      else if (k == 12)
        stime = std::stol(field);
    ticks[task.path().filename().string()] = utime + stime;
  }
  return ticks;
}

// How many threads did a real share of `work`'s CPU time (at least a
// quarter of the busiest one's): counted, not timed.
template <class Work>
int threads_that_worked(Work work) {
  const auto before = cpu_ticks_by_thread();
  work();
  std::vector<long> spent;
  for (const auto& [tid, ticks] : cpu_ticks_by_thread())
    spent.push_back(ticks - (before.count(tid) ? before.at(tid) : 0));
  const long busiest = *std::max_element(spent.begin(), spent.end());
  REQUIRE_MESSAGE(busiest >= 8, "the work took " << busiest << " ticks: too little to tell");
  return static_cast<int>(
      std::count_if(spent.begin(), spent.end(), [&](long t) { return 4 * t >= busiest; }));
}

}  // namespace

TEST_CASE("a step's own thread count wins over the parameter, with the same bits") {
  // As torch's intra-op count reaches the plugin through DuctileCPUAdam.
  auto three = cpu_adam("auto", 3, "pool");
  Shard given(4'000'037, 80), fixed(4'000'037, 80);
  CHECK(threads_that_worked([&] {
          for (std::uint64_t t = 1; t <= 40; ++t) given.step(*three, kDecayed, t, nullptr, 1);
        }) == 1);
  for (std::uint64_t t = 1; t <= 40; ++t) fixed.step(*three, kDecayed, t);
  CHECK(given == fixed);
}

namespace {

// Round to nearest even by comparing the two neighbours in double: a
// different method from the plugin's bit tricks.
std::uint16_t bf16_expected(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7FC0u);
  if (std::isinf(x)) return static_cast<std::uint16_t>(u >> 16);
  const std::uint32_t down = u & 0xFFFF0000u, up = down + 0x10000u;
  float fd, fu;
  std::memcpy(&fd, &down, 4);
  std::memcpy(&fu, &up, 4);
  // Past the largest finite value lies infinity, reached from 2^128 on.
  const double du_value = std::isinf(fu) ? std::copysign(std::ldexp(1.0, 128), x) : double(fu);
  const double dd = std::abs(double(x) - fd), du = std::abs(du_value - x);
  if (dd < du || (dd == du && ((down >> 16) & 1u) == 0))
    return static_cast<std::uint16_t>(down >> 16);
  return static_cast<std::uint16_t>(up >> 16);
}

// GCC's _Float16 conversion (libgcc's soft-float, round to nearest even).
std::uint16_t f16_expected(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if (std::isnan(x)) return static_cast<std::uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u);
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t out;
  std::memcpy(&out, &h, 2);
  return out;
}

std::vector<float> conversion_inputs() {
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           -1.0f,
                           65504.0f,
                           65519.99f,
                           65520.0f,
                           -65520.0f,
                           65536.0f,
                           1e6f,
                           3.4e38f,
                           -3.4e38f,
                           6.1035156e-05f,
                           6.0e-05f,
                           5.9604645e-08f,
                           2.9802322e-08f,
                           2.98023259e-08f,
                           1e-10f,
                           1e-40f,
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           -std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::signaling_NaN()};
  // Halfway cases of both formats, then random bit patterns.
  for (std::uint32_t mant : {0x8000u, 0x18000u, 0x1000u, 0x3000u, 0x7FFFu, 0x8001u})
    for (std::uint32_t exp : {100u, 103u, 112u, 113u, 127u, 140u, 142u}) {
      const std::uint32_t u = (exp << 23) | mant;
      float f;
      std::memcpy(&f, &u, 4);
      xs.push_back(f);
      xs.push_back(-f);
    }
  std::mt19937 rng(5);
  for (int i = 0; i < 300'000; ++i) {
    const std::uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    xs.push_back(f);
  }
  return xs;
}

}  // namespace

TEST_CASE("the bf16 and fp16 copy of the parameters rounds to nearest even, NaN stays NaN") {
  // No update (lr 0, zero gradients): the copy is the parameters rounded.
  const OptimizerHyperParams h{.lr = 0.0};
  const std::vector<float> xs = conversion_inputs();
  for (const auto& simd : available_simd()) {
    auto adam = cpu_adam(simd);
    for (HalfType type : {HalfType::bf16, HalfType::f16}) {
      INFO(simd << ", " << ductile::to_string(type));
      Shard s(xs.size(), 1);
      s.params = xs;
      std::fill(s.grads.begin(), s.grads.end(), 0.0f);
      s.step(*adam, h, 1, &type);
      std::size_t bad = 0, first = 0;
      for (std::size_t i = 0; i < xs.size(); ++i) {
        const std::uint16_t want =
            type == HalfType::bf16 ? bf16_expected(xs[i]) : f16_expected(xs[i]);
        if (s.copy[i] != want && bad++ == 0) first = i;
      }
      INFO(bad << " wrong; first: " << xs[first] << " gave " << s.copy[first]);
      CHECK(bad == 0);
      // The parameters are unchanged (a NaN is quieted by arithmetic).
      for (std::size_t i = 0; i < xs.size(); ++i)
        if (std::memcmp(&s.params[i], &xs[i], 4) != 0 &&
            !(std::isnan(s.params[i]) && std::isnan(xs[i])))
          FAIL("parameter " << i << " changed from " << xs[i] << " to " << s.params[i]);
    }
  }
}

TEST_CASE("the copy holds the updated parameters") {
  const OptimizerHyperParams h{.lr = 1e-2, .weight_decay = 0.1};
  auto adam = cpu_adam("auto", 2);
  HalfType type = HalfType::bf16;
  Shard s(100'003, 9);
  s.step(*adam, h, 1, &type);
  for (std::size_t i = 0; i < s.params.size(); ++i)
    if (s.copy[i] != bf16_expected(s.params[i])) FAIL("element " << i);
}
