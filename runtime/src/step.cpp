// Runtime::step() and flush(): ending a step — the optimizer steps still to run,
// the Inf/NaN check of deferred steps, re-planning and the step's counters.
#include <algorithm>
#include <cmath>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

Status Runtime::Impl::deferred_prepass(std::unique_lock<std::mutex>& lock, bool* skip) {
  *skip = false;
  // Data parallelism: this rank's families get the sum over ranks, the others none (Note [Sharded step]).
  STRATA_RETURN_IF_ERROR(dp().reduce_gradients(lock));
  // The 1/W averaging of data parallelism folds into the gradient scale.
  const float scale = pipeline().grad_scale / static_cast<float>(core().dp_ranks());
  // Bring every written gradient to the host, checked on the device on its way
  // (Note [Gradient check on the device]); those already on host are checked there.
  std::vector<FamilyId>& checked = book_.prepass_checked;
  std::vector<FamilyId>& on_host = book_.prepass_on_host;
  checked.clear();
  on_host.clear();
  bool checks_unwaited = false;
  for (FamilyId f = 0; f < core().layout().families.size(); ++f) {
    Chunk& g = core().chunk_mut(f, StateKind::kGrad);
    if (g.bytes == 0 || g.absent()) continue;
    bool any = false;
    for (TensorId t : core().layout().families[f].tensors) any = any || core().tensors()[t].grad_written;
    if (!any) continue;
    Status st = Status::Ok();
    if (g.dirty() && pipeline().checks_on_device()) {
      DeviceSlot& slot = residency().slot_of(g);
      st = core().device.wait(core().d2h, slot.fence);
      if (st.ok()) st = pipeline().check_on_device(f, slot.ptr, scale);
    } else {
      on_host.push_back(f);
    }
    // Its d2h copy runs after the check. With data parallelism a family whose
    // optimizer runs on the device keeps its gradient there: only this rank's
    // shard of it is the sum, and the device kernel reads it in place (Note
    // [Sharded step]); a dirty chunk is still written back if its slot is needed.
    const bool stays = core().dp_ranks() > 1 && g.dirty() && pipeline().checks_on_device() &&
                       core().plan().families[f].optim_home == Tier::kGpu;
    if (st.ok() && !stays) st = residency().ensure_on_host(g);
    checks_unwaited = checks_unwaited || stays;
    if (!st.ok()) {
      st.with_context("clipping and loss scaling keep every gradient on host until all are checked");
      return st;
    }
    checked.push_back(f);
  }
  // A check no copy waited for (a gradient that stays on the device) ends on the
  // d2h stream before its sums are read.
  if (checks_unwaited) STRATA_RETURN_IF_ERROR(core().device.synchronize(core().d2h));
  lock.unlock();
  Status st = Status::Ok();
  for (FamilyId f : on_host) {
    if (st.ok()) st = pipeline().check_on_host(f, core().chunk(f, StateKind::kGrad).host, scale);
  }
  lock.lock();
  STRATA_RETURN_IF_ERROR(st);
  // The global norm², exactly (Note [Exact norms]): the same bits in any order,
  // and with W > 1 ranks the same as one rank's.
  kernels::ExactSum norm_sq;
  bool finite = true;
  for (FamilyId f : checked) {
    const GradCheckResult& c = pipeline().grad_check(f);
    norm_sq.add(c.sum_exact);
    finite = finite && c.finite;
  }
  STRATA_RETURN_IF_ERROR(dp().agree(lock, &finite, &norm_sq));  // every rank decides alike
  const double sum_squares = norm_sq.to_double();
  if (!finite || !std::isfinite(sum_squares)) {
    *skip = true;
    return Status::Ok();
  }
  pipeline().step_scale = scale;
  if (core().opt.clip_max_norm > 0.0) {
    pipeline().step_scale *= kernels::clip_coefficient(std::sqrt(sum_squares), core().opt.clip_max_norm);
  }
  // The device copies are clean now (ensure_on_host wrote them back): the CPU
  // pipelines take the host copies; device optimizers read the device copies.
  return Status::Ok();
}

