// The CUDA backend behind cuda.hpp, host-compiled: Status, allocation, the
// PassRunner over cudak::run_pass (cuda_step.cu) and the device triad.
#include <algorithm>
#include <tuple>
#include <vector>

#include "cuda/cuda_launch.hpp"
#include "orchestrate.hpp"
#include "strata/common/cuda_check.hpp"
#include "strata/kernels/cuda.hpp"

namespace strata::kernels {
namespace {

Status launch_status(int err, const char* what) {
  if (err == 0) return Status::Ok();
  return ::strata::detail::cuda_status(static_cast<cudaError_t>(err), what, __FILE__, __LINE__);
}

Result<detail::PassOutcome> cuda_pass(void* stream, const GridShape& shape, Pass pass, const Hyper& h,
                                      std::span<const Span> spans, const PassArgs& pa,
                                      std::span<const float> trust) {
  std::vector<GridBlock> table = plan_grid(spans, shape);
  if (table.empty()) return detail::combine_grid_partials({}, {}, spans.size());
  // One launch per dtype signature: a stable sort keeps each span's blocks in
  // table order, so the per-span sums below are in the same order as the CPU's.
  auto signature = [&](const GridBlock& b) {
    const Span& s = spans[b.span];
    return std::make_tuple(s.grad_dtype, s.param_dtype, s.state_dtype);
  };
  std::stable_sort(table.begin(), table.end(),
                   [&](const GridBlock& x, const GridBlock& y) { return signature(x) < signature(y); });
  std::vector<GridPartial> partials(table.size());
  const char* what = "";
  const int err = cudak::run_pass(stream, pass, h, spans.data(), spans.size(), table.data(), table.size(),
                                  shape.block_threads, pa, trust.empty() ? nullptr : trust.data(),
                                  partials.data(), &what);
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

Result<GradStats> cuda_grad_stats(std::span<const Span> spans, float grad_scale, void* stream,
                                  const GridShape& shape) {
  STRATA_RETURN_IF_ERROR(validate_grid_shape(shape));
  STRATA_RETURN_IF_ERROR(cuda_probe());
  std::vector<double> per_span(spans.size());
  return detail::run_grad_stats(cuda_runner(stream, shape), spans, grad_scale, per_span);
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
