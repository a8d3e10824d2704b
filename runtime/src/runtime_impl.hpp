#pragma once
// Runtime::Impl: the runtime's parts and what crosses them. Not a public header.
//
//   Core               core.hpp          shared context: stores, streams, lock, tensors, chunks, plan,
//   timeline StepTracker        step_tracker.*    trace, position in the adopted trace, step counters
//   Residency          residency.*,      device slots, host <-> device moves, eviction victims, prefetch
//                      eviction.cpp
//   OptimizerPipeline  optimizer_*.*,    families' optimizer runs, gradient completion and staging,
//                      nvme_pipeline.cpp NVMe read-ahead and write-back
//
// Impl owns them and does what needs several: registration and finalising the
// layout (runtime.cpp), leases (leases.cpp), starting background work
// (scheduler.cpp), plan adoption and moving states
// between homes (plan_adoption.cpp), host access to any state between steps
// (host_copy.cpp, tensor_state.cpp) and step() (step.cpp).
//
// Note [Gradient completion]
// A family's gradients are complete when every trainable tensor in it has had
// its gradient written (a write or accumulate lease released) in the last
// micro-batch, and its optimizer step starts when, besides, no lease holds its
// gradient or its param (so the update never races a reader). The contract that
// makes completion exact: within one micro-batch each
// tensor's gradient is handed over once (tied uses are accumulated by the caller
// first, as torch's post-accumulate-grad hook does); a second write lease in the
// same micro-batch is refused. Its optimizer step then starts at once (unless
// clipping or loss scaling defer every step to step()). A family with a tensor
// that got no gradient this step (unused) completes at step().

#include <functional>
#include <memory>
#include <mutex>

#include "core.hpp"
#include "optimizer_pipeline.hpp"
#include "residency.hpp"
#include "step_tracker.hpp"
#include "strata/common/assert.hpp"

namespace strata::runtime {

//! The moments at which the training thread starts background work (Note [Scheduler]).
enum class SchedulerEvent : std::uint8_t { kUseBegins, kUsePlaced, kGradientsHandedOver, kStepEnds };

struct Runtime::Impl {
  Impl(memory::Device& dev, RuntimeOptions options)
      : core(dev, std::move(options)),
        tracker(core),
        residency(core, tracker, pipeline),
        pipeline(core, residency) {}

  Core core;
  StepTracker tracker;
  Residency residency;
  OptimizerPipeline pipeline;
  int leases_out = 0;

  //! The one scheduler entry point (Note [Scheduler], scheduler.cpp): starts what
  //! `event` allows; `family` is the one whose lease was released
  //! (kGradientsHandedOver). Returns a failed prefetch's error (kUsePlaced), which
  //! is also recorded as the background error. Caller holds mu.
  Status schedule(SchedulerEvent event, FamilyId family = 0);
  //! Packs the registered tensors into chunk families and adopts the first plan
  //! (once, at the first acquire/init/step). Caller holds `lock`.
  Status finalize(std::unique_lock<std::mutex>& lock);
  //! Plans from `trace`, moves optimizer states whose home changes, rebuilds the
  //! device slots and makes the tracker and the pipeline follow the new plan.
  Status adopt_plan(std::unique_lock<std::mutex>& lock, StepTrace trace);
  //! Moves optimizer states whose home changes between the current plan and `p`.
  Status migrate_homes(std::unique_lock<std::mutex>& lock, const Plan& p);
  //! Gradients to host and one global check (clipping, loss scaling); sets the
  //! pipeline's step scale. *skip is set when an Inf/NaN skips the step.
  Status deferred_prepass(std::unique_lock<std::mutex>& lock, bool* skip);
  //! deferred_prepass's family lists, reused (Note [Allocation-free hot paths] in leases.cpp).
  std::vector<FamilyId> prepass_checked, prepass_on_host;
  //! Drops every gradient of a step skipped for Inf/NaN.
  void discard_gradients();
  // Data parallelism (data_parallel.cpp, Note [Sharded step]); no-ops for one rank.
  //! Compares this rank's tensors and options with rank 0's; FailedPrecondition
  //! naming the first difference. Blocks until every rank arrived (or the timeout).
  Status dp_check_config(std::unique_lock<std::mutex>& lock);
  //! Reduce-scatters the gradients: this rank's families get the sum over ranks,
  //! the others' are dropped. Unlocks while waiting for the other ranks.
  Status dp_reduce_gradients(std::unique_lock<std::mutex>& lock);
  //! Agrees on the step's grad norm² (sum) and Inf/NaN (max) over ranks.
  Status dp_agree(std::unique_lock<std::mutex>& lock, bool* finite, double* sum_squares);
  //! All-gathers the updated params of every rank's families. Unlocks while waiting.
  Status dp_gather_params(std::unique_lock<std::mutex>& lock);
  //! Runs fn on a host copy of chunk c (reading NVMe into a temporary when it lives
  //! there); with write, the change is stored back to c's home. With whole (and
  //! write), fn overwrites every byte of the chunk, so an NVMe copy is not read
  //! first: fn gets zeros. Blocks.
  Status with_host_copy(std::unique_lock<std::mutex>& lock, Chunk& c, bool write,
                        const std::function<void(std::byte*)>& fn, bool whole = false);
  //! The checks of Note [Chunk state machine] and Note [Pipeline places]; aborts
  //! on a violation. Caller holds mu.
  void check_invariants() const;
};

//! Runs Runtime::Impl::check_invariants when it goes out of scope, in checked
//! builds: declared right after a public call takes the lock, it checks what the
//! call left (and skips the check when the call returns with the lock released).
class InvariantCheck {
 public:
  explicit InvariantCheck(const Runtime::Impl& m, const std::unique_lock<std::mutex>* lock = nullptr)
      : m_(m), lock_(lock) {}
  InvariantCheck(const InvariantCheck&) = delete;
  InvariantCheck& operator=(const InvariantCheck&) = delete;
  ~InvariantCheck() {
    if constexpr (STRATA_CHECKED_BUILD) {
      if (lock_ == nullptr || lock_->owns_lock()) m_.check_invariants();
    }
  }

 private:
  const Runtime::Impl& m_;
  const std::unique_lock<std::mutex>* lock_;
};

//! Synthetic trace before the first step: forward in packing order, backward in reverse.
StepTrace registration_trace(std::size_t families);

}  // namespace strata::runtime
