// The memory-only kernel over 8 lanes, built with the flags of kernels'
// kernels_avx2.cpp (Note [Memory-only roofline]); run only when CPUID says so.
#include <immintrin.h>

#include "roofline/mem_kernel.hpp"
#include "roofline/mem_kernel_fns.hpp"

namespace strata::bench {
namespace {

struct Avx2 {
  using V = __m256i;
  static constexpr std::size_t kWidth = 8;
  static V zero() { return _mm256_setzero_si256(); }
  static V set1(std::uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static V load4(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static V load2(const void* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static void store4(void* p, V x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
  // Lanes hold values below 2^16 here; the same pack + permute as kernels' bf16 store.
  static void store2(void* p, V x) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0xD8);
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static V load1(const void* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  }
  // Lanes hold values below 2^8 here; the q8 kernel's pack of codes.
  static void store1(void* p, V x) {
    const __m128i w16 = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(static_cast<__m128i*>(p), _mm_packus_epi16(w16, w16));
  }
  static std::uint32_t low(V a) { return static_cast<std::uint32_t>(_mm256_cvtsi256_si32(a)); }
  static V add(V a, V b) { return _mm256_add_epi32(a, b); }
  static V and_(V a, V b) { return _mm256_and_si256(a, b); }
  static V shr16(V a) { return _mm256_srli_epi32(a, 16); }
  static std::uint64_t hsum(V a) { return hsum_lanes(a); }
};

}  // namespace

namespace roofline {

bool mem_piece_avx2(const MemPass& m, MemVariant variant, std::size_t begin, std::size_t end,
                    std::uint32_t zero, std::uint64_t* sink) {
  return mem_piece<Avx2, Scalar>(m, variant, begin, end, zero, sink);
}

void triad_piece_avx2(float* a, const float* b, const float* c, float s, std::size_t begin, std::size_t end) {
  triad_loop(a, b, c, s, begin, end);
}

}  // namespace roofline
}  // namespace strata::bench
