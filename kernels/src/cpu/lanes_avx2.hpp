#pragma once
// AVX2 + FMA + F16C kernels: the ops over 8-lane vectors. Built with
// -mavx2 -mfma -mf16c (kernels/CMakeLists.txt); run only when CPUID says so.
// The lane type and its Lanes<>, shared by kernels_avx2.cpp and q8_avx2.cpp: include
// only from a translation unit built with these flags (Note [ISA translation units]).
#include <immintrin.h>

#include "strata/kernels/lanes.hpp"

namespace strata::kernels {
namespace {

//! 8 floats; converts implicitly from a float (broadcast) so rules can mix them.
struct V8 {
  __m256 v;
  V8() = default;
  V8(float x) : v(_mm256_set1_ps(x)) {}  // NOLINT: broadcast by design
  explicit V8(__m256 x) : v(x) {}
  friend V8 operator+(V8 a, V8 b) { return V8(_mm256_add_ps(a.v, b.v)); }
  friend V8 operator-(V8 a, V8 b) { return V8(_mm256_sub_ps(a.v, b.v)); }
  friend V8 operator*(V8 a, V8 b) { return V8(_mm256_mul_ps(a.v, b.v)); }
  friend V8 operator/(V8 a, V8 b) { return V8(_mm256_div_ps(a.v, b.v)); }
};

inline V8 madd(V8 a, V8 b, V8 c) {
  return V8(_mm256_fmadd_ps(a.v, b.v, c.v));
}
inline V8 vsqrt(V8 x) {
  return V8(_mm256_sqrt_ps(x.v));
}
inline V8 vmax(V8 a, V8 b) {
  return V8(_mm256_max_ps(a.v, b.v));
}
inline V8 vmin(V8 a, V8 b) {
  return V8(_mm256_min_ps(a.v, b.v));
}
inline V8 vsign(V8 x) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 pos = _mm256_and_ps(_mm256_cmp_ps(x.v, zero, _CMP_GT_OQ), one);
  const __m256 neg = _mm256_and_ps(_mm256_cmp_ps(x.v, zero, _CMP_LT_OQ), one);
  return V8(_mm256_sub_ps(pos, neg));
}

}  // namespace

template <>
struct Lanes<V8> {
  static constexpr std::size_t kWidth = 8;
  static V8 load_f32(const float* p) { return V8(_mm256_loadu_ps(p)); }
  static V8 load_bf16(const std::uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return V8(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  static V8 load_f16(const std::uint16_t* p) {
    return V8(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store_f32(float* p, V8 x) { _mm256_storeu_ps(p, x.v); }
  // Round to nearest even as float_to_bf16 (Note [Rounding to half precision]).
  static void store_bf16(std::uint16_t* p, V8 x) {
    const __m256i bits = _mm256_castps_si256(x.v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256 nan = _mm256_cmp_ps(x.v, x.v, _CMP_UNORD_Q);
    const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(quiet), nan));
    r = _mm256_srli_epi32(r, 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store_f16(std::uint16_t* p, V8 x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x.v, _MM_FROUND_TO_NEAREST_INT));
  }
  //! Lanes summed in lane order (fixed, for determinism).
  static float hsum(V8 x) {
    alignas(32) float l[8];
    _mm256_store_ps(l, x.v);
    float s = 0.0f;
    for (float f : l) s += f;
    return s;
  }
  //! Lanes summed as a fixed tree (halves, then quarters...): a short
  //! dependency chain for the per-group norm sums (Note [Exact norms]).
  static float hsum_tree(V8 x) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(x.v), _mm256_extractf128_ps(x.v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
};

}  // namespace strata::kernels
