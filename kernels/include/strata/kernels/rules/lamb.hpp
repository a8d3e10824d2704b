#pragma once
// LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning", Alg. 2),
// in NVIDIA's form (apex FusedLAMB / NVLAMB):
//   m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
//   u = (m / bc1) / (sqrt(v / bc2) + eps) + wd p          (bc = 1 without bias correction)
//   r = ||p|| / ||u||  per tensor (1 when either norm is 0)
//   p = p - lr r u
// The global grad-norm pre-normalisation of NVLAMB (g / max(1, ||g||/max_norm))
// is a factor of the combined gradient scale: see nvlamb_grad_scale() in optim.hpp.
//
// Note [Two-phase trust ratio]
// The ratio needs the norm of the whole tensor's update before any element of
// it can move, so LAMB runs in two passes: phase 1 updates m and v and sums
// ||p||^2 and ||u||^2; phase 2 recomputes u from the new m, v (cheaper than
// storing it: u would need a span of its own) and applies it. LARS is the same
// with a read-only phase 1. Partial sums per span are exact sums of 64-element
// groups aligned to the chunk (CPU kernels, Note [Exact norms] in
// exact_sum.hpp), combined per tensor exactly, so a tensor split over spans (or
// chunks, calls, or ranks) gets the same ratio bit for bit; the CUDA and
// emulated-grid backends combine double partials in a fixed order instead.

#include <cmath>
#include <cstdint>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/hyper.hpp"

namespace strata::kernels {

//! Per-step constants of LAMB.
struct LambCoeffs {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float inv_bc1, inv_bc2;  //!< 1 / (1 - beta^t), or 1 without bias correction
  float eps, weight_decay, lr;
};

//! Coefficients for step t >= 1.
inline LambCoeffs lamb_coeffs(const Hyper& h, std::int64_t t) {
  const double bc1 = h.bias_correction ? 1.0 - std::pow(double{h.beta1}, double(t)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(double{h.beta2}, double(t)) : 1.0;
  return LambCoeffs{h.beta1,
                    1.0f - h.beta1,
                    h.beta2,
                    1.0f - h.beta2,
                    static_cast<float>(1.0 / bc1),
                    static_cast<float>(1.0 / bc2),
                    h.eps,
                    h.weight_decay,
                    h.lr};
}

//! The update direction u from the (new) moments and the param.
template <typename T>
STRATA_HD inline T lamb_direction(T p, T m, T v, const LambCoeffs& c) {
  return madd(T(c.weight_decay), p, m * T(c.inv_bc1) / (vsqrt(v * T(c.inv_bc2)) + T(c.eps)));
}

//! Phase 1: new moments; returns u for the norm sums.
template <typename T>
STRATA_HD inline T lamb_phase1_rule(T p, T& m, T& v, T g, const LambCoeffs& c) {
  m = madd(T(c.beta1), m, T(c.one_minus_beta1) * g);
  v = madd(T(c.beta2), v, T(c.one_minus_beta2) * g * g);
  return lamb_direction(p, m, v, c);
}

//! Phase 2: p -= lr * ratio * u. lr_ratio = lr * trust ratio of the tensor.
template <typename T>
STRATA_HD inline void lamb_phase2_rule(T& p, T m, T v, float lr_ratio, const LambCoeffs& c) {
  p = p - T(lr_ratio) * lamb_direction(p, m, v, c);
}

//! Trust ratio from the tensor's squared norms (double sums of phase 1).
inline float lamb_trust_ratio(double param_sq, double update_sq) {
  if (!(param_sq > 0.0) || !(update_sq > 0.0)) return 1.0f;
  return static_cast<float>(std::sqrt(param_sq) / std::sqrt(update_sq));
}

}  // namespace strata::kernels
