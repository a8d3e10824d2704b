#pragma once
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Alg. 2):
//   c = b1 m + (1 - b1) g
//   p = p (1 - lr wd) - lr sign(c)
//   m = b2 m + (1 - b2) g

#include <cstdint>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/hyper.hpp"

namespace strata::kernels {

//! Per-step constants of Lion.
struct LionCoeffs {
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, decay;
};

inline LionCoeffs lion_coeffs(const Hyper& h, std::int64_t /*t*/) {
  return LionCoeffs{h.lr,    h.beta1,        1.0f - h.beta1,
                    h.beta2, 1.0f - h.beta2, static_cast<float>(1.0 - double{h.lr} * h.weight_decay)};
}

template <typename T>
STRATA_HD inline void lion_rule(T& p, T& m, T g, const LionCoeffs& c) {
  const T dir = vsign(madd(T(c.beta1), m, T(c.one_minus_beta1) * g));
  p = p * T(c.decay) - T(c.lr) * dir;
  m = madd(T(c.beta2), m, T(c.one_minus_beta2) * g);
}

}  // namespace strata::kernels
