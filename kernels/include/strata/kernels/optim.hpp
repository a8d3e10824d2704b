#pragma once
// The fused optimizer step a chunked runtime calls: spans of master/param/grad/
// state memory plus hyperparameters, step number and one combined gradient scale.
//
// Note [Inf/NaN and untouched states]
// A step must leave master, states and param untouched when any gradient is
// Inf/NaN, so the caller can skip it (dynamic loss scaling). Detecting it inside
// the fused pass is free but too late (earlier elements are already written).
// So step() first reads the gradients once (grad_stats(), the same pass that
// yields the norm for clipping) unless the caller says it has just done so
// (GradCheck::kCallerChecked with the GradStats it got). A runtime that clips
// computes the norm anyway, so its step costs no extra read; without clipping
// the check costs one extra read of the gradient (4 or 2 bytes per element on
// top of ~28). The fused pass still folds g * 0 into an accumulator (NaN iff a
// lane was non-finite) and fails with FailedPrecondition if a gradient changed
// between the check and the step. LARS's phase 1 reads the gradient anyway and
// is its check.
//
// Note [Deterministic threading]
// Work is cut into pieces of kPieceElems elements at fixed offsets of each span
// (never by thread count; the offsets are multiples of kPieceElems from the
// chunk's start, Span::group_phase). Norms (grad_stats, LAMB/LARS phase 1) are
// summed in the compute width per 64-element group aligned to the chunk and
// added exactly (Note [Exact norms] in exact_sum.hpp); other passes' sums per
// 1024-element block, then in double per piece, pieces in span/offset order.
// So results are bit-identical for any thread count (for a given Isa), and
// norms for any cut of a tensor into spans at group boundaries.

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include "strata/common/status.hpp"
#include "strata/kernels/dtype.hpp"
#include "strata/kernels/exact_sum.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/kernels/rules/lamb.hpp"  // lamb_trust_ratio
#include "strata/kernels/rules/lars.hpp"  // lars_trust_ratio
#include "strata/kernels/span.hpp"

namespace strata {
class ThreadPool;
}

