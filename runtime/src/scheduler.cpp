// Runtime::Impl::schedule: where the training thread starts background work.
//
// Note [Scheduler]
// Public calls start background work in one place, Runtime::Impl::schedule, and
// name the moment at the call site (SchedulerEvent):
//   kUseBegins   (acquire, before its chunk is placed): the first use of a
//                planned step starts reading NVMe states ahead (Note [Pipeline
//                places]);
//   kUsePlaced   (acquire, after): params of the next traced uses are
//                prefetched (Note [Idle victims first]); a failed read ahead is
//                counted and the next call's error, once; a failed slot move the
//                runtime's error from then on (Note [Prefetch errors]);
//   kGradientsHandedOver (release of a grad or param lease): a family whose
//                gradients are complete and unleased starts its optimizer step
//                at once (Note [Gradient completion] promises it), so releasing
//                that lease — by Lease::release or a Lease's destructor — starts
//                it; runtime.hpp says so on Lease, and Lease::release returns
//                Released::kOptimizerStarted then, so a call site can see it;
//                with data parallelism the event goes to the chunk-events
//                observer instead, which starts the reduce-scatter of each
//                round of families whose gradients are complete (Note [Chunk
//                events], Note [Sharded step]);
//   kStepEnds    (step()): every family not started yet starts, read-ahead
//                stops, the pipeline takes what its places allow.
// Background work advances itself after that: pool tasks and I/O completions
// call OptimizerPipeline::pump under the lock, never through here.
#include "runtime_impl.hpp"

namespace strata::runtime {

Status Runtime::Impl::schedule(SchedulerEvent event, FamilyId family) {
  switch (event) {
    case SchedulerEvent::kUseBegins:
      if (tracker.warm() && core.opt.plan.prefetch) pipeline.start_read_ahead();
      return Status::Ok();
    case SchedulerEvent::kUsePlaced:
      return residency.prefetch();
    case SchedulerEvent::kGradientsHandedOver:
      if (events !=
          nullptr) {  // W > 1: the reduction starts now, the optimizer at step() (Note [Chunk events])
        Status st = events->on_gradients_handed_over();
        if (!st.ok()) core.errors.fail(st);
        return st;
      }
      if (!core.deferred() && pipeline.gradients_complete(family) && checkpoints.allows_update(family))
        pipeline.launch_optimizer(family);
      return Status::Ok();
    case SchedulerEvent::kStepEnds:
      for (FamilyId f = 0; f < core.layout().families.size(); ++f) {
        if (checkpoints.allows_update(f)) pipeline.launch_optimizer(f);
      }
      pipeline.stop_read_ahead();
      pipeline.pump();
      return Status::Ok();
  }
  return Status::Ok();
}

}  // namespace strata::runtime
