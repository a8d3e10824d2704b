// OptimizerPipeline: scheduling a family's optimizer step and the bounded
// resources it takes (optimizer_pipeline.hpp). NVMe reads and write-backs are in
// nvme_pipeline.cpp, the kernels' runs in optimizer_run.cpp.
//
// Note [Pipeline places]
// Two bounded resources gate the pipeline, each reserved by the planner:
//   - grad staging buffers (grad_staging_slots): a family holds one from the moment its
//     gradient is copied to host until the CPU kernel has consumed it;
//   - NVMe places (nvme_families_in_flight): an NVMe family holds one from the
//     moment its states are read into staging until they are written back.
// They are taken independently, so a host family never waits behind NVMe I/O.
// NVMe reads run ahead: as soon as a place is free, the states of the next NVMe
// family in the traced completion order are read, even before its gradients
// exist (during forward), so by the time its gradients land only the kernel and
// the write-back remain. A family whose gradients are complete but that has no
// place takes one from a read-ahead family that is not launched yet, so an
// out-of-order step cannot wait on a read-ahead that waits on it.
//
#include "pipeline/optimizer_pipeline.hpp"

#include <algorithm>
#include <limits>

#include "residency/residency.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

void OptimizerPipeline::init(std::size_t family_count) {
  runs_.assign(family_count, FamilyRun{});
  writebacks_.assign(family_count, WriteBack{});
  defer_.assign(family_count, 0);
  trainable.assign(family_count, 0);
  grads_written_.assign(family_count, 0);
  grads_none_.assign(family_count, 0);
  grad_queue_.clear();
  grad_queue_.reserve(family_count);  // a steady step allocates nothing
  launch_fifo_.clear();
  launch_fifo_.reserve(family_count);
  checks_.assign(family_count, GradCheckResult{});
  calls_.clear();
  calls_.resize(family_count);
  cuda_scratch_.clear();
  cuda_scratch_.resize(family_count);
}

void OptimizerPipeline::adopt(const StepTrace& trace) {
  grad_staging_max_ = static_cast<int>(core_.opt.plan.grad_staging_slots);
  nvme_places_max_ = static_cast<int>(core_.opt.plan.nvme_families_in_flight);
  // NVMe families in the order their gradients complete in the trace (Note [Pipeline places]).
  const std::vector<long> last = last_backward_use(trace, core_.layout().families.size());
  nvme_order_.clear();
  for (FamilyId f = 0; f < core_.plan().families.size(); ++f) {
    if (core_.on_nvme(f) && core_.chunks().family_bytes()[f].numel > 0) nvme_order_.push_back(f);
  }
  std::stable_sort(nvme_order_.begin(), nvme_order_.end(), [&](FamilyId a, FamilyId b) {
    const long la = last[a] < 0 ? std::numeric_limits<long>::max() : last[a];
    const long lb = last[b] < 0 ? std::numeric_limits<long>::max() : last[b];
    return la < lb;
  });
  // The first to complete are deferred (Note [Deferred updates]); adopted with nothing in flight.
  STRATA_CHECK(held_grads_ == 0 && parked_ == 0 && carried_ == 0);
  std::fill(defer_.begin(), defer_.end(), 0);
  const std::size_t deferred =
      core_.deferred() ? 0 : std::min<std::size_t>(core_.plan().deferred_update_families, nvme_order_.size());
  for (std::size_t i = 0; i < deferred; ++i) defer_[nvme_order_[i]] = 1;
  held_max_ = static_cast<int>(deferred);
}

bool OptimizerPipeline::gradients_complete(FamilyId f) const {
  const Chunk& grad = core_.chunk(f, StateKind::kGrad);
  const Chunk& param = core_.chunk(f, StateKind::kParam);
  return last_micro_batch && grads_written_[f] > 0 && grads_written_[f] + grads_none_[f] == trainable[f] &&
         grad.writers == 0 && param.readers == 0;
}

std::size_t OptimizerPipeline::incomplete_families() const {
  std::size_t n = 0;
  for (FamilyId f = 0; f < grads_written_.size(); ++f)
    n += grads_written_[f] > 0 && grads_written_[f] + grads_none_[f] < trainable[f];
  return n;
}

