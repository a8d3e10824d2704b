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
// Note [Q8 lookups on AMD]
// The kernel's cost is mostly its table lookups, four a parameter: two map
// entries to dequantize m and v, two search entries to quantize them. On this
// machine's EPYC (Zen 3, AVX2 only) an 8-lane vpgatherdd costs about 0.45 ns a
// lane, 8 scalar loads put into a vector with inserts about 0.25 ns a lane (a
// loop of each over a 64 KiB buffer), when the indices come from memory a few
// at a time: the codes as bytes (two 32-bit loads and shifts for 8), the
// buckets as 16 bits (kQ8Buckets * 2 < 2^16), written to a block buffer by a
// loop before the one that looks them up. Taking indices out of a vector with
// vpextrd costs more than the gather saves. The AVX2 kernel at 1 thread, 16 M
// params, CPU time: all four by gather 334 Mparams/s; dequantizing by scalar
// loads and quantizing by gather 414-427; all four by scalar loads (the
// buckets by vpextrd) 382; all four by scalar loads from 16-bit indices in
// memory (this code) 433-438, and 493 against 438 in cache. The AVX-512 kernel
// gathers: fast on the Intel cores that have AVX-512 (not measured here). Every
// way gives the same values.
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
inline std::uint32_t q8_bucket(std::uint32_t bits) {
  std::uint32_t a = bits & 0x7fffffffu;
  a = a < kQ8MagLo ? kQ8MagLo : (a > kQ8MagHi ? kQ8MagHi : a);
  const std::uint32_t m = (a - kQ8MagLo) >> kQ8BucketShift;
  const std::uint32_t neg = 0u - (bits >> 31);
  return kQ8Buckets + (m ^ neg);
}

//! The key of x inside its bucket: the low bits of clamped |x|, complemented for x <= -0.
inline std::uint32_t q8_key(std::uint32_t bits) {
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
