// The AVX-512 kernel (AVX512F), 16 floats at a time. Compiled with
// -mavx512f -mfma -mf16c; called only on a CPU that has AVX512F.
#include <immintrin.h>

#include "adam_body.hpp"

namespace ductile::cpu_adam {
namespace {

// All lanes: the zero-masking forms of sqrt, shift and conversions below do
// what the plain ones do; GCC 12 warns that the plain ones' internal
// "undefined" source may be used uninitialized (a false positive).
constexpr __mmask16 kAll = 0xFFFF;

struct Avx512Ops {
  using F = __m512;
  static constexpr std::size_t width = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F set(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_maskz_sqrt_ps(kAll, a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // NaN lanes become the quiet NaN of their sign (see quiet_nan_of).
  static __m512i quiet_nans(F x) {
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i quiet = _mm512_or_si512(_mm512_and_si512(u, _mm512_set1_epi32(INT32_MIN)),
                                          _mm512_set1_epi32(0x7FC00000));
    return _mm512_mask_blend_epi32(nan, u, quiet);
  }
  static void store_bf16(std::uint16_t* p, F x) {
    const __m512i u = quiet_nans(x);
    const __m512i lsb =
        _mm512_and_si512(_mm512_maskz_srli_epi32(kAll, u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_maskz_srli_epi32(
        kAll, _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_maskz_cvtepi32_epi16(kAll, rounded));
  }
  static void store_f16(std::uint16_t* p, F x) {
    const __m256i h = _mm512_maskz_cvtps_ph(kAll, _mm512_castsi512_ps(quiet_nans(x)),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
};

}  // namespace

void adam_avx512(const AdamConstants& c, const AdamRange& r) {
  adam_range<Avx512Ops>(c, r);
}

}  // namespace ductile::cpu_adam