void OptimizerPipeline::begin_micro_batch(bool last) {
  last_micro_batch = last;
  std::fill(grads_written_.begin(), grads_written_.end(), 0);
  std::fill(grads_none_.begin(), grads_none_.end(), 0);
}

void OptimizerPipeline::start_read_ahead() {
  if (read_ahead_ || read_ahead_cursor_ != 0 || !core_.nvme.is_open()) return;
  read_ahead_ = true;
  pump();
}

void OptimizerPipeline::stop_read_ahead() {
  read_ahead_ = false;
  for (FamilyId f = 0; f < runs_.size(); ++f) {
    if (runs_[f].place != NvmePlace::kNone && !runs_[f].launched()) cancel_read_ahead(f);
  }
}

void OptimizerPipeline::drop_read_ahead(FamilyId f) {
  if (runs_[f].place != NvmePlace::kNone && !runs_[f].launched()) {
    // States read ahead before this write are stale now (callers waited for the I/O).
    STRATA_CHECK(runs_[f].io_pending == 0);
    release_nvme_place(f);
  }
}

void OptimizerPipeline::end_step() {
  std::fill(grads_written_.begin(), grads_written_.end(), 0);
  std::fill(grads_none_.begin(), grads_none_.end(), 0);
  // The parked runs go on, in the order the next forward uses them: the reverse of
  // their gradients' completion (Note [Deferred updates]).
  std::size_t kept = 0;
  for (FamilyId f : launch_fifo_) {
    if (runs_[f].parked()) launch_fifo_[kept++] = f;
  }
  launch_fifo_.resize(kept);
  std::reverse(launch_fifo_.begin(), launch_fifo_.end());
  for (FamilyId f : launch_fifo_) carry(f);
  grad_queue_.clear();  // (a parked run's gradient has landed)
  read_ahead_cursor_ = 0;
  for (FamilyId f = 0; f < runs_.size(); ++f) {
    if (runs_[f].carried()) continue;
    runs_[f].reset();
    checks_[f].valid = false;  // span_sq keeps its capacity
  }
  park_ = true;
  ++steps_done_;
  if (carried_ > 0) pump();
}

void OptimizerPipeline::abandon_step() {
  STRATA_CHECK(tasks_in_flight_ == 0 && io_families_ == 0);
  for (FamilyId f = 0; f < runs_.size(); ++f) {
    if (runs_[f].place != NvmePlace::kNone) release_nvme_place(f);  // states read ahead
  }
  end_step();
  --steps_done_;  // (end_step counted it)
  last_micro_batch = true;
}

bool OptimizerPipeline::all_applied() const {
  for (FamilyId f = 0; f < runs_.size(); ++f) {
    const FamilyRun& run = runs_[f];
    if (!launched_this_step(f)) continue;  // (a carried run applied in its own step's count)
    // A parked run applies later, unless its check on the device found Inf/NaN
    // (Note [Deferred updates]); without a check its kernel says so when it runs.
    if (run.parked() ? checks_[f].valid && !checks_[f].finite : run.outcome != RunOutcome::kApplied)
      return false;
  }
  return true;
}

void OptimizerPipeline::launch_optimizer(FamilyId f) {
  FamilyRun& run = runs_[f];
  if (run.running() || !core_.errors.background().ok()) return;
  bool any = false;
  for (TensorId t : core_.layout().families[f].tensors)
    any = any || (core_.tensors()[t].grad_written && !core_.tensors()[t].spec.frozen);
  // Nothing to update (yet): step() looks again. A family already done this
  // step keeps its record (step() reads whether it applied its update).
  if (!any) return;
  const Chunk& g = core_.chunk(f, StateKind::kGrad);
  if (g.writers > 0) return;  // release() launches it
  if (run.launched()) {
    // A second completion in one step (a later last micro-batch), or a run carried
    // over from the last step that has ended (Note [Deferred updates]): one entry a run.
    launch_fifo_.erase(std::remove(launch_fifo_.begin(), launch_fifo_.end(), f), launch_fifo_.end());
    run.reset();
    checks_[f].valid = false;  // the first gradient's check
  }
  run.move_phase(FamilyPhase::kWaiting);
  run.launched_in = steps_done_;
  ++tasks_in_flight_;
  ++launches_;
  if (defer_[f] && park_) {  // Note [Deferred updates]
    run.move_deferral(Deferral::kParked);
    ++parked_;
  }
  if (core_.plan().families[f].optim_home == Tier::kGpu) {
    launch_device_optimizer(f);
    return;
  }
  launch_fifo_.push_back(f);
  grad_queue_.push_back(f);
  pump();
}

