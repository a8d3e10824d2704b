#pragma once
// CAME (Luo et al. 2023, "CAME: Confidence-guided Adaptive Memory Efficient
// Optimization", Alg. 1, and its reference code). For a 2-D tensor (rows x cols)
// the second moment is factored into row and column statistics:
//   r = b2 r + (1 - b2) mean_cols(g^2 + eps1) ;  c = b2 c + (1 - b2) mean_rows(g^2 + eps1)
//   u = g * rsqrt(r_i / mean(r)) * rsqrt(c_j)
//   u = u / max(1, RMS(u) / d)
//   m = b1 m + (1 - b1) u
//   U = (u - m)^2 + eps2                                   (instability)
//   R = b3 R + (1 - b3) mean_cols(U) ;  C = b3 C + (1 - b3) mean_rows(U)
//   p = p (1 - lr wd) - lr m rsqrt(R_i / mean(R)) rsqrt(C_j)     (confidence-guided)
// A 1-D tensor keeps an unfactored v = b2 v + (1 - b2)(g^2 + eps1), u = g rsqrt(v),
// the same clip and m, and steps by m (the reference code has no confidence term there).
// CAME has no bias correction.
//
// Note [CAME passes]
// Row/column means and RMS(u) are reductions over the whole tensor that must
// finish before the next quantity exists, so a CAME step is four passes over
// the tensor (g^2 stats; RMS(u); m and U stats; the update), each reading the
// gradient again. It is the one optimizer strata does not run in one fused
// pass; its tensors are given whole (never split across spans).

#include "strata/kernels/hd.hpp"

namespace strata::kernels {

//! Reciprocal square root in the rules' precision.
template <typename T>
STRATA_HD inline T came_rsqrt(T x) {
  return T(1.0f) / vsqrt(x);
}

//! g^2 + eps1: the quantity whose row/column means feed r and c.
template <typename T>
STRATA_HD inline T came_sq(T g, float eps1) {
  return madd(g, g, T(eps1));
}

//! Momentum and instability from the clipped update u.
template <typename T>
STRATA_HD inline T came_momentum(T& m, T u, float beta1, float eps2) {
  m = madd(T(beta1), m, T(1.0f - beta1) * u);
  const T d = u - m;
  return madd(d, d, T(eps2));
}

//! The final parameter step given the confidence factor (1 for 1-D tensors).
template <typename T>
STRATA_HD inline void came_apply(T& p, T m, T confidence, float lr, float decay) {
  p = p * T(decay) - T(lr) * m * confidence;
}

}  // namespace strata::kernels
