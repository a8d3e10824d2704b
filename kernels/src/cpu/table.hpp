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

//! The q8 maps with their nearest-code thresholds (Note [Q8 step] in q8.hpp),
//! built once (src/q8.cpp). thresholds[k] = (map[k] + map[k+1]) / 2 for k < 255;
//! [255] is +inf, never read by the search.
struct Q8Tables {
  alignas(64) float signed_map[256];
  alignas(64) float unsigned_map[256];
  alignas(64) float signed_thresholds[256];
  alignas(64) float unsigned_thresholds[256];
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