void OptimizerPipeline::pump() {
  if (!core_.errors.background().ok()) {
    // Nothing new starts after a failure (Note [Copy-on-write NVMe slots]);
    // families waiting for a place or a gradient end here, untouched.
    grad_queue_.clear();
    std::string dropped;  // updates carried from the last step that will not run
    for (FamilyId f : launch_fifo_) {
      FamilyRun& run = runs_[f];
      // (A gradient still being copied to host ends here when its copy lands.)
      if (run.phase == FamilyPhase::kWaiting && run.io_pending == 0 && run.grad != GradStaging::kCopying) {
        if (run.carried()) dropped += fmt::format("{}{}", dropped.empty() ? "" : ", ", f);
        finish_family(f, Status::Ok());
      }
    }
    if (!dropped.empty()) {
      core_.errors.append(fmt::format(
          "step {}'s updates of families {} were deferred into the next forward and did not run: their "
          "params and states are as before step {} (Note [Deferred updates])",
          steps_done_, dropped, steps_done_));
    }
    return;
  }
  // 1. NVMe places: launched families first, in launch order.
  for (FamilyId f : launch_fifo_) {
    FamilyRun& run = runs_[f];
    if (!core_.on_nvme(f) || run.place != NvmePlace::kNone || !run.running() || run.parked()) continue;
    if (writebacks_[f].active) continue;  // writeback_done pumps again
    if (!no_room_.ok()) break;            // Note [Backpressure]
    if (nvme_places_used_ >= nvme_places_max_) {
      // Take a place back from a read-ahead that is not launched yet.
      for (FamilyId g : nvme_order_) {
        FamilyRun& other = runs_[g];
        if ((other.place == NvmePlace::kReading || other.place == NvmePlace::kReady) && !other.launched()) {
          cancel_read_ahead(g);
          break;
        }
      }
      if (nvme_places_used_ >= nvme_places_max_) break;
    }
    take_nvme_place(f);
  }
  // Then read ahead in the traced completion order.
  if (read_ahead_) {
    for (; read_ahead_cursor_ < nvme_order_.size() && nvme_places_used_ < nvme_places_max_ && no_room_.ok();
         ++read_ahead_cursor_) {
      FamilyId f = nvme_order_[read_ahead_cursor_];
      FamilyRun& run = runs_[f];
      if (run.place != NvmePlace::kNone || run.phase == FamilyPhase::kDone || defer_[f]) continue;
      if (writebacks_[f].active) break;  // its last step's states are still being written
      take_nvme_place(f);
    }
  }
  // 2. Gradient slots, first come first served. (A vector reserved for every
  // family: a deque's blocks came and went as the queue moved.)
  // A parked run's lands in a deferred update's room (Note [Deferred updates]).
  for (std::size_t i = 0; i < grad_queue_.size() && no_room_.ok();) {
    const FamilyId f = grad_queue_[i];
    FamilyRun& run = runs_[f];
    if (run.parked() && held_grads_ >= held_max_) unpark(f);  // (one room per deferred family)
    if (run.running() && !run.parked() && grad_staging_used_ >= grad_staging_max_) {
      ++i;
      continue;
    }
    grad_queue_.erase(grad_queue_.begin() + static_cast<std::ptrdiff_t>(i));
    if (!run.running()) continue;
    land_gradient(f);
  }
  if (no_room_.ok()) return;
  // Note [Backpressure]: a request that found no host room waits for pipeline work
  // that frees some (its end pumps again); with none in flight, nothing will.
  Status no_room = std::exchange(no_room_, Status::Ok());
  if (host_work_in_flight()) return;
  no_room.with_context(
      "no optimizer work in flight can free host room: a planner bug (Note [Host room] in "
      "runtime/plan/planner.cpp); raise host_budget and report it");
  core_.errors.fail(std::move(no_room));
  pump();  // ends the families still waiting
  core_.cv.notify_all();
}

