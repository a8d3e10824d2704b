// Runtime: what a failed step leaves behind — the step is discarded so the
// runtime stays usable (Runtime::abort_step, and step() when it fails).
//
// Note [Failed steps]
// Any error leaves a runtime that trains on once its cause is gone, or that
// closes cleanly; it never goes on silently with half a step.
//   - A public call that fails in the middle of a step (acquire, launch) marks
//     the step failed (StepBook::step_error) and, before it returns, waits for the
//     work already launched on the compute stream: a caller that unwinds on the
//     error may free what that work captured (the example's model). A lease
//     destroyed by an exception's unwinding (an exception thrown between acquire
//     and release) does the same, and hands no gradient over: the half-written
//     gradient never reaches the optimizer.
//   - step() of a failed step, any error step() meets (a background error: an
//     NVMe EIO, a CRC mismatch, OutOfBudget in a background task; a dead peer),
//     and abort_step() discard the step: every piece of background work is
//     waited for (Note [Failed work completes its waiters]), every gradient of
//     the step (micro-batches included) is dropped, its trace is forgotten (the
//     step counter does not advance), and the runtime's error is cleared. step()
//     returns the error; the next step starts clean, and fails again only if the
//     cause is still there.
//   - What the failed step changed stays: a family whose optimizer step ended
//     before the failure keeps its update (and its step counter), a failed NVMe
//     write-back keeps the updated states in host memory as their value (Note
//     [Write-back after step]); every other family holds its value before the
//     step (Note [Copy-on-write NVMe slots]). So each family holds its last good
//     value, which read_tensor and save_checkpoint return. States a failed
//     write-back kept in host memory go home to NVMe when the step is discarded
//     (they hold host room the plan gave to staging); if the disk still fails
//     they stay, and the next step's first acquire tries again (once the disk
//     works they go home; else that step meets the cause again).
//   - A failed prefetch is not a failed step (Note [Prefetch errors]): its call
//     returns the error once and did nothing; the caller may call again.
#include "runtime_impl.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

Status Runtime::Impl::poison_step(std::unique_lock<std::mutex>& lock, Status st, bool fails_step) {
  if (st.ok()) return st;
  if (fails_step && book_.step_error.ok()) book_.step_error = st;
  // The caller may free what its launches captured as soon as this returns.
  lock.unlock();
  core().device.synchronize(core().compute).ignore();
  lock.lock();
  return st;
}

bool Runtime::Impl::rehome_kept_states(std::unique_lock<std::mutex>& lock) {
  book_.states_kept = false;
  if (!core().nvme.is_open()) return true;
  for (Chunk& c : core().chunks_mut()) {
    const bool nvme_home = c.bytes > 0 && ((is_optim_kind(c.kind) && core().on_nvme(c.family)) ||
                                           (c.kind == StateKind::kParam && core().param_on_nvme(c.family)));
    if (!nvme_home || c.value != ChunkValue::kHost || c.readers > 0 || c.writers > 0) continue;
    // (Device copies are clean and every stream is idle: nothing reads c.host now.)
    Status st = core().nvme_transfer(lock, true, std::span<std::byte>(c.host, c.bytes), c.nvme_slots);
    if (!st.ok()) {
      STRATA_LOG_WARN("runtime: family {} {} stays in host memory: {}", c.family, state_kind_name(c.kind),
                      st.to_string());
      book_.states_kept = true;
      continue;
    }
    core().host->free(c.host, c.bytes);
    c.host = nullptr;
    c.move_value(ChunkValue::kNvme);
  }
  return !book_.states_kept;
}

Status Runtime::Impl::discard_step(std::unique_lock<std::mutex>& lock, Status cause) {
  if (!core().finalized()) return cause;  // nothing ran yet: nothing to discard
  const std::uint64_t step = tracker().step_index() + 1;
  pipeline().stop_read_ahead();
  pipeline().wait_all(lock).ignore();  // (Note [Failed work completes its waiters])
  residency().wait_staging_reads(lock);
  lock.unlock();
  // The caller's launches of the step still write its gradients' slots (and
  // data-parallel packs their rounds' buffers).
  core().device.synchronize().ignore();
  lock.lock();
  if (core().dp_ranks() > 1) dp().abandon_rounds(lock);
  discard_gradients();
  pipeline().abandon_step();
  tracker().abandon_step();
  core().micro_batch_ended();
  core().forget_step_launches();
  core().errors.clear();
  book_.step_error = Status::Ok();
  rehome_kept_states(lock);
  if (!cause.ok()) {
    STRATA_LOG_WARN(
        "runtime: step {} discarded after an error; families updated before it keep their update, every "
        "other state is as before the step (Note [Failed steps]): {}",
        step, cause.to_string());
    cause.with_context(
        fmt::format("step {} was discarded (its gradients dropped; the runtime trains on with the next step "
                    "once the cause is gone)",
                    step));
  }
  return cause;
}

Status Runtime::abort_step() {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (m.book().leases_out > 0) {
    return failed_precondition("abort_step: {} leases are still held; release (or destroy) them first",
                               m.book().leases_out);
  }
  return m.discard_step(lock, Status::Ok());
}

}  // namespace strata::runtime
