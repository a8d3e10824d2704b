#pragma once
// LARS (You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional
// Networks", Alg. 1) with momentum, as NVIDIA's LARC wraps SGD:
//   trust = eta ||p|| / (||g|| + wd ||p|| + eps)   per tensor (1 when a norm is 0)
//   clip mode (LARC "clip"): trust = min(trust / lr, 1)
//   d = trust (g + wd p) ;  buf = mu buf + d (buf = d on the first step) ;  p = p - lr buf
// Phase 1 only reads (the two norms); see Note [Two-phase trust ratio] in lamb.hpp.

#include <cmath>
#include <cstdint>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/hyper.hpp"

namespace strata::kernels {

//! Per-step constants of LARS (the per-tensor trust ratio comes separately).
struct LarsCoeffs {
  float lr, momentum, weight_decay;
  bool first;  //!< step 1: the buffer starts as d
};

inline LarsCoeffs lars_coeffs(const Hyper& h, std::int64_t t) {
  return LarsCoeffs{h.lr, h.momentum, h.weight_decay, t == 1};
}

//! Trust ratio of a tensor from its squared norms.
inline float lars_trust_ratio(const Hyper& h, double param_sq, double grad_sq) {
  if (!(param_sq > 0.0) || !(grad_sq > 0.0)) return 1.0f;
  const double pn = std::sqrt(param_sq);
  double trust =
      double{h.trust_coefficient} * pn / (std::sqrt(grad_sq) + double{h.weight_decay} * pn + h.eps);
  if (h.lars_clip) trust = std::fmin(trust / double{h.lr}, 1.0);
  return static_cast<float>(trust);
}

//! Phase 2 with momentum buffer.
template <typename T>
STRATA_HD inline void lars_rule(T& p, T& buf, T g, float trust, const LarsCoeffs& c) {
  const T d = T(trust) * madd(T(c.weight_decay), p, g);
  if (c.first) {
    buf = d;
  } else {
    buf = madd(T(c.momentum), buf, d);
  }
  p = p - T(c.lr) * buf;
}

//! Phase 2 without momentum (momentum == 0: no state).
template <typename T>
STRATA_HD inline void lars_rule_plain(T& p, T g, float trust, const LarsCoeffs& c) {
  p = p - T(c.lr * trust) * madd(T(c.weight_decay), p, g);
}

}  // namespace strata::kernels
