// The memory-only kernel over 16 lanes, built with the flags of kernels'
// kernels_avx512.cpp (Note [Memory-only roofline]); run only when CPUID says so.
#include <immintrin.h>

#include "roofline/mem_kernel.hpp"
#include "roofline/mem_kernel_fns.hpp"

namespace strata::bench {
namespace {

struct Avx512 {
  using V = __m512i;
  static constexpr std::size_t kWidth = 16;
  static V zero() { return _mm512_setzero_si512(); }
  static V set1(std::uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static V load4(const void* p) { return _mm512_loadu_si512(p); }
  static V load2(const void* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  static void store4(void* p, V x) { _mm512_storeu_si512(p, x); }
  static void store2(void* p, V x) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
  }
  static V load1(const void* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static void store1(void* p, V x) { _mm_storeu_si128(static_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static std::uint32_t low(V a) { return static_cast<std::uint32_t>(_mm512_cvtsi512_si32(a)); }
  static V add(V a, V b) { return _mm512_add_epi32(a, b); }
  static V and_(V a, V b) { return _mm512_and_si512(a, b); }
  static V shr16(V a) { return _mm512_srli_epi32(a, 16); }
  static std::uint64_t hsum(V a) { return hsum_lanes(a); }
};

}  // namespace

namespace roofline {

bool mem_piece_avx512(const MemPass& m, MemVariant variant, std::size_t begin, std::size_t end,
                      std::uint32_t zero, std::uint64_t* sink) {
  return mem_piece<Avx512, Scalar>(m, variant, begin, end, zero, sink);
}

void triad_piece_avx512(float* a, const float* b, const float* c, float s, std::size_t begin,
                        std::size_t end) {
  triad_loop(a, b, c, s, begin, end);
}

}  // namespace roofline
}  // namespace strata::bench