void Runtime::Impl::discard_gradients() {
  for (FamilyId f = 0; f < core().layout().families.size(); ++f) {
    Chunk& g = core().chunk_mut(f, StateKind::kGrad);
    if (g.host != nullptr) core().host->free(g.host, g.bytes);
    g.host = nullptr;
    g.move_value(ChunkValue::kAbsent);
    residency().drop_device_copy(g);
  }
  core().grads_consumed();
}

//! LAMB/LARS with W > 1: each family's run all-reduces its tensors' norms between
//! the kernel's phases, so the families run one at a time, in family order, on
//! every rank: the all-reduces are issued in the same order everywhere (Note
//! [Sharded step]). States read ahead for a later family would hold the NVMe
//! places the current one waits for: read-ahead stops.
static Status run_families_in_order(Runtime::Impl& m, std::unique_lock<std::mutex>& lock) {
  m.pipeline().stop_read_ahead();
  for (FamilyId f = 0; f < m.core().layout().families.size(); ++f) {
    if (!m.checkpoints().allows_update(f)) continue;
    m.pipeline().launch_optimizer(f);
    STRATA_RETURN_IF_ERROR(m.pipeline().wait_step_work(lock));
  }
  return Status::Ok();
}

// A plan is a promise (Note [Host room] in planner.cpp): what the run reached stays
// within what the plans adopted so far predicted. Checked builds only.
static void check_plan_kept([[maybe_unused]] const Core& core, [[maybe_unused]] const StepStats& stats) {
  STRATA_ASSERT_MSG(stats.host_high_water_bytes <= core.planned_max().host_bytes,
                    "host high water above the plan's host_bytes (Note [Host room])");
  STRATA_ASSERT_MSG(stats.gpu_high_water_bytes <= core.planned_max().gpu_bytes,
                    "GPU high water above the plan's gpu_bytes");
  // (Slots pinned by a read_tensor in progress are freed when it ends: not the plan's.)
  STRATA_ASSERT_MSG(stats.nvme_bytes <= core.planned_max().nvme_bytes || core.nvme.any_pinned(),
                    "NVMe bytes above the plan's nvme_bytes (Note [Copy-on-write NVMe slots])");
}

Result<StepStats> Runtime::step() {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (m.book().leases_out > 0) {
    return failed_precondition("step(): {} leases are still held; release every lease before step()",
                               m.book().leases_out);
  }
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  // A failed prefetch: once; nothing done (Note [Prefetch errors]).
  if (m.core().errors.background().ok()) STRATA_RETURN_IF_ERROR(m.core().errors.take_prefetch());
  // Note [Failed steps]: a step that failed, or fails here, is discarded.
  if (!m.book().step_error.ok()) return m.discard_step(lock, m.book().step_error);
  Result<StepStats> stats = m.run_step(lock);
  if (!stats.ok()) return m.discard_step(lock, stats.status());
  m.add_to_totals(*stats);
  return stats;
}

void Runtime::Impl::add_to_totals(const StepStats& st) {
  RunStats& t = book_.totals;
  ++t.steps;
  t.steps_skipped += st.applied ? 0 : 1;
  t.bytes_h2d += st.bytes_h2d;
  t.bytes_d2h += st.bytes_d2h;
  t.bytes_disk_read += st.bytes_disk_read;
  t.bytes_disk_read_param_uses += st.bytes_disk_read_param_uses;
  t.bytes_disk_read_param_updates += st.bytes_disk_read_param_updates;
  t.bytes_disk_write += st.bytes_disk_write;
  t.stall_s += st.stall_s;
  t.step_s += st.step_s;
  t.gpu_high_water_bytes = std::max(t.gpu_high_water_bytes, st.gpu_high_water_bytes);
  t.host_high_water_bytes = std::max(t.host_high_water_bytes, st.host_high_water_bytes);
  t.nvme_bytes = std::max(t.nvme_bytes, st.nvme_bytes);
  t.prefetch_errors += st.prefetch_errors;
}

