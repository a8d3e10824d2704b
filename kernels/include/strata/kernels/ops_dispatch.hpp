#pragma once
// with_op(): runtime dtypes -> template arguments of the ops (included by ops.hpp).
// Each on_* helper calls k with a std::integral_constant tag; nested lambdas
// build the op type. The instantiated set is exactly what validate_spans()
// accepts: grads f32/bf16/f16, params none/f32/bf16/f16, states f32 (bf16 too
// for the Adam family).

#include <type_traits>

namespace strata::kernels {
namespace detail {

template <DType D>
using DTag = std::integral_constant<DType, D>;

template <typename K>
bool on_grad_dtype(DType d, K&& k) {
  switch (d) {
    case DType::kF32:
      return k(DTag<DType::kF32>{});
    case DType::kBF16:
      return k(DTag<DType::kBF16>{});
    case DType::kF16:
      return k(DTag<DType::kF16>{});
    default:
      return false;
  }
}

template <typename K>
bool on_param_dtype(DType d, K&& k) {
  if (d == DType::kNone) return k(DTag<DType::kNone>{});
  return on_grad_dtype(d, k);
}

template <typename K>
bool on_adam_state_dtype(DType d, K&& k) {
  switch (d) {
    case DType::kF32:
      return k(DTag<DType::kF32>{});
    case DType::kBF16:
      return k(DTag<DType::kBF16>{});
    default:
      return false;
  }
}

template <typename K>
bool on_bool(bool b, K&& k) {
  return b ? k(std::true_type{}) : k(std::false_type{});
}

}  // namespace detail

template <typename Fn>
bool with_op(Pass pass, const Hyper& h, const Span& s, Fn&& fn) {
  using namespace detail;
  auto call = [&](auto op) {
    fn(op);
    return true;
  };
  const bool has_state = h.momentum != 0.0f;  // SGD/LARS keep a buffer iff momentum
  switch (pass) {
    case Pass::kGradStats:
      return on_grad_dtype(s.grad_dtype, [&](auto g) { return call(GradStatsOp<decltype(g)::value>{}); });
    case Pass::kTrustPhase1:
      if (h.optimizer == Optimizer::kLars) {
        return on_grad_dtype(s.grad_dtype, [&](auto g) { return call(LarsPhase1Op<decltype(g)::value>{}); });
      }
      return on_grad_dtype(s.grad_dtype, [&](auto g) {
        return on_adam_state_dtype(s.state_dtype, [&](auto st) {
          return call(LambPhase1Op<decltype(g)::value, decltype(st)::value>{});
        });
      });
    case Pass::kTrustPhase2:
      if (h.optimizer == Optimizer::kLars) {
        return on_grad_dtype(s.grad_dtype, [&](auto g) {
          return on_param_dtype(s.param_dtype, [&](auto p) {
            return on_bool(has_state, [&](auto mom) {
              return call(LarsPhase2Op<decltype(g)::value, decltype(p)::value, decltype(mom)::value>{});
            });
          });
        });
      }
      return on_param_dtype(s.param_dtype, [&](auto p) {
        return on_adam_state_dtype(s.state_dtype, [&](auto st) {
          return call(LambPhase2Op<decltype(p)::value, decltype(st)::value>{});
        });
      });
    case Pass::kUpdate:
      break;
  }
  return on_grad_dtype(s.grad_dtype, [&](auto g) {
    return on_param_dtype(s.param_dtype, [&](auto p) {
      constexpr DType G = decltype(g)::value;
      constexpr DType P = decltype(p)::value;
      switch (h.optimizer) {
        case Optimizer::kAdam:
        case Optimizer::kAdamW:
          return on_adam_state_dtype(s.state_dtype,
                                     [&](auto st) { return call(AdamOp<G, P, decltype(st)::value>{}); });
        case Optimizer::kSgd:
          return on_bool(has_state, [&](auto mom) { return call(SgdOp<G, P, decltype(mom)::value>{}); });
        case Optimizer::kLion:
          return call(LionOp<G, P>{});
        case Optimizer::kAdagrad:
          return call(AdagradOp<G, P>{});
        default:
          return false;
      }
    });
  });
}

}  // namespace strata::kernels
