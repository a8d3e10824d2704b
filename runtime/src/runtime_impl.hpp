#pragma once
// Runtime::Impl: the runtime's parts and what crosses them. Not a public header.
//
//   Core               core/             shared context: lock, stores (stores.cpp), streams, thread pool,
//                                        timeline (timeline.cpp), tensors, chunks (chunk.hpp), plan,
//                                        the first error; chunk events (chunk_events.hpp)
//   StepTracker        core/step_tracker.* this step's trace, position in the adopted trace, step counters
//   Residency          residency/        device slots, host <-> device moves (residency.*), eviction
//                                        victims and prefetch (eviction.cpp), NVMe-homed params'
//                                        staging buffers (param_staging.cpp)
//   OptimizerPipeline  pipeline/         families' optimizer runs, gradient completion, the Inf/NaN
//                                        check (grad_check.cpp), staging, NVMe read-ahead and
//                                        write-back (nvme_pipeline.cpp)
//   DataParallel       dp/               data parallelism (Note [Sharded step]): gradient
//                                        reduce-scatters, param all-gathers, the initial
//                                        broadcast, agreements between ranks; a no-op for one rank
//
// Each folder's README.md says what it owns, what it may call and what calls it;
// private headers are included by their path from runtime/src ("core/core.hpp").
// Impl owns them and does what needs several: registration and finalising the
// layout (runtime.cpp), leases (leases.cpp), starting background work
// (scheduler.cpp), plan adoption and moving states between homes
// (plan_adoption.cpp), host access to any state between steps (host_copy.cpp,
// tensor_state.cpp), step() (step.cpp), a failed step's discard (step_abort.cpp),
// the checkpoint library's view of the runtime (CheckpointSource,
// checkpoint_source.cpp; the library is runtime/checkpoint/, its README.md) and
// the invariants checked after each public call
// (invariants.cpp), all in the top level of runtime/src. Planner, cost model,
// layout, trace and tensor shapes are strata_plan (runtime/plan/); they, the
// timeline and options have public headers (strata/runtime/) and do not include this one.
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
// that got no gradient this step (unused) completes at step(), or at once when the
// caller declares that tensor gradient-less for the micro-batch
// (Runtime::no_gradient; strata.torch does at backward's end: Note [Gradients in
// pieces] in strata/runtime/gradient_order.hpp). A family nothing was written to
// never completes by declarations alone.

#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "checkpoint_source.hpp"
#include "core/chunk_events.hpp"
#include "core/core.hpp"
#include "core/step_tracker.hpp"
#include "dp/data_parallel.hpp"
#include "pipeline/optimizer_pipeline.hpp"
#include "residency/residency.hpp"
#include "strata/checkpoint/checkpointer.hpp"
#include "strata/common/assert.hpp"

namespace strata::runtime {

//! The moments at which the training thread may start background work (Note [Scheduler]).
enum class SchedulerEvent : std::uint8_t { kUseBegins, kUsePlaced, kLeaseReleased, kNoGradient, kStepEnds };

//! The step's bookkeeping besides the parts' own: what the training thread's public
//! calls count and remember between them (Runtime::Impl::book).
struct StepBook {
  int leases_out = 0;  //!< leases handed out and not released
  //! The first error a public call met in the step in progress; step() discards
  //! the step then (Note [Failed steps], step_abort.cpp).
  Status step_error;
  bool states_kept = false;  //!< rehome_kept_states left some; the next acquire tries again
  //! Totals of every step() that returned its StepStats (Runtime::stats; the
  //! training thread's, like the calls that read them).
  RunStats totals;
  //! Re-plans refused and kept since the last plan adopted (Note [A re-plan refused keeps the plan]).
  std::uint64_t replans_refused = 0;
  //! deferred_prepass's family lists, reused (Note [Allocation-free hot paths] in leases.cpp).
  std::vector<FamilyId> prepass_checked, prepass_on_host;
};

//! The runtime's parts and what crosses them (the table above). A class in all but
//! the keyword (runtime.hpp declares it a struct): its data are private; the
//! top-level files reach the parts through the accessors and do what needs several
//! through the member functions.
struct Runtime::Impl {
 public:
  Impl(memory::Device& dev, RuntimeOptions options);
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  // --- the parts (runtime_impl.hpp's table) ---
  Core& core() { return parts_.core; }
  const Core& core() const { return parts_.core; }
  StepTracker& tracker() { return parts_.tracker; }
  const StepTracker& tracker() const { return parts_.tracker; }
  Residency& residency() { return parts_.residency; }
  const Residency& residency() const { return parts_.residency; }
  OptimizerPipeline& pipeline() { return parts_.pipeline; }
  const OptimizerPipeline& pipeline() const { return parts_.pipeline; }
  DataParallel& dp() { return parts_.dp; }  //!< Note [Sharded step] (dp/data_parallel.hpp)
  const DataParallel& dp() const { return parts_.dp; }
  //! The observer of chunk use (Note [Chunk events]): dp with W > 1 ranks, else none.
  ChunkEvents* events() { return parts_.core.dp_ranks() > 1 ? &parts_.dp : nullptr; }
  //! The checkpoint library's saves and loads over the runtime (Note [Overlapped save]
  //! in runtime/checkpoint/capture.cpp: the scheduler and step() ask allows_update and
  //! capture_for_update before updates).
  checkpoint::Checkpointer& checkpoints() { return checkpointing_.checkpoints; }
  //! The step's bookkeeping (StepBook).
  StepBook& book() { return book_; }
  const StepBook& book() const { return book_; }

