// The q8 Adam kernel on 8-lane AVX2 vectors (Note [Q8 step] in q8.hpp). Its
// own translation unit, built with the AVX2 flags and -ffp-contract=off: GCC
// implements the intrinsics as vector-extension arithmetic and would contract a
// multiply and an add into an FMA, breaking the agreement with the scalar kernel.
#include <cstring>

#include "cpu/lanes_avx2.hpp"
#include "cpu/q8_driver.hpp"

namespace strata::kernels {
namespace {

//! V8 with an unfused madd: the q8 kernel's lane type.
struct V8q {
  __m256 v;
  V8q() = default;
  V8q(float x) : v(_mm256_set1_ps(x)) {}  // NOLINT: broadcast by design
  explicit V8q(__m256 x) : v(x) {}
  friend V8q operator+(V8q a, V8q b) { return V8q(_mm256_add_ps(a.v, b.v)); }
  friend V8q operator-(V8q a, V8q b) { return V8q(_mm256_sub_ps(a.v, b.v)); }
  friend V8q operator*(V8q a, V8q b) { return V8q(_mm256_mul_ps(a.v, b.v)); }
  friend V8q operator/(V8q a, V8q b) { return V8q(_mm256_div_ps(a.v, b.v)); }
};

inline V8q madd(V8q a, V8q b, V8q c) {
  return a * b + c;
}
inline V8q vsqrt(V8q x) {
  return V8q(_mm256_sqrt_ps(x.v));
}
inline V8q vmax(V8q a, V8q b) {
  return V8q(_mm256_max_ps(a.v, b.v));
}

}  // namespace

//! V8q reads and writes as V8.
template <>
struct Lanes<V8q> {
  static constexpr std::size_t kWidth = 8;
  static V8q load_f32(const float* p) { return V8q(Lanes<V8>::load_f32(p).v); }
  static V8q load_bf16(const std::uint16_t* p) { return V8q(Lanes<V8>::load_bf16(p).v); }
  static V8q load_f16(const std::uint16_t* p) { return V8q(Lanes<V8>::load_f16(p).v); }
  static void store_f32(float* p, V8q x) { Lanes<V8>::store_f32(p, V8(x.v)); }
  static void store_bf16(std::uint16_t* p, V8q x) { Lanes<V8>::store_bf16(p, V8(x.v)); }
  static void store_f16(std::uint16_t* p, V8q x) { Lanes<V8>::store_f16(p, V8(x.v)); }
  static float hsum(V8q x) { return Lanes<V8>::hsum(V8(x.v)); }
};

namespace cpu {

template <>
struct Q8Lanes<V8q> {
  //! map[codes[0..8)], from scalar loads (Note [Q8 lookups on AMD]).
  static V8q gather(const float* map, const std::uint8_t* codes) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, codes, 4);
    std::memcpy(&hi, codes + 4, 4);
    const __m128 a = _mm_setr_ps(map[lo & 255], map[(lo >> 8) & 255], map[(lo >> 16) & 255], map[lo >> 24]);
    const __m128 b = _mm_setr_ps(map[hi & 255], map[(hi >> 8) & 255], map[(hi >> 16) & 255], map[hi >> 24]);
    return V8q(_mm256_set_m128(b, a));
  }
  //! Clamped |x| bits (Note [Q8 nearest-code search]).
  static __m256i clamped_abs(__m256i bits) {
    const __m256i a = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    return _mm256_max_epu32(_mm256_min_epu32(a, _mm256_set1_epi32(int(kQ8MagHi))),
                            _mm256_set1_epi32(int(kQ8MagLo)));
  }
  //! Q8Lanes<float>::bucket on 8 lanes, stored as 16 bits each.
  static void bucket(V8q x, std::uint16_t* b) {
    const __m256i bits = _mm256_castps_si256(x.v);
    const __m256i m = _mm256_srli_epi32(_mm256_sub_epi32(clamped_abs(bits), _mm256_set1_epi32(int(kQ8MagLo))),
                                        kQ8BucketShift);
    const __m256i neg = _mm256_srai_epi32(bits, 31);
    const __m256i bk = _mm256_add_epi32(_mm256_set1_epi32(int(kQ8Buckets)), _mm256_xor_si256(m, neg));
    _mm_store_si128(reinterpret_cast<__m128i*>(b),
                    _mm_packus_epi32(_mm256_castsi256_si128(bk), _mm256_extracti128_si256(bk, 1)));
  }
  //! Q8Lanes<float>::quantize on 8 lanes: the same integer ops and compare; the
  //! entries from scalar loads at 16-bit indices in memory (Note [Q8 lookups on AMD]).
  static void quantize(const Q8Search& s, V8q x, const std::uint16_t* b, std::uint8_t* out) {
    std::uint64_t lo, hi;
    std::memcpy(&lo, b, 8);
    std::memcpy(&hi, b + 4, 8);
    const std::uint32_t* t = s.entry;
    const __m256i e = _mm256_setr_epi32(
        int(t[lo & 0xffff]), int(t[(lo >> 16) & 0xffff]), int(t[(lo >> 32) & 0xffff]), int(t[lo >> 48]),
        int(t[hi & 0xffff]), int(t[(hi >> 16) & 0xffff]), int(t[(hi >> 32) & 0xffff]), int(t[hi >> 48]));
    const __m256i bits = _mm256_castps_si256(x.v);
    const __m256i mask = _mm256_set1_epi32(int(kQ8KeyMask));
    const __m256i key =
        _mm256_and_si256(_mm256_xor_si256(clamped_abs(bits), _mm256_srai_epi32(bits, 31)), mask);
    // Keys are below 2^16, so the signed compare is the unsigned one; true is -1.
    const __m256i c =
        _mm256_sub_epi32(_mm256_srli_epi32(e, 16), _mm256_cmpgt_epi32(key, _mm256_and_si256(e, mask)));
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(w16, w16));
  }
  static V8q abs(V8q x) { return V8q(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), x.v)); }
  //! Max is exact: any order gives the same value.
  static float hmax(V8q x) {
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(x.v), _mm256_extractf128_ps(x.v, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
  }
};

bool q8_piece_avx2(const Q8Span& s, std::size_t begin, std::size_t end, const AdamCoeffs& c, float grad_scale,
                   const Q8Tables& tab) {
  return q8_piece_with<V8q>(s, begin, end, c, grad_scale, tab);
}

}  // namespace cpu
}  // namespace strata::kernels
