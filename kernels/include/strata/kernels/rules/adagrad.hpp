#pragma once
// Adagrad as torch.optim.Adagrad:
//   clr = lr / (1 + (t - 1) lr_decay)
//   g' = g + wd p ;  sum = sum + g'^2 ;  p = p - clr g' / (sqrt(sum) + eps)
// The initial accumulator value is the caller's: it fills state[0] before step 1.

#include <cstdint>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/hyper.hpp"

namespace strata::kernels {

//! Per-step constants of Adagrad.
struct AdagradCoeffs {
  float clr, weight_decay, eps;
};

inline AdagradCoeffs adagrad_coeffs(const Hyper& h, std::int64_t t) {
  return AdagradCoeffs{static_cast<float>(double{h.lr} / (1.0 + double(t - 1) * h.lr_decay)), h.weight_decay,
                       h.eps};
}

template <typename T>
STRATA_HD inline void adagrad_rule(T& p, T& sum, T g, const AdagradCoeffs& c) {
  g = madd(T(c.weight_decay), p, g);
  sum = madd(g, g, sum);
  p = p - T(c.clr) * g / (vsqrt(sum) + T(c.eps));
}

}  // namespace strata::kernels
