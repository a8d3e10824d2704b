// The CUDA backend behind cuda.hpp, host-compiled: Status, allocation, the
// PassRunner over cudak::run_pass (cuda_step.cu) and the device triad.
#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/table.hpp"
#include "cuda/cuda_launch.hpp"
#include "cuda/cuda_q8.hpp"
#include "orchestrate.hpp"
#include "strata/common/cuda_check.hpp"
#include "strata/kernels/cuda.hpp"

namespace strata::kernels {
namespace {

Status launch_status(int err, const char* what) {
  if (err == 0) return Status::Ok();
  return ::strata::detail::cuda_status(static_cast<cudaError_t>(err), what, __FILE__, __LINE__);
}

cudak::PassScratch* scratch_of(void* p) {
  return static_cast<cudak::PassScratch*>(p);
}

//! Creates *slot's pass scratch on first use.
Status ensure_scratch(void** slot) {
  if (*slot != nullptr) return Status::Ok();
  cudak::PassScratch* s = nullptr;
  const char* what = "";
  STRATA_RETURN_IF_ERROR(launch_status(cudak::scratch_create(&s, &what), what));
  *slot = s;
  return Status::Ok();
}

//! This thread's scratch for the blocking passes (allocated once, grown on demand).
Result<cudak::PassScratch*> thread_scratch() {
  struct Owned {
    void* s = nullptr;
    ~Owned() { cudak::scratch_destroy(scratch_of(s)); }
  };
  thread_local Owned owned;
  STRATA_RETURN_IF_ERROR(ensure_scratch(&owned.s));
  return scratch_of(owned.s);
}

//! The block table of `spans`, sorted so each dtype signature is one launch: a
//! stable sort keeps each span's blocks in table order, so the per-span sums
//! are in the same order as the CPU's.
std::vector<GridBlock> sorted_table(std::span<const Span> spans, const GridShape& shape) {
  std::vector<GridBlock> table = plan_grid(spans, shape);
  auto signature = [&](const GridBlock& b) {
    const Span& s = spans[b.span];
    return std::make_tuple(s.grad_dtype, s.param_dtype, s.state_dtype);
  };
  std::stable_sort(table.begin(), table.end(),
                   [&](const GridBlock& x, const GridBlock& y) { return signature(x) < signature(y); });
  return table;
}

Result<detail::PassOutcome> cuda_pass(void* stream, const GridShape& shape, Pass pass, const Hyper& h,
                                      std::span<const Span> spans, const PassArgs& pa,
                                      std::span<const float> trust) {
  std::vector<GridBlock> table = sorted_table(spans, shape);
  if (table.empty()) return detail::combine_grid_partials({}, {}, spans.size());
  STRATA_ASSIGN_OR_RETURN(cudak::PassScratch * scratch, thread_scratch());
  std::vector<GridPartial> partials(table.size());
  const char* what = "";
  const int err = cudak::run_pass(stream, scratch, pass, h, spans.data(), spans.size(), table.data(),
                                  table.size(), shape.block_threads, pa,
                                  trust.empty() ? nullptr : trust.data(), partials.data(), &what);
  STRATA_RETURN_IF_ERROR(launch_status(err, what));
  return detail::combine_grid_partials(table, partials, spans.size());
}

detail::PassRunner cuda_runner(void* stream, const GridShape& shape) {
  return [stream, shape](Pass pass, const Hyper& h, std::span<const Span> spans, const PassArgs& pa,
                         std::span<const float> trust) {
    return cuda_pass(stream, shape, pass, h, spans, pa, trust);
  };
}

}  // namespace

Status cuda_probe() {
  int count = 0;
  STRATA_CUDA_TRY(cudaGetDeviceCount(&count));
  if (count == 0) return unavailable("no CUDA device is present (cudaGetDeviceCount = 0)");
  return Status::Ok();
}

Result<CudaBuffer> CudaBuffer::allocate(std::size_t bytes, bool managed) {
  STRATA_RETURN_IF_ERROR(cuda_probe());
  CudaBuffer b;
  const cudaError_t err = managed ? cudaMallocManaged(&b.data_, bytes) : cudaMalloc(&b.data_, bytes);
  if (err == cudaErrorMemoryAllocation) {
    return out_of_memory("cuda allocation of {} bytes failed: the device is full; lower the size", bytes);
  }
  STRATA_CUDA_TRY(err);
  b.bytes_ = bytes;
  return b;
}

CudaBuffer::~CudaBuffer() {
  if (data_ != nullptr) STRATA_CUDA_CHECK(cudaFree(data_));
}

CudaBuffer::CudaBuffer(CudaBuffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}

CudaBuffer& CudaBuffer::operator=(CudaBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

Result<StepReport> cuda_step(const StepArgs& args, void* stream, const GridShape& shape) {
  STRATA_RETURN_IF_ERROR(validate_grid_shape(shape));
  STRATA_RETURN_IF_ERROR(cuda_probe());
  return detail::run_step(cuda_runner(stream, shape), args);
}

CudaStepScratch::~CudaStepScratch() {
  cudak::scratch_destroy(scratch_of(check_));
  cudak::scratch_destroy(scratch_of(update_));
}

CudaStepScratch::CudaStepScratch(CudaStepScratch&& other) noexcept
    : check_(std::exchange(other.check_, nullptr)),
      update_(std::exchange(other.update_, nullptr)),
      table_(std::move(other.table_)),
      span_count_(other.span_count_),
      checked_on_device_(other.checked_on_device_),
      skipped_(other.skipped_),
      enqueued_(std::exchange(other.enqueued_, false)) {}

CudaStepScratch& CudaStepScratch::operator=(CudaStepScratch&& other) noexcept {
  std::swap(check_, other.check_);
  std::swap(update_, other.update_);
  std::swap(table_, other.table_);
  std::swap(span_count_, other.span_count_);
  std::swap(checked_on_device_, other.checked_on_device_);
  std::swap(skipped_, other.skipped_);
  std::swap(enqueued_, other.enqueued_);
  return *this;
}

void* CudaStepScratch::event() const {
  return update_ != nullptr ? cudak::scratch_event(scratch_of(update_)) : nullptr;
}

Status cuda_step_enqueue(const StepArgs& args, CudaStepScratch& scratch, void* stream,
                         const GridShape& shape) {
  STRATA_RETURN_IF_ERROR(validate_grid_shape(shape));
  STRATA_RETURN_IF_ERROR(detail::validate_args(args));
  const Optimizer o = args.hyper.optimizer;
  if (o == Optimizer::kLamb || o == Optimizer::kLars || o == Optimizer::kCame) {
    return invalid_argument("cuda_step_enqueue: {} needs the host between its phases; use cuda_step",
                            optimizer_name(o));
  }
  if (scratch.enqueued_) {
    return failed_precondition(
        "cuda_step_enqueue: the scratch's last step was not finished; call "
        "cuda_step_finish first (one scratch per step in flight)");
  }
  STRATA_RETURN_IF_ERROR(cuda_probe());
  STRATA_RETURN_IF_ERROR(ensure_scratch(&scratch.update_));
  scratch.span_count_ = args.spans.size();
  scratch.table_ = sorted_table(args.spans, shape);
  scratch.checked_on_device_ = args.check == GradCheck::kSeparatePass;
  scratch.skipped_ = args.check == GradCheck::kCallerChecked && !args.checked->finite;
  scratch.enqueued_ = true;
  if (scratch.skipped_ || scratch.table_.empty()) return Status::Ok();
  const std::vector<GridBlock>& table = scratch.table_;
  const char* what = "";
  if (scratch.checked_on_device_) {
    STRATA_RETURN_IF_ERROR(ensure_scratch(&scratch.check_));
    PassArgs check;
    check.scale = args.grad_scale;
    STRATA_RETURN_IF_ERROR(
        launch_status(cudak::enqueue_pass(stream, scratch_of(scratch.check_), Pass::kGradStats, Hyper{},
                                          args.spans.data(), args.spans.size(), table.data(), table.size(),
                                          shape.block_threads, check, nullptr, false, &what),
                      what));
    STRATA_RETURN_IF_ERROR(launch_status(
        cudak::enqueue_flag(stream, scratch_of(scratch.check_), scratch_of(scratch.update_), &what), what));
  }
  return launch_status(
      cudak::enqueue_pass(stream, scratch_of(scratch.update_), Pass::kUpdate, args.hyper, args.spans.data(),
                          args.spans.size(), table.data(), table.size(), shape.block_threads,
                          detail::pass_args(args), nullptr, scratch.checked_on_device_, &what),
      what);
}

Result<StepReport> cuda_step_finish(CudaStepScratch& scratch) {
  if (!scratch.enqueued_) {
    return failed_precondition("cuda_step_finish: no step was enqueued on this scratch");
  }
  scratch.enqueued_ = false;
  if (scratch.skipped_) return StepReport{.grads_finite = false, .applied = false};
  if (scratch.table_.empty()) return StepReport{.grads_finite = true, .applied = true};
  const GridPartial* partials = nullptr;
  std::uint32_t flag = 0;
  const char* what = "";
  STRATA_RETURN_IF_ERROR(
      launch_status(cudak::wait_pass(scratch_of(scratch.update_), &partials, &flag, &what), what));
  if (scratch.checked_on_device_ && flag != 0) return StepReport{.grads_finite = false, .applied = false};
  const detail::PassOutcome o = detail::combine_grid_partials(
      scratch.table_, std::span<const GridPartial>(partials, scratch.table_.size()), scratch.span_count_);
  if (o.nonfinite) {
    return failed_precondition(
        "cuda_step_finish: a gradient was Inf/NaN in the fused pass although the check said finite: "
        "gradients changed between the check and the step; recompute the check right before the step");
  }
  return StepReport{.grads_finite = true, .applied = true};
}

Result<GradStats> cuda_grad_stats(std::span<const Span> spans, float grad_scale, void* stream,
                                  const GridShape& shape) {
  STRATA_RETURN_IF_ERROR(validate_grid_shape(shape));
  STRATA_RETURN_IF_ERROR(cuda_probe());
  std::vector<double> per_span(spans.size());
  return detail::run_grad_stats(cuda_runner(stream, shape), spans, grad_scale, per_span);
}

Result<StepReport> cuda_step_q8(const Q8StepArgs& a, void* stream) {
  STRATA_RETURN_IF_ERROR(cpu::q8_validate(a));
  STRATA_RETURN_IF_ERROR(cuda_probe());
  bool finite = true;
  if (a.check == GradCheck::kCallerChecked) {
    finite = a.checked->finite;
  } else {  // the check on the device, as cuda_step's kSeparatePass
    std::vector<Span> grads(a.spans.size());
    for (std::size_t i = 0; i < a.spans.size(); ++i) {
      grads[i].grad = a.spans[i].grad;
      grads[i].grad_dtype = a.spans[i].grad_dtype;
      grads[i].n = a.spans[i].n;
    }
    STRATA_ASSIGN_OR_RETURN(GradStats stats, cuda_grad_stats(grads, a.grad_scale, stream));
    finite = stats.finite;
  }
  if (!finite) return StepReport{.grads_finite = false, .applied = false};
  bool nonfinite = false;
  const char* what = "";
  STRATA_RETURN_IF_ERROR(
      launch_status(cudak::q8_run(stream, a.spans.data(), a.spans.size(), adam_coeffs(a.hyper, a.step),
                                  a.grad_scale, cpu::q8_tables(), &nonfinite, &what),
                    what));
  if (nonfinite) {
    return failed_precondition(
        "cuda_step_q8: a gradient was Inf/NaN in the fused pass although the check said finite: gradients "
        "changed between the check and the step; states are now updated with them");
  }
  return StepReport{.grads_finite = true, .applied = true};
}

Result<double> cuda_triad_gb_s(std::size_t n, int repeats) {
  STRATA_ASSIGN_OR_RETURN(CudaBuffer a, CudaBuffer::allocate(n * 4, false));
  STRATA_ASSIGN_OR_RETURN(CudaBuffer b, CudaBuffer::allocate(n * 4, false));
  STRATA_ASSIGN_OR_RETURN(CudaBuffer c, CudaBuffer::allocate(n * 4, false));
  STRATA_CUDA_TRY(cudaMemset(b.data(), 0, n * 4));
  STRATA_CUDA_TRY(cudaMemset(c.data(), 0, n * 4));
  double best = 0.0;
  for (int r = 0; r <= repeats; ++r) {  // run 0 warms up
    float ms = 0.0f;
    const char* what = "";
    STRATA_RETURN_IF_ERROR(
        launch_status(cudak::triad(static_cast<float*>(a.data()), static_cast<const float*>(b.data()),
                                   static_cast<const float*>(c.data()), n, &ms, &what),
                      what));
    if (r > 0 && ms > 0.0f) best = std::max(best, 12.0 * double(n) / (double{ms} * 1e-3) / 1e9);
  }
  return best;
}

Status cuda_synchronize() {
  STRATA_CUDA_TRY(cudaDeviceSynchronize());
  return Status::Ok();
}

}  // namespace strata::kernels