void OptimizerPipeline::note_no_room(Status status, std::string what) {
  status.with_context(std::move(what));
  STRATA_LOG_DEBUG("runtime: {}; waiting for the optimizer pipeline to free host room", status.to_string());
  if (no_room_.ok()) no_room_ = std::move(status);
}

bool OptimizerPipeline::host_work_in_flight() const {
  if (io_families_ > 0 || writebacks_in_flight_ > 0) return true;
  for (FamilyId f : launch_fifo_) {
    const FamilyRun& run = runs_[f];
    if (run.phase == FamilyPhase::kComputing || run.grad == GradStaging::kCopying) return true;
  }
  return false;
}

void OptimizerPipeline::land_gradient(FamilyId f) {
  FamilyRun& run = runs_[f];
  Chunk& g = core_.chunk_mut(f, StateKind::kGrad);
  run.move_grad(GradStaging::kCopying);
  run.move_room(run.parked() ? GradRoom::kHeld : GradRoom::kStaging);
  ++room_count(run.room);
  if (g.dirty()) {
    auto buffer = core_.host->allocate(g.bytes);
    if (!buffer.ok()) {
      // No room: back to the queue's head until pipeline work frees some (Note [Backpressure]);
      // a parked run goes ahead in this step then, through a grad staging buffer.
      run.move_grad(GradStaging::kNone);
      --room_count(run.room);
      run.move_room(GradRoom::kNone);
      unpark(f);
      grad_queue_.insert(grad_queue_.begin(), f);
      note_no_room(buffer.status(), fmt::format("gradient staging for family {}", f));
      return;
    }
    run.grad_host = *buffer;
    DeviceSlot& slot = residency_.slot_of(g);
    Status st = core_.device.wait(core_.d2h, slot.fence);
    // Checked on the device before the copy (Note [Gradient check on the device]).
    if (st.ok() && checks_on_device()) st = check_on_device(f, slot.ptr, step_scale);
    if (st.ok())
      st = core_.timed_copy(core_.d2h, Track::kD2H, run.grad_host, slot.ptr, g.bytes,
                            memory::CopyKind::kDeviceToHost, SpanName{"d2h", f, "grad"});
    if (st.ok()) st = core_.device.record(slot.fence, core_.d2h);
    if (st.ok()) {
      st = core_.device.launch_host(core_.d2h, [this, f] {
        // Device-stream callbacks never take the mutex (Note [Runtime threading]).
        core_.pool->post([this, f] {
          std::lock_guard lock(core_.mu);
          FamilyRun& landed = runs_[f];
          if (landed.grad == GradStaging::kCopying) landed.move_grad(GradStaging::kReady);
          residency_.drop_stale_host_copy(core_.chunk_mut(f, StateKind::kGrad));  // (Note [Host room])
          if (core_.errors.background().ok()) {
            maybe_compute(f);
            // A parked run's landed gradient is what step() waits for (Note [Deferred updates]).
            if (landed.parked()) core_.cv.notify_all();
          } else {
            pump();  // ends this family, untouched, now that its staging is free to reuse
            core_.cv.notify_all();
          }
        });
      });
    }
    // The slot may take a new occupant now: its writes wait on the fence.
    g.move_value(ChunkValue::kStaged);
    residency_.drop_device_copy(g);
    if (!st.ok()) finish_family(f, st);
    return;
  }
  if (g.value == ChunkValue::kHost) {
    run.grad_host = g.host;
    run.move_grad(GradStaging::kInChunk);
    maybe_compute(f);
    return;
  }
  finish_family(f, internal_error("family {}: gradient is on no tier when its optimizer starts", f));
}

