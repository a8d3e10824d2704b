// The order of passes of a step (Note [Inf/NaN and untouched states],
// Note [Two-phase trust ratio]); every backend runs through here.
#include "orchestrate.hpp"

#include <algorithm>
#include <cmath>
#include <map>

namespace strata::kernels::detail {
namespace {

Status changed_after_check() {
  return failed_precondition(
      "a gradient was Inf/NaN in the fused pass although the check said finite: gradients changed between "
      "grad_stats() and step(); states are now updated with them — recompute the check right before the "
      "step");
}

bool is_trust_optimizer(Optimizer o) {
  return o == Optimizer::kLamb || o == Optimizer::kLars;
}

//! Runs the gradient check the caller asked for. Returns true when gradients are finite.
Result<bool> grads_finite(const PassRunner& run, const StepArgs& a) {
  if (a.check == GradCheck::kCallerChecked) return a.checked->finite;
  thread_local std::vector<double> t_per_span;  // reused: no allocation once warm
  t_per_span.assign(a.spans.size(), 0.0);
  std::span<double> per_span(t_per_span);
  STRATA_ASSIGN_OR_RETURN(GradStats stats, run_grad_stats(run, a.spans, a.grad_scale, per_span));
  return stats.finite;
}

}  // namespace

std::span<TrustPartial> per_span_scratch(std::size_t n) {
  thread_local std::vector<TrustPartial> t_scratch;
  t_scratch.assign(n, TrustPartial{});
  return t_scratch;
}

PassArgs pass_args(const StepArgs& a) {
  PassArgs pa;
  pa.scale = a.grad_scale;
  const Hyper& h = a.hyper;
  switch (h.optimizer) {
    case Optimizer::kAdam:
    case Optimizer::kAdamW:
      pa.adam = adam_coeffs(h, a.step);
      break;
    case Optimizer::kLamb:
      pa.lamb = lamb_coeffs(h, a.step);
      break;
    case Optimizer::kLars:
      pa.lars = lars_coeffs(h, a.step);
      break;
    case Optimizer::kSgd:
      pa.sgd = sgd_coeffs(h, a.step);
      break;
    case Optimizer::kLion:
      pa.lion = lion_coeffs(h, a.step);
      break;
    case Optimizer::kAdagrad:
      pa.adagrad = adagrad_coeffs(h, a.step);
      break;
    case Optimizer::kCame:
      break;
  }
  return pa;
}

Status validate_args(const StepArgs& a) {
  STRATA_RETURN_IF_ERROR(validate_hyper(a.hyper));
  if (a.step < 1) return invalid_argument("step = {} must be >= 1 (1-based, after the increment)", a.step);
  if (!std::isfinite(a.grad_scale)) {
    return invalid_argument("grad_scale = {} is not finite; pass 1/loss_scale x clip coefficient",
                            a.grad_scale);
  }
  if (a.check == GradCheck::kCallerChecked && a.checked == nullptr) {
    return invalid_argument(
        "GradCheck::kCallerChecked needs the GradStats of grad_stats() in StepArgs::checked");
  }
  return validate_spans(a.hyper, a.spans);
}

Status validate_grad_spans(std::span<const Span> spans, float grad_scale) {
  if (!std::isfinite(grad_scale)) return invalid_argument("grad_scale = {} is not finite", grad_scale);
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (s.grad_dtype != DType::kF32 && s.grad_dtype != DType::kBF16 && s.grad_dtype != DType::kF16) {
      return invalid_argument("grad_stats: span {} grad dtype {} is unsupported; use fp32, bf16 or fp16", i,
                              dtype_name(s.grad_dtype));
    }
    if (s.n != 0 && s.grad == nullptr)
      return invalid_argument("grad_stats: span {} has n = {} but no grad", i, s.n);
    if (s.group_phase >= kGroupElems) {
      return invalid_argument("grad_stats: span {} group_phase = {} must be below {}", i, s.group_phase,
                              kGroupElems);
    }
  }
  return Status::Ok();
}

Result<GradStats> run_grad_stats(const PassRunner& run, std::span<const Span> spans, float grad_scale,
                                 std::span<double> per_span) {
  if (per_span.size() != spans.size()) {
    return invalid_argument("grad_stats_per_span: out has {} slots for {} spans", per_span.size(),
                            spans.size());
  }
  STRATA_RETURN_IF_ERROR(validate_grad_spans(spans, grad_scale));
  PassArgs pa;
  pa.scale = grad_scale;
  STRATA_ASSIGN_OR_RETURN(PassOutcome o, run(Pass::kGradStats, Hyper{}, spans, pa, {}));
  GradStats stats;
  stats.exact = true;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    per_span[i] = o.per_span[i].param_sq;
    stats.sum_squares += per_span[i];
    stats.sum_exact.add(o.per_span[i].param_exact);
    stats.exact = stats.exact && o.per_span[i].exact;
  }
  // The exact sum where the backend gives one (Note [Exact norms]): the same
  // bits however the spans cut the tensors.
  if (stats.exact) stats.sum_squares = stats.sum_exact.to_double();
  stats.finite = !o.nonfinite && std::isfinite(stats.sum_squares);
  return stats;
}