Result<StepStats> Runtime::Impl::run_step(std::unique_lock<std::mutex>& lock) {
  Impl& m = *this;
  STRATA_RETURN_IF_ERROR(m.core().errors.background());
  STRATA_RETURN_IF_ERROR(m.dp().broadcast_initial(lock));  // (a step without uses)
  // Last step's gathers of params this step did not use (Note [Sharded step]).
  STRATA_RETURN_IF_ERROR(m.dp().finish_all_gathers(lock));
  lock.unlock();
  STRATA_RETURN_IF_ERROR(m.core().device.synchronize(m.core().compute));
  lock.lock();
  // Every launch so far has run: the next step's in flight are at most one
  // step's launches (Core::end_step_launches).
  m.core().end_step_launches();

  StepStats stats;
  stats.followed_plan = m.tracker().following() && !m.tracker().deviated() && m.tracker().warm();
  bool skip = false;
  m.pipeline().step_scale = m.pipeline().grad_scale;
  if (m.core().deferred()) STRATA_RETURN_IF_ERROR(m.deferred_prepass(lock, &skip));
  if (skip) {
    STRATA_LOG_WARN(
        "runtime: step {} skipped: a gradient is Inf/NaN (loss scale too high?); no state changed",
        m.tracker().step_index() + 1);
    m.discard_gradients();  // nothing is launched: no gradient is left
  }
  for (FamilyId f = 0; f < m.core().layout().families.size(); ++f) {
    STRATA_RETURN_IF_ERROR(m.checkpoints().capture_for_update(lock, f));  // Note [Overlapped save]
  }
  if (m.pipeline().exchanges_trust() && !skip) STRATA_RETURN_IF_ERROR(run_families_in_order(m, lock));
  m.schedule(lock, SchedulerEvent::kStepEnds).ignore();         // (never fails)
  STRATA_RETURN_IF_ERROR(m.checkpoints().wait_captured(lock));  // updates a save held back
  // NVMe write-backs go on past step() (Note [Write-back after step]).
  Status waited = m.pipeline().wait_step_work(lock);
  if (!waited.ok()) return waited;
  // Starts the all-gathers; the next step's uses wait for them (skip agrees on every rank).
  if (!skip) STRATA_RETURN_IF_ERROR(m.dp().gather_params(lock));
  m.dp().count_traffic(stats);  // since the last step ended: the reductions during backward count
  stats.applied = !skip && m.pipeline().all_applied();
  stats.updates_deferred = static_cast<std::uint32_t>(m.pipeline().parked());
  stats.grad_check_host_bytes = m.pipeline().take_host_check_bytes();
  if (!stats.applied && !skip) {
    STRATA_LOG_WARN("runtime: step {}: some families had Inf/NaN gradients and were not updated",
                    m.tracker().step_index() + 1);
  }

  // Trace: the compute time measured per use, then re-plan if this was the
  // warm-up step or it departed from the plan.
  StepTrace trace = m.tracker().take_trace();
  // A plan made before micro-batches were seen lacks their host room (Note [Host room]).
  const bool uncounted = m.core().accumulation_seen && !m.core().accumulation_planned();
  if (!m.tracker().warm() || m.tracker().deviated() || uncounted) {
    if (!trace.uses.empty()) STRATA_RETURN_IF_ERROR(m.adopt_plan(lock, std::move(trace), !uncounted));
    m.tracker().set_warm();
  } else {
    m.tracker().refresh(std::move(trace));  // keep the freshest compute times
  }
  m.tracker().begin_step();
  m.core().micro_batch_ended();
  m.pipeline().end_step();
  m.tracker().finish_stats(stats, m.residency().gpu_high_water());
  check_plan_kept(m.core(), stats);
  return stats;
}

Status Runtime::flush() {
  Impl& m = *impl_;
  // Outside Core::mu, which its removal never takes (Note [Stale checkpoint files]).
  m.checkpoints().wait_stale_removed();
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  STRATA_RETURN_IF_ERROR(m.pipeline().wait_all(lock));
  return m.core().errors.take_prefetch();
}

}  // namespace strata::runtime
