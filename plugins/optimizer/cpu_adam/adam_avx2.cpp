// The AVX2 kernel (with FMA and F16C), 8 floats at a time. Compiled with
// -mavx2 -mfma -mf16c; called only on a CPU that has all three.
#include <immintrin.h>

#include "adam_body.hpp"

namespace ductile::cpu_adam {
namespace {

struct Avx2Ops {
  using F = __m256;
  static constexpr std::size_t width = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F set(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // NaN lanes become the quiet NaN of their sign (see quiet_nan_of).
  static F quiet_nans(F x) {
    const F nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    const F quiet = _mm256_or_ps(_mm256_and_ps(x, _mm256_set1_ps(-0.0f)),
                                 _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)));
    return _mm256_blendv_ps(x, quiet, nan);
  }
  static void store_bf16(std::uint16_t* p, F x) {
    const __m256i u = _mm256_castps_si256(quiet_nans(x));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static void store_f16(std::uint16_t* p, F x) {
    const __m128i h = _mm256_cvtps_ph(quiet_nans(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
};

}  // namespace

void adam_avx2(const AdamConstants& c, const AdamRange& r) {
  adam_range<Avx2Ops>(c, r);
}

}  // namespace ductile::cpu_adam
