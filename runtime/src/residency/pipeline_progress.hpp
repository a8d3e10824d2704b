#pragma once
// PipelineProgress: what Residency reads of the optimizer pipeline's per-family
// progress, and nothing more. OptimizerPipeline (pipeline/) implements it, so that
// Residency depends on this interface and the pipeline sits on top of Residency
// (the pipeline calls Residency; Residency never calls the pipeline). Every
// function expects Core::mu held (Note [Lock discipline] in core/core.hpp).

#include <cstddef>

#include "strata/runtime/tensor.hpp"

namespace strata::runtime {

class PipelineProgress {
 public:
  //! Family f's optimizer has been requested this step: its gradient is the
  //! pipeline's (eviction leaves it; the pipeline's consuming it frees its slot).
  virtual bool claims_gradient(FamilyId f) const = 0;
  //! Family f's optimizer step is requested and not finished (its param is not
  //! prefetched nor evicted into a stale copy).
  virtual bool updating(FamilyId f) const = 0;
  //! Family f's optimizer will copy its NVMe-homed param from its staging buffer
  //! (Note [NVMe-homed params]): a read ahead keeps that buffer if it can.
  virtual bool awaits_staged_param(FamilyId f) const = 0;
  //! Some optimizer step is in flight: it will free slots and notify Core::cv.
  virtual bool busy() const = 0;
  //! Families some of whose trainable tensors handed their gradient over in this
  //! micro-batch, not all (Runtime::incomplete_gradients_max() bounds them).
  virtual std::size_t incomplete_families() const = 0;

 protected:
  PipelineProgress() = default;
  PipelineProgress(const PipelineProgress&) = default;
  PipelineProgress& operator=(const PipelineProgress&) = default;
  ~PipelineProgress() = default;
};

}  // namespace strata::runtime
