// OptimizerPipeline: the Inf/NaN check and the sums of squares of a family's
// gradient (optimizer_pipeline.hpp).
//
// Note [Gradient check on the device]
// The CPU kernel must write nothing when a gradient is Inf/NaN (Note [Inf/NaN
// and untouched states]), so it must know the gradient is finite before its
// fused pass; clipping also needs the global norm first. Reading the gradient
// on the host only for that costs a pass over host memory (4 B/param on top of
// ~28 for fp32 AdamW). Instead the check runs on the device, on the d2h stream
// right before the copy that brings the gradient to host: it reads device
// memory, and the copy that follows cannot start before it ends, so the host
// gradient is exactly the one checked. The CPU kernel then runs with
// GradCheck::kCallerChecked (its fused pass still fails if a gradient changed).
//   - non-deferred families: land_gradient checks with the scale in effect;
//   - deferred steps (clipping, loss scaling): deferred_prepass checks every
//     gradient still on the device and adds the per-span sums in family/span
//     order, the order grad_stats over all spans used (the same norm, bit for bit).
// On the sim device the device's kernel is the CPU kernel over slot memory,
// run on the d2h stream's thread and pool workers (RuntimeOptions::threads in
// all; it needs no free worker, Note [Deadlock-free fork-join]). A gradient already on host
// (written back between micro-batches), or a device that cannot run the check
// (CUDA: not wired yet), falls back to a host pass: check_on_host, or the
// kernel's own kSeparatePass. StepStats::grad_check_host_bytes counts the
// bytes those fallbacks read, so a test can see that a step needed none.

#include "pipeline/optimizer_pipeline.hpp"
#include "residency/device_access.hpp"
#include "strata/common/assert.hpp"

namespace strata::runtime {

void OptimizerPipeline::grad_spans(FamilyId f, std::byte* grad, std::vector<kernels::Span>* spans) {
  FamilyPtrs ptrs;
  ptrs.at[static_cast<int>(StateKind::kGrad)] = grad;
  // spans_for sets every pointer; only the gradient's are kept.
  spans_for(f, ptrs, spans, nullptr);
  for (kernels::Span& s : *spans) {
    s.master = nullptr;
    s.param = nullptr;
    s.param_dtype = DType::kNone;
    s.state = {};
  }
}

bool OptimizerPipeline::checks_on_device() const {
  return device_memory_host_readable(core_.device);
}

Status OptimizerPipeline::check_on_device(FamilyId f, std::byte* grad, float scale) {
  STRATA_CHECK(checks_on_device());
  GradCheckResult& check = checks_[f];
  grad_spans(f, grad, &check.spans);
  check.valid = true;
  check.finite = true;
  check.scale = scale;
  check.span_sq.assign(check.spans.size(), 0.0);
  // Device-stream callbacks never take the mutex (Note [Runtime threading]):
  // the callback writes only finite and span_sq, which nothing reads before the
  // gradient has landed (after this callback, in d2h order); nothing changes
  // spans and scale before then either. It captures only (this, f), which
  // std::function keeps in place (Note [Allocation-free hot paths]).
  return core_.device.launch_host(core_.d2h, [this, f] {
    GradCheckResult& c = checks_[f];
    Result<kernels::GradStats> stats =
        kernels::grad_stats_per_span(c.spans, c.scale, c.span_sq, core_.pool.get());
    // grad_stats fails only on bad spans (a runtime bug); a non-finite verdict
    // keeps the kernel from writing, and its own pass reports the error.
    c.finite = stats.ok() && stats->finite;
    c.sum_exact = stats.ok() ? stats->sum_exact : kernels::ExactSum{};
  });
}

Status OptimizerPipeline::check_on_host(FamilyId f, std::byte* grad, float scale) {
  GradCheckResult& check = checks_[f];
  grad_spans(f, grad, &check.spans);
  check.span_sq.assign(check.spans.size(), 0.0);
  STRATA_ASSIGN_OR_RETURN(kernels::GradStats stats,
                          kernels::grad_stats_per_span(check.spans, scale, check.span_sq, core_.pool.get()));
  check.valid = true;
  check.finite = stats.finite;
  check.sum_exact = stats.sum_exact;
  check.scale = scale;
  for (const kernels::Span& s : check.spans) host_check_bytes_ += s.n * kernels::dtype_size(s.grad_dtype);
  return Status::Ok();
}

}  // namespace strata::runtime
