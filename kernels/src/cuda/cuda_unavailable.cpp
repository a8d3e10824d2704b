// The CUDA entry points of a build without CUDA (STRATA_HAVE_CUDA off): each
// says so, so callers fall back to the CPU kernels and log why.
#include "strata/kernels/cuda.hpp"

namespace strata::kernels {
namespace {
Status no_cuda() {
  return unavailable(
      "strata was built without CUDA (nvcc not found or STRATA_CUDA=OFF); use the CPU kernels");
}
}  // namespace

Status cuda_probe() {
  return no_cuda();
}
Result<CudaBuffer> CudaBuffer::allocate(std::size_t, bool) {
  return no_cuda();
}
CudaBuffer::~CudaBuffer() = default;
CudaBuffer::CudaBuffer(CudaBuffer&& other) noexcept : data_(other.data_), bytes_(other.bytes_) {
  other.data_ = nullptr;
  other.bytes_ = 0;
}
CudaBuffer& CudaBuffer::operator=(CudaBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}
Result<StepReport> cuda_step(const StepArgs&, void*, const GridShape&) {
  return no_cuda();
}
CudaStepScratch::~CudaStepScratch() = default;
CudaStepScratch::CudaStepScratch(CudaStepScratch&&) noexcept = default;
CudaStepScratch& CudaStepScratch::operator=(CudaStepScratch&&) noexcept = default;
void* CudaStepScratch::event() const {
  return nullptr;
}
Status cuda_step_enqueue(const StepArgs&, CudaStepScratch&, void*, const GridShape&) {
  return no_cuda();
}
Result<StepReport> cuda_step_finish(CudaStepScratch&) {
  return no_cuda();
}
Result<GradStats> cuda_grad_stats(std::span<const Span>, float, void*, const GridShape&) {
  return no_cuda();
}
Result<StepReport> cuda_step_q8(const Q8StepArgs&, void*) {
  return no_cuda();
}
Result<double> cuda_triad_gb_s(std::size_t, int) {
  return no_cuda();
}
Status cuda_synchronize() {
  return no_cuda();
}

}  // namespace strata::kernels
