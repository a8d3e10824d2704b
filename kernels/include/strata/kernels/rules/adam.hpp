#pragma once
// Adam (L2 weight decay added to the gradient) and AdamW (decoupled decay),
// with bias correction, exactly as torch.optim.Adam / AdamW (non-amsgrad):
//   g' = g + l2 * p                       (Adam; l2 = 0 for AdamW)
//   m  = b1 m + (1 - b1) g'
//   v  = b2 v + (1 - b2) g'^2
//   p  = p (1 - lr wd) - (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)   (decay: AdamW only)

#include <cmath>
#include <cstdint>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/hyper.hpp"

namespace strata::kernels {

//! Per-step constants of the Adam rule, computed once on the host.
struct AdamCoeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;     //!< lr / (1 - beta1^t)
  float inv_sqrt_bc2;  //!< 1 / sqrt(1 - beta2^t)
  float eps;
  float l2;     //!< weight decay added to the gradient (Adam)
  float decay;  //!< 1 - lr * wd (AdamW), 1 for Adam
};

//! Coefficients for step t >= 1 (computed in double, rounded once).
inline AdamCoeffs adam_coeffs(const Hyper& h, std::int64_t t) {
  const double bc1 = 1.0 - std::pow(double{h.beta1}, double(t));
  const double bc2 = 1.0 - std::pow(double{h.beta2}, double(t));
  const bool decoupled = h.optimizer == Optimizer::kAdamW;
  return AdamCoeffs{h.beta1,
                    1.0f - h.beta1,
                    h.beta2,
                    1.0f - h.beta2,
                    static_cast<float>(h.lr / bc1),
                    static_cast<float>(1.0 / std::sqrt(bc2)),
                    h.eps,
                    decoupled ? 0.0f : h.weight_decay,
                    decoupled ? static_cast<float>(1.0 - double{h.lr} * h.weight_decay) : 1.0f};
}

//! One element (or W lanes): updates p, m, v in place from the scaled gradient g.
template <typename T>
STRATA_HD inline void adam_rule(T& p, T& m, T& v, T g, const AdamCoeffs& c) {
  g = madd(T(c.l2), p, g);
  m = madd(T(c.beta1), m, T(c.one_minus_beta1) * g);
  v = madd(T(c.beta2), v, T(c.one_minus_beta2) * g * g);
  const T denom = madd(vsqrt(v), T(c.inv_sqrt_bc2), T(c.eps));
  p = p * T(c.decay) - T(c.step_size) * m / denom;
}

}  // namespace strata::kernels
