#pragma once
// CUDA multi-tensor kernels (Note [Emulated grid] in grid.hpp): the same passes
// as the CPU step, over spans in device memory, one launch per pass and dtype
// signature. Built only with STRATA_HAVE_CUDA; otherwise every call returns
// Unavailable saying so. This header has no CUDA types: streams are void*.

#include <cstddef>

#include "strata/common/status.hpp"
#include "strata/kernels/grid.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::kernels {

//! Ok when this build has CUDA and a device is usable; else Unavailable with the
//! reason (built without CUDA, no driver, no device). Thread-safe; never aborts.
Status cuda_probe();

//! A device (or managed) allocation. Move-only; frees on destruction.
class CudaBuffer {
 public:
  //! Allocates bytes (cudaMalloc, or cudaMallocManaged when managed). Fails:
  //! Unavailable without CUDA/device, OutOfMemory when the device is full.
  static Result<CudaBuffer> allocate(std::size_t bytes, bool managed);
  CudaBuffer() = default;
  ~CudaBuffer();
  CudaBuffer(CudaBuffer&& other) noexcept;
  CudaBuffer& operator=(CudaBuffer&& other) noexcept;
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;
  void* data() const { return data_; }
  std::size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

//! step() on the GPU: spans point to device or managed memory; args.pool and
//! args.isa are ignored. Runs on `stream` (a cudaStream_t, null = default) and
//! returns after the stream has finished the step (partial sums come back to
//! the host). Fails as step(), plus Unavailable/Internal from CUDA.
Result<StepReport> cuda_step(const StepArgs& args, void* stream = nullptr, const GridShape& shape = {});

//! grad_stats() on the GPU (same conditions as cuda_step).
Result<GradStats> cuda_grad_stats(std::span<const Span> spans, float grad_scale, void* stream = nullptr,
                                  const GridShape& shape = {});

//! Device STREAM triad a = b + s c over n floats, timed with events: the best
//! GB/s (3 x 4 bytes per element) of `repeats` runs. For the GPU benchmark's baseline.
Result<double> cuda_triad_gb_s(std::size_t n, int repeats);

//! Synchronises the device (for benchmarks timing whole steps). Fails as cuda_probe.
Status cuda_synchronize();

}  // namespace strata::kernels
