#pragma once
// The entry points each CPU ISA translation unit exports (internal header).

#include <cstddef>

#include "strata/common/assert.hpp"
#include "strata/kernels/exact_sum.hpp"
#include "strata/kernels/ops.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::kernels::cpu {

//! Partial sums and the Inf/NaN flag of one piece.
struct PieceResult {
  double a = 0.0;
  double b = 0.0;
  bool nonfinite = false;
  //! Passes that sum squares (sums_exactly): the exact sums of the piece's groups; a and b stay 0.
  ExactSum ea;
  ExactSum eb;
};

//! Passes whose sums are norms, summed in groups and exactly (Note [Exact norms]).
inline bool sums_exactly(Pass pass) {
  return pass == Pass::kGradStats || pass == Pass::kTrustPhase1;
}

//! Runs `pass` over [begin, end) of s. begin + s.group_phase is a multiple of kPieceElems, or begin is 0.
using PieceFn = PieceResult (*)(Pass pass, const Hyper& h, const Span& s, std::size_t begin, std::size_t end,
                                const PassArgs& pa);

PieceResult run_piece_scalar(Pass, const Hyper&, const Span&, std::size_t, std::size_t, const PassArgs&);
PieceResult run_piece_avx2(Pass, const Hyper&, const Span&, std::size_t, std::size_t, const PassArgs&);
PieceResult run_piece_avx512(Pass, const Hyper&, const Span&, std::size_t, std::size_t, const PassArgs&);

//! The piece function of an Isa (the one factory of Note [ISA translation units]).
PieceFn piece_fn(Isa isa);

// Note [Q8 nearest-code search]
// code(x) = #{k < 255 : t[k] < x} over the sorted midpoints t (Note [Q8 step]
// in q8.hpp). An 8-step binary search held AVX2 q8 AdamW to 50 Mparams/s on one
// EPYC (Zen) core, as gathers or as scalar loads (8 dependent loads a lane;
// the scalar kernel branch-free: 42). Instead a bucket of x's float bits gives
// lo = code(the bucket's least value) from a byte table, and code(x) = lo + the
// number of t[lo .. lo + extra) below x, where extra bounds the thresholds
// inside one bucket (1 with 2^7 buckets per octave). Buckets: |x| clamped to
// [2^-24, 2] (no threshold lies below 2^-24), (|x| bits - bits(2^-24)) >> 16,
// mirrored for negative x so the bucket grows with x: monotone, so lo and
// extra are exact bounds, computed at build from each bucket's end values. The
// same integer ops and compares on every ISA. A NaN x (only from a state that
// overflowed to Inf) lands in the outermost bucket. AVX2 q8 AdamW: 237 Mparams/s
// on the same core (fp32 AdamW 927; the rest is mostly the gathers: 2 to
// dequantize, 2 + 2 x extra to quantize per 8 elements).
inline constexpr std::uint32_t kQ8BucketShift = 16;    // 23 - 7 mantissa bits
inline constexpr std::uint32_t kQ8MagLo = 103u << 23;  // bits of 2^-24
inline constexpr std::uint32_t kQ8MagHi = 128u << 23;  // bits of 2.0
inline constexpr std::uint32_t kQ8Buckets = ((kQ8MagHi - kQ8MagLo) >> kQ8BucketShift) + 1;  // per sign
inline constexpr std::uint32_t kQ8ExtraMax = 8;

//! One map's search tables.
struct Q8Search {
  //! thresholds[k] = (map[k] + map[k+1]) / 2 for k < 255; +inf after.
  alignas(64) float thresholds[256 + kQ8ExtraMax];
  //! lo per bucket (2 * kQ8Buckets), then 3 bytes so a 32-bit gather at the last one stays inside.
  alignas(64) std::uint8_t lo[2 * kQ8Buckets + 3];
  std::uint32_t extra;  //!< thresholds to compare after lo (<= kQ8ExtraMax)
};

//! The bucket of x (Note [Q8 nearest-code search]): kQ8Buckets + m for x >= +0,
//! kQ8Buckets - 1 - m for x <= -0, where m = (clamp(|x| bits) - kQ8MagLo) >> shift.
inline std::uint32_t q8_bucket(std::uint32_t bits) {
  std::uint32_t a = bits & 0x7fffffffu;
  a = a < kQ8MagLo ? kQ8MagLo : (a > kQ8MagHi ? kQ8MagHi : a);
  const std::uint32_t m = (a - kQ8MagLo) >> kQ8BucketShift;
  const std::uint32_t neg = 0u - (bits >> 31);
  return kQ8Buckets + (m ^ neg);
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

//! The tables, built on first use. Thread-safe.
const Q8Tables& q8_tables();

//! Runs q8 Adam over blocks [begin, end) of s; begin is a multiple of
//! kQ8BlockElems. Returns true when some gradient was Inf/NaN (the block was still written).
using Q8PieceFn = bool (*)(const Q8Span& s, std::size_t begin, std::size_t end, const AdamCoeffs& c,
                           float grad_scale, const Q8Tables& tab);

bool q8_piece_scalar(const Q8Span&, std::size_t, std::size_t, const AdamCoeffs&, float, const Q8Tables&);
bool q8_piece_avx2(const Q8Span&, std::size_t, std::size_t, const AdamCoeffs&, float, const Q8Tables&);
bool q8_piece_avx512(const Q8Span&, std::size_t, std::size_t, const AdamCoeffs&, float, const Q8Tables&);

//! The q8 piece function of an Isa.
Q8PieceFn q8_piece_fn(Isa isa);

}  // namespace strata::kernels::cpu
