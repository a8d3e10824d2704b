// Runtime::Impl::schedule: where the training thread starts background work.
//
// Note [Scheduler]
// Public calls start background work in one place, Runtime::Impl::schedule: they
// record what happened (a lease unpinned, a gradient written, a tensor declared
// gradient-less) and name the moment (SchedulerEvent); schedule decides what that
// allows and starts it. The call sites decide nothing: release() and no_gradient()
// do not ask whether a family's gradients are complete, whether a save must capture
// it first, or whether its update may start; schedule asks each once.
//   kUseBegins   (acquire, before its chunk is placed): the first use of a
//                planned step starts reading NVMe states ahead (Note [Pipeline
//                places]);
//   kUsePlaced   (acquire, after): params of the next traced uses are
//                prefetched (Note [Idle victims first]); a failed read ahead is
//                counted and the next call's error, once; a failed slot move the
//                runtime's error from then on (Note [Prefetch errors]);
//   kLeaseReleased (release of any lease) and kNoGradient (Runtime::no_gradient):
//                a grad or param lease's release, or a declaration, may complete
//                its family: a family whose gradients are complete and unleased
//                starts its optimizer step at once (Note [Gradient completion]
//                promises it), once a save in flight captured its pre-update
//                values (Note [Overlapped save]), so releasing that lease — by
//                Lease::release or a Lease's destructor — starts it; runtime.hpp
//                says so on Lease, and Lease::release returns
//                Released::kOptimizerStarted then, so a call site can see it;
//                other states' leases start nothing; with data parallelism the
//                event goes to the chunk-events observer instead, which starts the
//                reduce-scatter of each round of families whose gradients are
//                complete (Note [Chunk events], Note [Sharded step]);
//   kStepEnds    (step()): every family not started yet starts, read-ahead
//                stops, the pipeline takes what its places allow. (step() itself
//                captures every family for a save first, and with LAMB/LARS over
//                W > 1 ranks launches the families one at a time in family order
//                before this event: Note [Sharded step].)
// Background work advances itself after that: pool tasks and I/O completions
// call OptimizerPipeline::pump under the lock, never through here.
#include "runtime_impl.hpp"

namespace strata::runtime {

Status Runtime::Impl::schedule(std::unique_lock<std::mutex>& lock, SchedulerEvent event, FamilyId family,
                               StateKind kind) {
  switch (event) {
    case SchedulerEvent::kUseBegins:
      if (tracker().warm() && core().opt.plan.prefetch) pipeline().start_read_ahead();
      return Status::Ok();
    case SchedulerEvent::kUsePlaced:
      return residency().prefetch();
    case SchedulerEvent::kLeaseReleased:
      // Only a grad or param lease holds an update back (Note [Gradient completion]).
      if (kind != StateKind::kGrad && kind != StateKind::kParam) return Status::Ok();
      return start_if_complete(lock, family);
    case SchedulerEvent::kNoGradient:
      return start_if_complete(lock, family);
    case SchedulerEvent::kStepEnds:
      for (FamilyId f = 0; f < core().layout().families.size(); ++f) {
        if (checkpoints().allows_update(f)) pipeline().launch_optimizer(f);
      }
      pipeline().stop_read_ahead();
      pipeline().pump();
      return Status::Ok();
  }
  return Status::Ok();
}

Status Runtime::Impl::start_if_complete(std::unique_lock<std::mutex>& lock, FamilyId family) {
  if (events() !=
      nullptr) {  // W > 1: the reduction starts now, the optimizer at step() (Note [Chunk events])
    Status st = events()->on_gradients_handed_over();
    if (!st.ok()) core().errors.fail(st);
    return st;
  }
  if (core().deferred() || !pipeline().gradients_complete(family)) return Status::Ok();
  // Note [Overlapped save]: the save captures the pre-update values first (a failed
  // capture: the save holds the update back, allows_update says so).
  checkpoints().capture_for_update(lock, family).ignore();
  if (checkpoints().allows_update(family)) pipeline().launch_optimizer(family);
  return Status::Ok();
}

}  // namespace strata::runtime