Result<StepReport> run_trust_phase1(const PassRunner& run, const StepArgs& a,
                                    std::span<TrustPartial> partials) {
  STRATA_RETURN_IF_ERROR(validate_args(a));
  if (!is_trust_optimizer(a.hyper.optimizer)) {
    return invalid_argument("trust_phase1 is for lamb and lars, not {}", optimizer_name(a.hyper.optimizer));
  }
  if (partials.size() != a.spans.size()) {
    return invalid_argument("trust_phase1: {} partials for {} spans", partials.size(), a.spans.size());
  }
  const bool lars = a.hyper.optimizer == Optimizer::kLars;
  // LARS phase 1 only reads, so it is its own check; LAMB's writes m and v.
  if (!lars) {
    STRATA_ASSIGN_OR_RETURN(bool finite, grads_finite(run, a));
    if (!finite) return StepReport{.grads_finite = false, .applied = false};
  }
  STRATA_ASSIGN_OR_RETURN(PassOutcome o, run(Pass::kTrustPhase1, a.hyper, a.spans, pass_args(a), {}));
  if (o.nonfinite) {
    if (lars) return StepReport{.grads_finite = false, .applied = false};
    return changed_after_check();
  }
  std::copy(o.per_span.begin(), o.per_span.end(), partials.begin());
  return StepReport{.grads_finite = true, .applied = false};
}

Status run_trust_phase2(const PassRunner& run, const StepArgs& a, std::span<const float> trust_per_span) {
  STRATA_RETURN_IF_ERROR(validate_args(a));
  if (!is_trust_optimizer(a.hyper.optimizer)) {
    return invalid_argument("trust_phase2 is for lamb and lars, not {}", optimizer_name(a.hyper.optimizer));
  }
  if (trust_per_span.size() != a.spans.size()) {
    return invalid_argument("trust_phase2: {} trust ratios for {} spans", trust_per_span.size(),
                            a.spans.size());
  }
  for (std::size_t i = 0; i < trust_per_span.size(); ++i) {
    if (!std::isfinite(trust_per_span[i])) {
      return invalid_argument("trust_phase2: trust ratio of span {} is {}; norms must be finite", i,
                              trust_per_span[i]);
    }
  }
  std::vector<float> scaled(trust_per_span.begin(), trust_per_span.end());
  if (a.hyper.optimizer == Optimizer::kLamb) {
    for (float& t : scaled) t *= a.hyper.lr;  // LambPhase2Op takes lr * ratio
  }
  STRATA_ASSIGN_OR_RETURN(PassOutcome o, run(Pass::kTrustPhase2, a.hyper, a.spans, pass_args(a), scaled));
  if (o.nonfinite) return changed_after_check();
  return Status::Ok();
}

Result<StepReport> run_step(const PassRunner& run, const StepArgs& a) {
  STRATA_RETURN_IF_ERROR(validate_args(a));
  if (is_trust_optimizer(a.hyper.optimizer)) {
    std::vector<TrustPartial> partials(a.spans.size());
    STRATA_ASSIGN_OR_RETURN(StepReport r1, run_trust_phase1(run, a, partials));
    if (!r1.grads_finite) return r1;
    // Per tensor, spans in call order (Note [Two-phase trust ratio]); exactly
    // where the backend gives exact sums (Note [Exact norms]).
    std::map<std::uint32_t, TrustPartial> per_tensor;
    for (std::size_t i = 0; i < a.spans.size(); ++i) {
      TrustPartial& t = per_tensor[a.spans[i].tensor];
      t.param_sq += partials[i].param_sq;
      t.other_sq += partials[i].other_sq;
      t.param_exact.add(partials[i].param_exact);
      t.other_exact.add(partials[i].other_exact);
      t.exact = partials[i].exact;  // one backend ran every span
    }
    for (auto& [tensor, t] : per_tensor) {
      if (!t.exact) continue;
      t.param_sq = t.param_exact.to_double();
      t.other_sq = t.other_exact.to_double();
    }
    std::vector<float> trust(a.spans.size());
    for (std::size_t i = 0; i < a.spans.size(); ++i) {
      const TrustPartial& t = per_tensor[a.spans[i].tensor];
      trust[i] = a.hyper.optimizer == Optimizer::kLamb ? lamb_trust_ratio(t.param_sq, t.other_sq)
                                                       : lars_trust_ratio(a.hyper, t.param_sq, t.other_sq);
    }
    STRATA_RETURN_IF_ERROR(run_trust_phase2(run, a, trust));
    return StepReport{.grads_finite = true, .applied = true};
  }
  STRATA_ASSIGN_OR_RETURN(bool finite, grads_finite(run, a));
  if (!finite) return StepReport{.grads_finite = false, .applied = false};
  STRATA_ASSIGN_OR_RETURN(PassOutcome o, run(Pass::kUpdate, a.hyper, a.spans, pass_args(a), {}));
  if (o.nonfinite) return changed_after_check();
  return StepReport{.grads_finite = true, .applied = true};
}

}  // namespace strata::kernels::detail