void OptimizerPipeline::maybe_compute(FamilyId f) {
  FamilyRun& run = runs_[f];
  if (run.phase != FamilyPhase::kWaiting || !run.grad_landed()) return;
  if (core_.on_nvme(f) && run.place != NvmePlace::kReady) return;  // (ready: no read in flight)
  if (run.param == ParamRead::kAwaitsGradients) {
    fetch_deferred_param(f);  // its end calls this again
    return;
  }
  run.move_phase(FamilyPhase::kComputing);
  core_.pool->post([this, f] { compute_family(f); });
}

void OptimizerPipeline::release_gradient(FamilyId f, bool consumed) {
  FamilyRun& run = runs_[f];
  Chunk& g = core_.chunk_mut(f, StateKind::kGrad);
  if (run.grad_host != nullptr && run.grad != GradStaging::kInChunk) core_.host->free(run.grad_host, g.bytes);
  run.grad_host = nullptr;
  if (consumed) {
    if (g.host != nullptr) {
      core_.host->free(g.host, g.bytes);
      g.host = nullptr;
    }
    g.move_value(ChunkValue::kAbsent);
    residency_.drop_device_copy(g);
    core_.family_grads_consumed(f);
  }
  if (run.grad != GradStaging::kNone) {
    run.move_grad(GradStaging::kNone);
    --room_count(run.room);
    run.move_room(GradRoom::kNone);
  }
}

void OptimizerPipeline::finish_family(FamilyId f, Status status) {
  FamilyRun& run = runs_[f];
  STRATA_CHECK(run.running());
  if (run.grad == GradStaging::kCopying && run.grad_host != nullptr) {
    // An error ends the family while its gradient is still being copied into
    // the staging buffer: the copy must land before the buffer is reused (the
    // d2h stream never takes this lock, Note [Runtime threading]).
    core_.device.synchronize(core_.d2h).ignore();
  }
  if (run.grad != GradStaging::kNone) release_gradient(f, /*consumed=*/false);
  release_nvme_place(f);
  if (!status.ok()) core_.errors.fail(status);
  unpark(f);
  if (run.carried()) {
    run.move_deferral(Deferral::kNone);
    --carried_;
  }
  run.move_phase(FamilyPhase::kDone);
  --tasks_in_flight_;
  pump();
  core_.cv.notify_all();
}

void OptimizerPipeline::commit_param(FamilyId f) {
  core_.count_updates(runs_[f].updated);
  // The host param (and master) changed: the GPU copy is stale.
  Chunk& p = core_.chunk_mut(f, StateKind::kParam);
  STRATA_CHECK(p.readers == 0);
  residency_.drop_device_copy(p);
}

// Note [Failed work completes its waiters]
// A family that is launched ends (finish_family: its counters drop, Core::cv is
// notified) whatever happens, so no wait on step work can outlive a failure:
//   - work in flight (a d2h copy, NVMe reads, a kernel, a write-back) always
//     completes, and its completion either goes on or, once the background error (ErrorState)
//     is set, calls pump();
//   - pump() with an error set starts nothing and ends every launched family that
//     only waits (for a place, a grad staging buffer or its gradient);
//   - the waits below pump once more before they sleep, so a failure recorded
//     where no pump followed (Residency, a prefetch) still ends the waiting ones.
// A GRU plan with one grad staging buffer and one NVMe place hung here: a family
// whose state reads were in flight when another failed lost its queue entry for a
// staging buffer, and its read's completion did not pump.

Status OptimizerPipeline::wait_step_work(std::unique_lock<std::mutex>& lock) {
  core_.cv.wait(lock, [&] {
    if (!core_.errors.background().ok()) pump();
    return io_families_ == 0 && (tasks_in_flight_ == 0 || only_parked_left());
  });
  return core_.errors.background();
}

Status OptimizerPipeline::wait_all(std::unique_lock<std::mutex>& lock) {
  if (parked_ > 0) {  // they run now (Note [Deferred updates])
    park_ = false;
    for (FamilyId f : launch_fifo_) unpark(f);
    pump();
  }
  core_.cv.wait(lock, [&] {
    if (!core_.errors.background().ok()) pump();
    return tasks_in_flight_ == 0 && io_families_ == 0 && writebacks_in_flight_ == 0;
  });
  return core_.errors.background();
}

}  // namespace strata::runtime
