#pragma once
// CUDA multi-tensor kernels (Note [Emulated grid] in grid_index.hpp): the same passes
// as the CPU step, over spans in device memory, one launch per pass and dtype
// signature. Built only with STRATA_HAVE_CUDA; otherwise every call returns
// Unavailable saying so. This header has no CUDA types: streams are void*.

#include <cstddef>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/kernels/grid.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/kernels/q8.hpp"

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
//! returns once the step's partial sums are back on the host: each pass waits
//! for its own event, not for the stream, and uses this thread's scratch
//! (allocated once, grown on demand). Fails as step(), plus Unavailable/Internal
//! from CUDA.
Result<StepReport> cuda_step(const StepArgs& args, void* stream = nullptr, const GridShape& shape = {});

//! The scratch of cuda_step_enqueue: device buffers and pinned host staging,
//! allocated at the first use and grown on demand (never per pass), and an
//! event recorded when the step's results are back in host memory. Move-only;
//! one per step in flight (a second enqueue waits for the first's uploads).
class CudaStepScratch {
 public:
  CudaStepScratch() = default;
  ~CudaStepScratch();
  CudaStepScratch(CudaStepScratch&& other) noexcept;
  CudaStepScratch& operator=(CudaStepScratch&& other) noexcept;
  CudaStepScratch(const CudaStepScratch&) = delete;
  CudaStepScratch& operator=(const CudaStepScratch&) = delete;
  //! The cudaEvent_t recorded after the last enqueued step's results landed
  //! (null before the first enqueue).
  void* event() const;

 private:
  friend Status cuda_step_enqueue(const StepArgs&, CudaStepScratch&, void*, const GridShape&);
  friend Result<StepReport> cuda_step_finish(CudaStepScratch&);
  void* check_ = nullptr;   //!< cudak::PassScratch of the gradient check
  void* update_ = nullptr;  //!< cudak::PassScratch of the update
  std::vector<GridBlock> table_;
  std::size_t span_count_ = 0;
  bool checked_on_device_ = false;  //!< the check ran on the device; the update was gated by it
  bool skipped_ = false;            //!< kCallerChecked with a non-finite check: nothing enqueued
  bool enqueued_ = false;
};

//! step() on `stream` that returns as soon as it is enqueued, with no host
//! synchronisation: scratch reused, uploads from pinned staging, the results
//! copied back into it and its event recorded. With GradCheck::kSeparatePass
//! the check pass and a one-block flag kernel run first, and every block of the
//! update skips when the flag says a gradient was non-finite, so nothing is
//! written then (Note [Inf/NaN and untouched states]). For every optimizer but
//! LAMB and LARS (their trust ratios need the host between phases: use
//! cuda_step) and CAME. Fails as step() (InvalidArgument, before anything is
//! enqueued), plus Unavailable/Internal from CUDA.
Status cuda_step_enqueue(const StepArgs& args, CudaStepScratch& scratch, void* stream,
                         const GridShape& shape = {});
//! Waits for the scratch's event (not the stream) and reports the step enqueued
//! last: grads_finite false and nothing applied when the device check found
//! Inf/NaN; FailedPrecondition as step() when a caller-checked gradient was
//! non-finite in the update. Call it once per enqueue; not from a stream callback.
Result<StepReport> cuda_step_finish(CudaStepScratch& scratch);

//! grad_stats() on the GPU (same conditions as cuda_step).
Result<GradStats> cuda_grad_stats(std::span<const Span> spans, float grad_scale, void* stream = nullptr,
                                  const GridShape& shape = {});

//! step_q8() on the GPU (Note [Q8 on CUDA] in kernels/src/cuda/cuda_q8.cu): the
//! spans' buffers in device or managed memory; args.pool and args.isa are
//! ignored; kSeparatePass checks the gradients on the device first. The same
//! bits as the CPU kernels. Runs on `stream` (a cudaStream_t, null = default)
//! and blocks until done. Fails as step_q8(), plus Unavailable/Internal from CUDA.
Result<StepReport> cuda_step_q8(const Q8StepArgs& args, void* stream = nullptr);

//! Device STREAM triad a = b + s c over n floats, timed with events: the best
//! GB/s (3 x 4 bytes per element) of `repeats` runs. For the GPU benchmark's baseline.
Result<double> cuda_triad_gb_s(std::size_t n, int repeats);

//! Synchronises the device (for benchmarks timing whole steps). Fails as cuda_probe.
Status cuda_synchronize();

}  // namespace strata::kernels
