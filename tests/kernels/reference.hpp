#pragma once
// Double-precision reference optimizers for the kernel tests, written from the
// papers / torch.optim formulas directly (whole tensors, no shared code with
// kernels/), so they check the rules rather than restate them.

#include <cmath>
#include <cstddef>
#include <vector>

#include "strata/kernels/hyper.hpp"

namespace strata::kernels::test {

//! Reference state of one tensor, all in double.
struct RefTensor {
  std::vector<double> p, s0, s1;  // master and up to two states
};

inline double norm2(const std::vector<double>& x) {
  double s = 0.0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

//! One step t (1-based) of `h` on tensor x with the already scaled gradient g.
inline void ref_step(const Hyper& h, std::int64_t t, RefTensor& x, const std::vector<double>& g) {
  const std::size_t n = x.p.size();
  const double lr = h.lr, wd = h.weight_decay, b1 = h.beta1, b2 = h.beta2, eps = h.eps;
  auto& p = x.p;
  auto& m = x.s0;
  auto& v = x.s1;
  switch (h.optimizer) {
    case Optimizer::kAdam:
    case Optimizer::kAdamW: {
      const bool decoupled = h.optimizer == Optimizer::kAdamW;
      const double bc1 = 1 - std::pow(b1, double(t)), bc2 = 1 - std::pow(b2, double(t));
      for (std::size_t i = 0; i < n; ++i) {
        double gi = g[i] + (decoupled ? 0.0 : wd * p[i]);
        if (decoupled) p[i] -= lr * wd * p[i];
        m[i] = b1 * m[i] + (1 - b1) * gi;
        v[i] = b2 * v[i] + (1 - b2) * gi * gi;
        p[i] -= lr * (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps);
      }
      break;
    }
    case Optimizer::kLamb: {
      const double bc1 = h.bias_correction ? 1 - std::pow(b1, double(t)) : 1.0;
      const double bc2 = h.bias_correction ? 1 - std::pow(b2, double(t)) : 1.0;
      std::vector<double> u(n);
      for (std::size_t i = 0; i < n; ++i) {
        m[i] = b1 * m[i] + (1 - b1) * g[i];
        v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
        u[i] = (m[i] / bc1) / (std::sqrt(v[i] / bc2) + eps) + wd * p[i];
      }
      const double pn = norm2(p), un = norm2(u);
      const double ratio = (pn > 0 && un > 0) ? pn / un : 1.0;
      for (std::size_t i = 0; i < n; ++i) p[i] -= lr * ratio * u[i];
      break;
    }
    case Optimizer::kLars: {
      const double pn = norm2(p), gn = norm2(g);
      double trust = (pn > 0 && gn > 0) ? h.trust_coefficient * pn / (gn + wd * pn + eps) : 1.0;
      if (h.lars_clip) trust = std::fmin(trust / lr, 1.0);
      for (std::size_t i = 0; i < n; ++i) {
        const double d = trust * (g[i] + wd * p[i]);
        if (h.momentum != 0) {
          m[i] = t == 1 ? d : h.momentum * m[i] + d;
          p[i] -= lr * m[i];
        } else {
          p[i] -= lr * d;
        }
      }
      break;
    }
    case Optimizer::kSgd:
      for (std::size_t i = 0; i < n; ++i) {
        double d = g[i] + wd * p[i];
        if (h.momentum != 0) {
          m[i] = t == 1 ? d : h.momentum * m[i] + (1 - h.dampening) * d;
          d = h.nesterov ? d + h.momentum * m[i] : m[i];
        }
        p[i] -= lr * d;
      }
      break;
    case Optimizer::kLion:
      for (std::size_t i = 0; i < n; ++i) {
        const double c = b1 * m[i] + (1 - b1) * g[i];
        const double sgn = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
        p[i] = p[i] * (1 - lr * wd) - lr * sgn;
        m[i] = b2 * m[i] + (1 - b2) * g[i];
      }
      break;
    case Optimizer::kAdagrad: {
      const double clr = lr / (1 + double(t - 1) * h.lr_decay);
      for (std::size_t i = 0; i < n; ++i) {
        const double gi = g[i] + wd * p[i];
        m[i] += gi * gi;
        p[i] -= clr * gi / (std::sqrt(m[i]) + eps);
      }
      break;
    }
    case Optimizer::kCame:
      break;  // test_came.cpp has its own reference
  }
}

}  // namespace strata::kernels::test