namespace strata::kernels {

//! CPU instruction set of the kernels.
enum class Isa : std::uint8_t { kScalar, kAvx2, kAvx512 };

//! "scalar", "avx2", "avx512".
std::string_view isa_name(Isa isa);
//! Parses an Isa name; InvalidArgument names the accepted values.
Result<Isa> parse_isa(std::string_view name);
//! True when this CPU can run `isa` (CPUID; scalar always).
bool isa_supported(Isa isa);
//! The Isa step() uses by default: STRATA_KERNELS_ISA when set (and supported;
//! a warning is logged when it is not), else the best this CPU supports. Logs
//! its choice once. Thread-safe.
Isa default_isa();

//! How step() makes sure gradients are finite; see Note [Inf/NaN and untouched states].
enum class GradCheck : std::uint8_t {
  kSeparatePass,   //!< read the gradients once before writing anything
  kCallerChecked,  //!< the caller ran grad_stats() on these gradients and passes the result
};

//! What grad_stats() found.
struct GradStats {
  double sum_squares = 0.0;  //!< sum of (scale * g)^2 over all spans, in double
  bool finite = true;        //!< false when any gradient was Inf/NaN (or overflowed when scaled)
  //! The exact sum sum_squares rounds (CPU kernels: exact = true; Note [Exact norms]).
  ExactSum sum_exact;
  bool exact = false;
};

//! One call's work.
struct StepArgs {
  Hyper hyper;
  std::int64_t step = 1;    //!< 1-based step number (after increment), as torch's state['step']
  float grad_scale = 1.0f;  //!< 1/loss_scale x clip coefficient, applied to every gradient
  std::span<const Span> spans;
  ThreadPool* pool = nullptr;  //!< workers for the pass; null runs on the calling thread
  std::optional<Isa> isa;      //!< nullopt: default_isa()
  GradCheck check = GradCheck::kSeparatePass;
  const GradStats* checked = nullptr;  //!< required with kCallerChecked
};

//! What a step did.
struct StepReport {
  bool grads_finite = true;  //!< false: some gradient was Inf/NaN
  bool applied = false;      //!< true: master, states and param were updated
};

//! Checks hyperparameters (finite, in range for the optimizer). Pure.
Status validate_hyper(const Hyper& hyper);
//! The Optimizer named `name` (optimizer_name's spelling); InvalidArgument lists the names.
Result<Optimizer> parse_optimizer(std::string_view name);
//! `optimizer` with torch.optim's default hyperparameters (the paper's where torch has none).
Hyper optimizer_defaults(Optimizer optimizer);
//! Checks the spans against the optimizer: non-null pointers for non-empty
//! spans, the states it needs, supported dtype combinations. Pure.
Status validate_spans(const Hyper& hyper, std::span<const Span> spans);

//! Sum of squares of the scaled gradients and an Inf/NaN flag, over all spans
//! (deterministic; see Note [Deterministic threading]). Blocks until done.
//! Fails: InvalidArgument for a bad span or non-finite scale, Unavailable for an unsupported isa.
Result<GradStats> grad_stats(std::span<const Span> spans, float grad_scale, ThreadPool* pool = nullptr,
                             std::optional<Isa> isa = std::nullopt);

//! Per-span sums of squares of the scaled gradients (for per-tensor norms, e.g.
//! clipping by tensor). out.size() must equal spans.size(). Same failures.
Result<GradStats> grad_stats_per_span(std::span<const Span> spans, float grad_scale, std::span<double> out,
                                      ThreadPool* pool = nullptr, std::optional<Isa> isa = std::nullopt);

//! torch.nn.utils.clip_grad_norm_'s coefficient: min(1, max_norm / (norm + 1e-6)).
float clip_coefficient(double global_norm, double max_norm);

//! NVLAMB's global grad-norm pre-normalisation folded into the gradient scale:
//! 1 / (loss_scale * max(1, global_norm / max_norm)), where global_norm is the
//! norm of the unscaled gradients (sqrt(grad_stats(scale = 1/loss_scale).sum_squares)).
float nvlamb_grad_scale(double global_norm, double max_norm, double loss_scale);

//! One optimizer step over all spans (any optimizer but CAME; LAMB/LARS tensors
//! may be split over spans of this call: norms are combined per Span::tensor).
//! Blocks until done. Returns the report; on Inf/NaN nothing is written.
//! Fails: InvalidArgument (bad hyperparameters, length/dtype mismatch, missing
//! state), Unavailable (forced isa not supported here), FailedPrecondition
//! (kCallerChecked but a gradient was non-finite in the fused pass: data changed).
Result<StepReport> step(const StepArgs& args);

//! Partial sums of one span for the LAMB/LARS trust ratio.
struct TrustPartial {
  double param_sq = 0.0;  //!< ||p||^2 over the span (before the update)
  double other_sq = 0.0;  //!< LAMB: ||u||^2 ; LARS: ||g||^2 (scaled)
  //! The exact sums the two round (CPU kernels: exact = true; Note [Exact norms]):
  //! adding them per tensor gives the same bits however the tensor is split.
  ExactSum param_exact;
  ExactSum other_exact;
  bool exact = false;
};

//! Phase 1 of LAMB/LARS for spans whose tensors may span several calls:
//! LAMB updates m and v, LARS only reads. Writes one partial per span. The
//! caller sums partials per tensor (ExactSum::add of param_exact/other_exact:
//! any order and any cut of the tensor at group boundaries give the same bits,
//! Note [Exact norms]), turns them into ratios (lamb_trust_ratio /
//! lars_trust_ratio) and calls phase 2.
//! Checks gradients as step() does. Fails as step().
Result<StepReport> trust_phase1(const StepArgs& args, std::span<TrustPartial> partials);
//! Phase 2: applies the update with one trust ratio per span. Never reads the gradient for LAMB.
Status trust_phase2(const StepArgs& args, std::span<const float> trust_per_span);

//! A tensor for CAME, given whole. rows * cols == n; rows == 1 or cols == 1 is
//! a 1-D tensor (unfactored). Factored (2-D): exp_avg (n), row, res_row (rows),
//! col, res_col (cols). 1-D: exp_avg, exp_avg_sq (n). States fp32, zero at start.
struct CameTensor {
  float* master = nullptr;
  const void* grad = nullptr;
  DType grad_dtype = DType::kF32;
  void* param = nullptr;
  DType param_dtype = DType::kNone;
  std::size_t rows = 0, cols = 0;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;  //!< 1-D only
  float* row = nullptr;         //!< 2-D: r
  float* col = nullptr;         //!< 2-D: c
  float* res_row = nullptr;     //!< 2-D: R
  float* res_col = nullptr;     //!< 2-D: C
};

//! One CAME step over whole tensors (scalar code on any Isa, threaded over rows;
//! see Note [CAME passes]). Checks gradients first; on Inf/NaN writes nothing.
//! Fails: InvalidArgument (shape, missing state, bad hyperparameters).
Result<StepReport> came_step(const Hyper& hyper, std::int64_t step, float grad_scale,
                             std::span<const CameTensor> tensors, ThreadPool* pool = nullptr);

}  // namespace strata::kernels
