#pragma once
// The entry points each CPU ISA translation unit exports (internal header).

#include <cstddef>

#include "strata/common/assert.hpp"
#include "strata/kernels/exact_sum.hpp"
#include "strata/kernels/ops.hpp"
#include "strata/kernels/optim.hpp"

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

}  // namespace strata::kernels::cpu