  //! The one scheduler entry point (Note [Scheduler], scheduler.cpp): decides and
  //! starts what `event` allows; `family` and `kind` name the chunk whose lease was
  //! released (kLeaseReleased), `family` the one of the tensor declared gradient-less
  //! (kNoGradient). Returns a failed prefetch's error (kUsePlaced), which is also
  //! recorded: as the next call's error when the prefetch was a read ahead of use,
  //! else as the background error (Note [Prefetch errors]). Caller holds `lock`
  //! (a save's capture before an update may wait on it: Note [Overlapped save]).
  Status schedule(std::unique_lock<std::mutex>& lock, SchedulerEvent event, FamilyId family = 0,
                  StateKind kind = StateKind::kGrad);
  //! schedule's decision once family `family`'s gradients may have completed.
  Status start_if_complete(std::unique_lock<std::mutex>& lock, FamilyId family);
  //! Packs the registered tensors into chunk families and adopts the first plan
  //! (once, at the first acquire/init/step). Caller holds `lock`.
  Status finalize(std::unique_lock<std::mutex>& lock);
  //! Plans from `trace`, moves optimizer states whose home changes, rebuilds the
  //! device slots and makes the tracker and the pipeline follow the new plan. With
  //! `may_keep`, a re-plan the budgets refuse keeps the current plan (Note [A re-plan
  //! refused keeps the plan], plan_adoption.cpp).
  Status adopt_plan(std::unique_lock<std::mutex>& lock, StepTrace trace, bool may_keep = false);
  //! Moves the chunks whose home changes between the current plan and `p`
  //! (Note [Migration order]).
  Status migrate_homes(std::unique_lock<std::mutex>& lock, const Plan& p);
  //! Moves one chunk to its new home `to`; OutOfBudget, changing nothing, where `to` has no room.
  Status migrate_chunk(std::unique_lock<std::mutex>& lock, Chunk& c, bool param, Tier to);
  //! Keeps the current plan after `refused` (Note [A re-plan refused keeps the plan]).
  void keep_plan(const Status& refused);
  //! Gradients to host and one global check (clipping, loss scaling); sets the
  //! pipeline's step scale. *skip is set when an Inf/NaN skips the step.
  Status deferred_prepass(std::unique_lock<std::mutex>& lock, bool* skip);
  //! Drops every gradient of a step skipped for Inf/NaN.
  void discard_gradients();
  void add_to_totals(const StepStats& st);
  // Note [Failed steps] (step_abort.cpp).
  //! Records `st` (an error of a public call mid-step) as the step's (unless not
  //! fails_step: a failed prefetch) and waits (unlocking) for the compute stream,
  //! so the caller may free what its launches captured; returns `st`.
  Status poison_step(std::unique_lock<std::mutex>& lock, Status st, bool fails_step = true);
  //! Discards the step in progress: waits for all background work (unlocking),
  //! drops its gradients, forgets its trace and clears the runtime's errors.
  //! Returns `cause` with the discard named.
  Status discard_step(std::unique_lock<std::mutex>& lock, Status cause);
  //! step()'s work once its preconditions hold; an error makes step() discard the step.
  Result<StepStats> run_step(std::unique_lock<std::mutex>& lock);
  //! Writes the NVMe-homed states a failed write-back kept in host memory (Note
  //! [Write-back after step]) home again, freeing their host room; unlocks while
  //! writing. False (and states_kept set) when some stay.
  bool rehome_kept_states(std::unique_lock<std::mutex>& lock);
  //! Runs fn on a host copy of family f's chunk of kind k (reading NVMe into a
  //! temporary when it lives there); with write, the change is stored back to its home. With whole (and
  //! write), fn overwrites every byte of the chunk, so an NVMe copy is not read
  //! first: fn gets zeros. Blocks.
  Status with_host_copy(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k, bool write,
                        const std::function<void(std::byte*)>& fn, bool whole = false);
  //! The checks of Note [Chunk state machine] and Note [Pipeline places]; aborts
  //! on a violation. Caller holds mu.
  void check_invariants() const;

 private:
  //! The parts of the table above, each built on those before it.
  struct Parts {
    Parts(Runtime::Impl& m, memory::Device& dev, RuntimeOptions options);
    Core core;
    StepTracker tracker;
    Residency residency;
    OptimizerPipeline pipeline;
    DataParallel dp;
  };
  //! The runtime as the checkpoint library sees it, and the library over it.
  struct Checkpointing {
    explicit Checkpointing(Runtime::Impl& m) : source(m), checkpoints(source) {}
    CheckpointSource source;
    checkpoint::Checkpointer checkpoints;
  };

  Parts parts_;
  Checkpointing checkpointing_{*this};
  StepBook book_;
};

inline Runtime::Impl::Parts::Parts(Runtime::Impl& m, memory::Device& dev, RuntimeOptions options)
    : core(dev, std::move(options)),
      tracker(core),
      residency(core, tracker),
      pipeline(core, residency),
      dp(core, tracker, residency, pipeline,
         [&m](std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k, bool write,
              const std::function<void(std::byte*)>& fn,
              bool whole) { return m.with_host_copy(lock, f, k, write, fn, whole); }) {
  residency.read_progress(pipeline);
  residency.read_dp_flags(dp.flags());
}

inline Runtime::Impl::Impl(memory::Device& dev, RuntimeOptions options)
    : parts_(*this, dev, std::move(options)) {}

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
