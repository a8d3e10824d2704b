#pragma once
// AVX-512 (F/BW/DQ/VL) kernels: the ops over 16-lane vectors. Built with
// -mavx512f -mavx512bw -mavx512dq -mavx512vl -mfma -mf16c; run only when CPUID says so.
// bf16 goes through integer RNE, not AVX512_BF16, so Skylake-X runs it too.
// The lane type and its Lanes<>, shared by kernels_avx512.cpp and q8_avx512.cpp: include
// only from a translation unit built with these flags (Note [ISA translation units]).
#include <immintrin.h>

#include "strata/kernels/lanes.hpp"

namespace strata::kernels {
namespace {

//! 16 floats; converts implicitly from a float (broadcast).
struct V16 {
  __m512 v;
  V16() = default;
  V16(float x) : v(_mm512_set1_ps(x)) {}  // NOLINT: broadcast by design
  explicit V16(__m512 x) : v(x) {}
  friend V16 operator+(V16 a, V16 b) { return V16(_mm512_add_ps(a.v, b.v)); }
  friend V16 operator-(V16 a, V16 b) { return V16(_mm512_sub_ps(a.v, b.v)); }
  friend V16 operator*(V16 a, V16 b) { return V16(_mm512_mul_ps(a.v, b.v)); }
  friend V16 operator/(V16 a, V16 b) { return V16(_mm512_div_ps(a.v, b.v)); }
};

inline V16 madd(V16 a, V16 b, V16 c) {
  return V16(_mm512_fmadd_ps(a.v, b.v, c.v));
}
inline V16 vsqrt(V16 x) {
  return V16(_mm512_sqrt_ps(x.v));
}
inline V16 vmax(V16 a, V16 b) {
  return V16(_mm512_max_ps(a.v, b.v));
}
inline V16 vmin(V16 a, V16 b) {
  return V16(_mm512_min_ps(a.v, b.v));
}
inline V16 vsign(V16 x) {
  const __m512 zero = _mm512_setzero_ps();
  const __mmask16 pos = _mm512_cmp_ps_mask(x.v, zero, _CMP_GT_OQ);
  const __mmask16 neg = _mm512_cmp_ps_mask(x.v, zero, _CMP_LT_OQ);
  __m512 r = _mm512_mask_blend_ps(pos, zero, _mm512_set1_ps(1.0f));
  return V16(_mm512_mask_blend_ps(neg, r, _mm512_set1_ps(-1.0f)));
}

}  // namespace

template <>
struct Lanes<V16> {
  static constexpr std::size_t kWidth = 16;
  static V16 load_f32(const float* p) { return V16(_mm512_loadu_ps(p)); }
  static V16 load_bf16(const std::uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return V16(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
  static V16 load_f16(const std::uint16_t* p) {
    return V16(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
  }
  static void store_f32(float* p, V16 x) { _mm512_storeu_ps(p, x.v); }
  static void store_bf16(std::uint16_t* p, V16 x) {
    const __m512i bits = _mm512_castps_si512(x.v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, bits, _mm512_set1_epi32(0x400000));
    r = _mm512_srli_epi32(r, 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static void store_f16(std::uint16_t* p, V16 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
  }
  static float hsum(V16 x) {
    alignas(64) float l[16];
    _mm512_store_ps(l, x.v);
    float s = 0.0f;
    for (float f : l) s += f;
    return s;
  }
  //! Lanes summed as a fixed tree (halves, then quarters...): a short
  //! dependency chain for the per-group norm sums (Note [Exact norms]).
  static float hsum_tree(V16 x) {
    const __m256 lo = _mm512_castps512_ps256(x.v);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x.v), 1));
    return hsum_tree8(_mm256_add_ps(lo, hi));
  }
  static float hsum_tree8(__m256 x) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};

}  // namespace strata::kernels
