#pragma once
// The q8 nearest-code search's constants and tables (internal header), shared
// by the CPU kernels (cpu/table.hpp) and the CUDA kernel (cuda/cuda_q8.cu):
// plain types and STRATA_HD functions only, so nvcc compiles it.

#include <cstdint>

#include "strata/common/half.hpp"  // STRATA_HD

namespace strata::kernels::cpu {

// Note [Q8 nearest-code search]
// code(x) = #{k < 255 : t[k] < x} over the sorted midpoints t (Note [Q8 step]
// in q8.hpp). An 8-step binary search held AVX2 q8 AdamW to 50 Mparams/s on one
// EPYC (Zen) core (8 dependent loads a lane). Instead a bucket of x's float
// bits indexes one 32-bit entry: the code of the bucket's least value (lo, bits
// 16..23) and the key of the one threshold inside the bucket (bits 0..15), and
// code(x) = lo + (key(t) < key(x)). Buckets: |x| clamped to [2^-24, 2] (no
// threshold lies below 2^-24), m = (|x| bits - bits(2^-24)) >> 16, mirrored for
// negative x so the bucket grows with x: monotone, so lo is exact, computed at
// build from each bucket's end values. x and the threshold inside its bucket
// share every bit above bit 16, so t < x compares their low 16 bits: key = the
// low 16 bits of |x| for x >= +0, their complement for x <= -0 (there t < x iff
// |t| > |x|). A bucket without a threshold holds key 0xffff, never below a
// key(x). 2^7 buckets an octave leave at most one threshold per bucket in both
// maps (checked at build: make_search); 2^6 would put two in one of the
// unsigned map's. The same integer ops and compare on every ISA. A NaN x (only
// from a state that overflowed to Inf) lands in an outermost bucket, whose lo
// is 255 (+NaN) or 0 (-NaN).
//
inline constexpr std::uint32_t kQ8BucketShift = 16;    // 23 - 7 mantissa bits
inline constexpr std::uint32_t kQ8MagLo = 103u << 23;  // bits of 2^-24
inline constexpr std::uint32_t kQ8MagHi = 128u << 23;  // bits of 2.0
inline constexpr std::uint32_t kQ8Buckets = ((kQ8MagHi - kQ8MagLo) >> kQ8BucketShift) + 1;  // per sign
inline constexpr std::uint32_t kQ8KeyMask = (1u << kQ8BucketShift) - 1;

//! One map's search tables.
struct Q8Search {
  //! thresholds[k] = (map[k] + map[k+1]) / 2 for k < 255 (what entry encodes).
  alignas(64) float thresholds[255];
  //! Per bucket (2 * kQ8Buckets): lo << 16 | key of the threshold inside, or 0xffff.
  alignas(64) std::uint32_t entry[2 * kQ8Buckets];
  std::uint32_t extra;  //!< most thresholds in one bucket (1: Note [Q8 nearest-code search])
};

//! The bucket of x (Note [Q8 nearest-code search]): kQ8Buckets + m for x >= +0,
//! kQ8Buckets - 1 - m for x <= -0, where m = (clamp(|x| bits) - kQ8MagLo) >> shift.
STRATA_HD inline std::uint32_t q8_bucket(std::uint32_t bits) {
  std::uint32_t a = bits & 0x7fffffffu;
  a = a < kQ8MagLo ? kQ8MagLo : (a > kQ8MagHi ? kQ8MagHi : a);
  const std::uint32_t m = (a - kQ8MagLo) >> kQ8BucketShift;
  const std::uint32_t neg = 0u - (bits >> 31);
  return kQ8Buckets + (m ^ neg);
}

//! The key of x inside its bucket: the low bits of clamped |x|, complemented for x <= -0.
STRATA_HD inline std::uint32_t q8_key(std::uint32_t bits) {
  std::uint32_t a = bits & 0x7fffffffu;
  a = a < kQ8MagLo ? kQ8MagLo : (a > kQ8MagHi ? kQ8MagHi : a);
  const std::uint32_t neg = 0u - (bits >> 31);
  return (a ^ neg) & kQ8KeyMask;
}

//! The q8 maps and their searches, built once (src/q8.cpp).
struct Q8Tables {
  alignas(64) float signed_map[256];
  alignas(64) float unsigned_map[256];
  Q8Search signed_search;
  Q8Search unsigned_search;
  std::uint8_t signed_zero;    //!< code of 0.0 in signed_map
  std::uint8_t unsigned_zero;  //!< code of 0.0 in unsigned_map
};

}  // namespace strata::kernels::cpu
