#pragma once
// The order of passes of a step, shared by every backend (CPU pieces, emulated
// grid, CUDA): checks, the gradient check, LAMB/LARS phases and the per-tensor
// combination of partial sums. A backend supplies only "run this pass over
// these spans" (internal header).

#include <functional>
#include <span>
#include <vector>

#include "strata/kernels/grid.hpp"
#include "strata/kernels/ops.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::kernels::detail {

//! Result of one pass: per-span sums (combined in a fixed order) and the Inf/NaN flag.
struct PassOutcome {
  //! param_sq <- sum a, other_sq <- sum b. Storage of the thread that ran the
  //! pass (per_span_scratch), valid until its next pass: read it at once.
  std::span<TrustPartial> per_span;
  bool nonfinite = false;
};

//! `n` zeroed per-span partials in the calling thread's scratch, reused by its
//! next call: a pass allocates nothing once its thread has seen as many spans
//! (Note [Allocation-free hot paths] in runtime/src/leases.cpp).
std::span<TrustPartial> per_span_scratch(std::size_t n);

//! Runs one pass; trust is empty or one value per span. Blocks until done.
using PassRunner = std::function<Result<PassOutcome>(Pass pass, const Hyper& h, std::span<const Span> spans,
                                                     const PassArgs& pa, std::span<const float> trust)>;

//! Adds block partials into per-span sums in table order (grid backends).
PassOutcome combine_grid_partials(std::span<const GridBlock> table, std::span<const GridPartial> partials,
                                  std::size_t span_count);

//! Per-step coefficients of args.hyper.
PassArgs pass_args(const StepArgs& args);
//! validate_hyper + step/scale/check fields + validate_spans.
Status validate_args(const StepArgs& args);
//! Checks the gradient pointers/dtypes grad_stats needs.
Status validate_grad_spans(std::span<const Span> spans, float grad_scale);

Result<GradStats> run_grad_stats(const PassRunner& run, std::span<const Span> spans, float grad_scale,
                                 std::span<double> per_span);
Result<StepReport> run_trust_phase1(const PassRunner& run, const StepArgs& args,
                                    std::span<TrustPartial> partials);
Status run_trust_phase2(const PassRunner& run, const StepArgs& args, std::span<const float> trust_per_span);
Result<StepReport> run_step(const PassRunner& run, const StepArgs& args);

}  // namespace strata::kernels::detail
