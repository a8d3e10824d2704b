// The q8 Adam kernel on 16-lane AVX-512 vectors (Note [Q8 step] in q8.hpp),
// built with the AVX-512 flags and -ffp-contract=off (see q8_avx2.cpp).
#include "cpu/lanes_avx512.hpp"
#include "cpu/q8_driver.hpp"

namespace strata::kernels {
namespace {

//! V16 with an unfused madd: the q8 kernel's lane type.
struct V16q {
  __m512 v;
  V16q() = default;
  V16q(float x) : v(_mm512_set1_ps(x)) {}  // NOLINT: broadcast by design
  explicit V16q(__m512 x) : v(x) {}
  friend V16q operator+(V16q a, V16q b) { return V16q(_mm512_add_ps(a.v, b.v)); }
  friend V16q operator-(V16q a, V16q b) { return V16q(_mm512_sub_ps(a.v, b.v)); }
  friend V16q operator*(V16q a, V16q b) { return V16q(_mm512_mul_ps(a.v, b.v)); }
  friend V16q operator/(V16q a, V16q b) { return V16q(_mm512_div_ps(a.v, b.v)); }
};

inline V16q madd(V16q a, V16q b, V16q c) {
  return a * b + c;
}
inline V16q vsqrt(V16q x) {
  return V16q(_mm512_sqrt_ps(x.v));
}
inline V16q vmax(V16q a, V16q b) {
  return V16q(_mm512_max_ps(a.v, b.v));
}

}  // namespace

//! V16q reads and writes as V16.
template <>
struct Lanes<V16q> {
  static constexpr std::size_t kWidth = 16;
  static V16q load_f32(const float* p) { return V16q(Lanes<V16>::load_f32(p).v); }
  static V16q load_bf16(const std::uint16_t* p) { return V16q(Lanes<V16>::load_bf16(p).v); }
  static V16q load_f16(const std::uint16_t* p) { return V16q(Lanes<V16>::load_f16(p).v); }
  static void store_f32(float* p, V16q x) { Lanes<V16>::store_f32(p, V16(x.v)); }
  static void store_bf16(std::uint16_t* p, V16q x) { Lanes<V16>::store_bf16(p, V16(x.v)); }
  static void store_f16(std::uint16_t* p, V16q x) { Lanes<V16>::store_f16(p, V16(x.v)); }
  static float hsum(V16q x) { return Lanes<V16>::hsum(V16(x.v)); }
};

namespace cpu {

template <>
struct Q8Lanes<V16q> {
  static V16q gather(const float* map, const std::uint8_t* codes) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    return V16q(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xFFFF, idx, map, 4));
  }
  //! Clamped |x| bits (Note [Q8 nearest-code search]).
  static __m512i clamped_abs(__m512i bits) {
    const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    return _mm512_max_epu32(_mm512_min_epu32(a, _mm512_set1_epi32(int(kQ8MagHi))),
                            _mm512_set1_epi32(int(kQ8MagLo)));
  }
  //! Q8Lanes<float>::bucket on 16 lanes, stored as 16 bits each.
  static void bucket(V16q x, std::uint16_t* b) {
    const __m512i bits = _mm512_castps_si512(x.v);
    const __m512i m = _mm512_srli_epi32(_mm512_sub_epi32(clamped_abs(bits), _mm512_set1_epi32(int(kQ8MagLo))),
                                        kQ8BucketShift);
    const __m512i neg = _mm512_srai_epi32(bits, 31);
    const __m512i bk = _mm512_add_epi32(_mm512_set1_epi32(int(kQ8Buckets)), _mm512_xor_si512(m, neg));
    _mm256_store_si256(reinterpret_cast<__m256i*>(b), _mm512_cvtepi32_epi16(bk));
  }
  //! Q8Lanes<float>::quantize on 16 lanes: the same integer ops and compare.
  static void quantize(const Q8Search& s, V16q x, const std::uint16_t* b, std::uint8_t* out) {
    const __m512i idx = _mm512_cvtepu16_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(b)));
    const __m512i e = _mm512_i32gather_epi32(idx, s.entry, 4);
    const __m512i bits = _mm512_castps_si512(x.v);
    const __m512i mask = _mm512_set1_epi32(int(kQ8KeyMask));
    const __m512i key =
        _mm512_and_si512(_mm512_xor_si512(clamped_abs(bits), _mm512_srai_epi32(bits, 31)), mask);
    const __mmask16 below = _mm512_cmplt_epu32_mask(_mm512_and_si512(e, mask), key);
    const __m512i lo = _mm512_srli_epi32(e, 16);
    const __m512i c = _mm512_mask_add_epi32(lo, below, lo, _mm512_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));
  }
  static V16q abs(V16q x) {
    return V16q(
        _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x.v), _mm512_set1_epi32(0x7fffffff))));
  }
  //! Max is exact: any order gives the same value.
  static float hmax(V16q x) {
    alignas(64) float l[16];
    _mm512_store_ps(l, x.v);
    float m = l[0];
    for (float f : l) m = f > m ? f : m;
    return m;
  }
};

bool q8_piece_avx512(const Q8Span& s, std::size_t begin, std::size_t end, const AdamCoeffs& c,
                     float grad_scale, const Q8Tables& tab) {
  return q8_piece_with<V16q>(s, begin, end, c, grad_scale, tab);
}

}  // namespace cpu
}  // namespace strata::kernels
