#pragma once
// Per-element operations: load a lane group of every span, apply a rule, store.
// One template per pass, instantiated for float (scalar CPU, CUDA, emulated
// grid) and for the SIMD lane types; see Note [One rule body, many widths].
// Every op folds g * 0 into acc.bad (NaN iff some gradient lane was Inf/NaN).

#include <cstddef>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/kernels/lanes.hpp"
#include "strata/kernels/rules/adagrad.hpp"
#include "strata/kernels/rules/adam.hpp"
#include "strata/kernels/rules/lamb.hpp"
#include "strata/kernels/rules/lars.hpp"
#include "strata/kernels/rules/lion.hpp"
#include "strata/kernels/rules/sgd.hpp"
#include "strata/kernels/span.hpp"

namespace strata::kernels {

//! Everything a pass needs besides the span; plain data, copied to the device as is.
struct PassArgs {
  float scale = 1.0f;  //!< combined gradient scale
  float trust = 1.0f;  //!< per span: LAMB lr * ratio, LARS trust ratio
  AdamCoeffs adam{};
  LambCoeffs lamb{};
  LarsCoeffs lars{};
  SgdCoeffs sgd{};
  LionCoeffs lion{};
  AdagradCoeffs adagrad{};
};

//! Accumulators of one worker (thread or lane group): non-finite probe and two sums.
template <typename T>
struct Acc {
  T bad = T(0.0f);
  T a = T(0.0f);
  T b = T(0.0f);
};

template <typename T, DType G>
STRATA_HD inline T load_grad(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) {
  const T g = load<T, G>(s.grad, i) * T(pa.scale);
  acc.bad = madd(g, T(0.0f), acc.bad);
  return g;
}

template <typename T, DType P>
STRATA_HD inline void store_master(const Span& s, std::size_t i, T p) {
  store<T, DType::kF32>(s.master, i, p);
  store<T, P>(s.param, i, p);
}

//! grad_stats: sum of squares of scaled gradients.
template <DType G>
struct GradStatsOp {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    acc.a = madd(g, g, acc.a);
  }
};

template <DType G, DType P, DType S>
struct AdamOp {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    T p = load<T, DType::kF32>(s.master, i);
    T m = load<T, S>(s.state[0], i);
    T v = load<T, S>(s.state[1], i);
    adam_rule(p, m, v, g, pa.adam);
    store<T, S>(s.state[0], i, m);
    store<T, S>(s.state[1], i, v);
    store_master<T, P>(s, i, p);
  }
};

//! LAMB phase 1: new m, v; acc.a += p^2, acc.b += u^2.
template <DType G, DType S>
struct LambPhase1Op {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    const T p = load<T, DType::kF32>(s.master, i);
    T m = load<T, S>(s.state[0], i);
    T v = load<T, S>(s.state[1], i);
    const T u = lamb_phase1_rule(p, m, v, g, pa.lamb);
    store<T, S>(s.state[0], i, m);
    store<T, S>(s.state[1], i, v);
    acc.a = madd(p, p, acc.a);
    acc.b = madd(u, u, acc.b);
  }
};

//! LAMB phase 2 (reads no gradient): pa.trust = lr * ratio.
template <DType P, DType S>
struct LambPhase2Op {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& /*acc*/) const {
    T p = load<T, DType::kF32>(s.master, i);
    const T m = load<T, S>(s.state[0], i);
    const T v = load<T, S>(s.state[1], i);
    lamb_phase2_rule(p, m, v, pa.trust, pa.lamb);
    store_master<T, P>(s, i, p);
  }
};

//! LARS phase 1 (read-only): acc.a += p^2, acc.b += g^2.
template <DType G>
struct LarsPhase1Op {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    const T p = load<T, DType::kF32>(s.master, i);
    acc.a = madd(p, p, acc.a);
    acc.b = madd(g, g, acc.b);
  }
};

template <DType G, DType P, bool kMomentum>
struct LarsPhase2Op {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    T p = load<T, DType::kF32>(s.master, i);
    if constexpr (kMomentum) {
      T buf = load<T, DType::kF32>(s.state[0], i);
      lars_rule(p, buf, g, pa.trust, pa.lars);
      store<T, DType::kF32>(s.state[0], i, buf);
    } else {
      lars_rule_plain(p, g, pa.trust, pa.lars);
    }
    store_master<T, P>(s, i, p);
  }
};

template <DType G, DType P, bool kMomentum>
struct SgdOp {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    T p = load<T, DType::kF32>(s.master, i);
    if constexpr (kMomentum) {
      T buf = load<T, DType::kF32>(s.state[0], i);
      sgd_momentum_rule(p, buf, g, pa.sgd);
      store<T, DType::kF32>(s.state[0], i, buf);
    } else {
      sgd_rule(p, g, pa.sgd);
    }
    store_master<T, P>(s, i, p);
  }
};

template <DType G, DType P>
struct LionOp {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    T p = load<T, DType::kF32>(s.master, i);
    T m = load<T, DType::kF32>(s.state[0], i);
    lion_rule(p, m, g, pa.lion);
    store<T, DType::kF32>(s.state[0], i, m);
    store_master<T, P>(s, i, p);
  }
};

template <DType G, DType P>
struct AdagradOp {
  template <typename T>
  STRATA_HD void operator()(const Span& s, std::size_t i, const PassArgs& pa, Acc<T>& acc) const {
    const T g = load_grad<T, G>(s, i, pa, acc);
    T p = load<T, DType::kF32>(s.master, i);
    T sum = load<T, DType::kF32>(s.state[0], i);
    adagrad_rule(p, sum, g, pa.adagrad);
    store<T, DType::kF32>(s.state[0], i, sum);
    store_master<T, P>(s, i, p);
  }
};

//! The passes a step is made of.
enum class Pass : std::uint8_t { kGradStats, kUpdate, kTrustPhase1, kTrustPhase2 };

//! Calls fn(op) with the op object for (pass, optimizer, dtypes of s), resolving
//! the runtime dtypes to template arguments. Returns false for a combination
//! validate_spans() rejects (never reached after validation).
template <typename Fn>
bool with_op(Pass pass, const Hyper& h, const Span& s, Fn&& fn);

}  // namespace strata::kernels

#include "strata/kernels/ops_dispatch.hpp"
