#pragma once
// The entry points each CPU ISA translation unit exports (internal header).

#include <cstddef>

#include "q8_search.hpp"
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
//! step_q8's checks of its arguments (src/q8.cpp), shared with cuda_step_q8:
//! InvalidArgument naming what is wrong.
Status q8_validate(const Q8StepArgs& args);

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
