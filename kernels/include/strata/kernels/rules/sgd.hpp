#pragma once
// SGD as torch.optim.SGD (maximize = False):
//   d = g + wd p
//   momentum != 0: buf = d on the first step, else buf = mu buf + (1 - dampening) d
//                  d = nesterov ? d + mu buf : buf
//   p = p - lr d

#include <cstdint>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/hyper.hpp"

namespace strata::kernels {

//! Per-step constants of SGD.
struct SgdCoeffs {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov;
  bool first;  //!< step 1: the buffer starts as d
};

inline SgdCoeffs sgd_coeffs(const Hyper& h, std::int64_t t) {
  return SgdCoeffs{h.lr, h.momentum, 1.0f - h.dampening, h.weight_decay, h.nesterov, t == 1};
}

//! With a momentum buffer.
template <typename T>
STRATA_HD inline void sgd_momentum_rule(T& p, T& buf, T g, const SgdCoeffs& c) {
  T d = madd(T(c.weight_decay), p, g);
  if (c.first) {
    buf = d;
  } else {
    // torch's order (buf.mul_(mu).add_(d, alpha=1 - dampening)): mu buf is rounded on its own,
    // then (1 - dampening) d is added in one rounding; an FMA of mu buf would differ from torch
    // in the last bit wherever mu buf is inexact (mu = 0.9, say).
    buf = madd(T(c.one_minus_dampening), d, T(c.momentum) * buf);
  }
  d = c.nesterov ? madd(T(c.momentum), buf, d) : buf;
  p = p - T(c.lr) * d;
}

//! Without momentum (no state).
template <typename T>
STRATA_HD inline void sgd_rule(T& p, T g, const SgdCoeffs& c) {
  p = p - T(c.lr) * madd(T(c.weight_decay), p, g);
}

}  // namespace strata::kernels
