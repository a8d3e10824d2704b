// OptimizerPipeline: updates deferred into the next forward (optimizer_pipeline.hpp).
//
// Note [Deferred updates]
// During forward the disk has little to do: a family's states can only be read
// into host room, and its update waits for its gradient, which backward makes.
// The families whose gradients complete first in backward (the last layers) are
// the ones the next forward uses last, so their updates can wait for it
// (PlanOptions::deferred_updates of them, the first of the NVMe completion order):
//   - in backward such a family is launched as any other, but *parked*: its
//     gradient lands on host in a room of its own (the plan counts one largest
//     gradient per deferred family, Note [Host room]) and it takes no NVMe place,
//     so the other families' states go first. It holds nothing else: a host copy
//     of its gradient written back before the last piece came is stale and freed
//     when the gradient lands (else, held to the next forward, the parked families
//     filled the room for gradients written back in backward, Note [Host room]);
//   - step() waits for every other family, not for the parked ones (their
//     gradients landed), and then *carries* them: they take NVMe places in the
//     order the next forward uses them, read their states, update and write back
//     while that forward computes. Their lr, weight decay and gradient scale are
//     the ones of the step they belong to, captured when it ended, so a scheduler
//     stepped after optimizer.step() changes the next step, as without deferral;
//   - a use of a carried family's param waits for its update (Runtime::acquire's
//     wait for a family whose optimizer runs), so the math is the same update,
//     before the same use. Whatever reads or changes state between steps
//     (read_tensor, write_tensor, init_tensor, checkpoints, tensor_steps,
//     set_tensor_group, flush, the destructor) waits for them first;
//   - a failure in a carried update surfaces from the next call, as a failed
//     write-back does (Note [Write-back after step]); an access in the step itself
//     that needs a parked family (release_parked), any wait_all and any failure
//     end the parking: the update then runs in its own step, as without deferral.
// Not with loss scaling, clipping or data parallelism (the optimizers run at step()).
//

#include <algorithm>

#include "pipeline/optimizer_pipeline.hpp"

namespace strata::runtime {

void OptimizerPipeline::carry(FamilyId f) {
  FamilyRun& run = runs_[f];
  STRATA_CHECK(run.parked() && run.grad_landed() && run.place == NvmePlace::kNone);
  run.move_deferral(Deferral::kCarried);
  --parked_;
  ++carried_;
  // What compute_family would have taken in this step (Note [Deferred updates]).
  const GradCheckResult& check = checks_[f];
  run.carried_scale = check.valid && !core_.deferred() ? check.scale : step_scale;
  std::uint32_t groups = 1;
  for (TensorId t : core_.layout().families[f].tensors)
    groups = std::max(groups, core_.tensors()[t].group + 1);
  KernelCall& call = calls_[f];
  call.hypers.clear();
  for (std::uint32_t g = 0; g < groups; ++g) call.hypers.push_back(core_.hyper(g));
}

void OptimizerPipeline::unpark(FamilyId f) {
  FamilyRun& run = runs_[f];
  if (!run.parked()) return;
  run.move_deferral(Deferral::kNone);
  --parked_;
}

void OptimizerPipeline::release_parked(FamilyId f) {
  if (!runs_[f].parked()) return;
  unpark(f);
  pump();
}

bool OptimizerPipeline::busy() const {
  return tasks_in_flight_ > 0 && (parked_ == 0 || !only_parked_left());
}

bool OptimizerPipeline::only_parked_left() const {
  int parked = 0;
  for (const FamilyRun& run : runs_) parked += run.parked() && run.grad_landed() ? 1 : 0;
  return parked == tasks_in_flight_;
}

}  // namespace strata::runtime
