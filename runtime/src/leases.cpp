// Runtime: leases (acquire, release), compute launches and micro-batches.
//
// Note [Allocation-free hot paths]
// Once the warm-up steps are done, a steady step allocates nothing on the heap
// (acquire, release, launch, step() and the background work they start) on a
// plan whose optimizer states (and params) live on the GPU, on host or on NVMe:
//   - the tracer records into the room of the trace it handed out last time
//     (Tracer::take / give_back); the sim device stores each queued operation
//     in place (InlineOp in memory/src/sim/sim_stream.hpp);
//   - a host function on a stream captures at most two words, which
//     std::function keeps in place: timed copies and launch() keep their
//     values in pooled completion records (Note [Completion records] in
//     strata/common/record_pool.hpp), the optimizer's arguments live in a
//     per-family KernelCall and the gradient check's spans in its
//     GradCheckResult, both reused across steps; the CUDA device's
//     launch_host carries the function in a pooled record too;
//   - NVMe I/O: each piece's completion is a pooled NvmeIoRecord
//     (NvmeTier::submit_pieces); the piece lists (FamilyRun::pieces,
//     WriteBack::writes, ParamStaging::pieces) and new-slot lists are reused
//     and chunks swap slot lists with the write-back; offload::SwapStore takes
//     its slot operations from a pool, builds a slot's requests on the stack,
//     names files by index and formats messages only on failure;
//   - timeline spans are named by a SpanName (a static label, a family, a
//     detail), formatted only by the export, into room reserved once;
//   - the thread pool hands asio recycled blocks (Note [Handler memory] in
//     thread_pool.hpp); kernel passes keep their piece lists in per-thread
//     scratch (kernels/src/step.cpp); the host store and the region arena
//     reuse their map nodes (the arena starts with 64 spare).
// Runtime::hot_path_counters() names the pools that could still grow
// (copy_records, launch_records, pool_handler_blocks, nvme_io_records,
// nvme_slot_op_records, ...); tests/runtime/test_alloc_free.cpp counts
// allocations with a replaced operator new beside them. Not allocation-free:
// the first steps of a plan, re-plans, errors, and the synchronous NVMe
// transfers of read_tensor/write_tensor and plan adoption (Core::nvme_transfer).
#include <algorithm>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {
namespace {

// The preconditions of acquire() on one tensor's chunk `c`.
Status check_acquire(const Core& core, const TensorInfo& info, const TensorSlot& ts, const Chunk& c,
                     StateKind kind, Access access, Where where) {
  if (c.bytes == 0) {
    return failed_precondition("acquire(\"{}\", {}): this tensor has no {} state ({})", info.spec.name,
                               state_kind_name(kind), state_kind_name(kind),
                               info.spec.frozen ? "it is frozen" : "the optimizer keeps none");
  }
  if (kind == StateKind::kGrad && info.spec.frozen) {
    return failed_precondition("acquire(\"{}\", grad): the tensor is frozen and has no gradient",
                               info.spec.name);
  }
  if (kind == StateKind::kGrad && access != Access::kRead && info.written_in_micro_batch) {
    return failed_precondition(
        "acquire(\"{}\", grad) for write: its gradient was already handed over in this micro-batch; "
        "accumulate "
        "tied uses before handing it over, or start a new micro-batch with begin_micro_batch (Note [Gradient "
        "completion])",
        info.spec.name);
  }
  if (access != Access::kRead && info.write_leases > 0) {
    return failed_precondition(
        "acquire(\"{}\", {}) for write: the tensor is already leased for write; release "
        "that lease first",
        info.spec.name, state_kind_name(kind));
  }
  if (kind == StateKind::kGrad && access != Access::kWrite && !info.grad_written) {
    return failed_precondition(
        "acquire(\"{}\", grad, {}): no gradient was written since the last step; the "
        "first micro-batch must use Access::kWrite",
        info.spec.name, access == Access::kRead ? "read" : "accumulate");
  }
  if ((kind == StateKind::kState0 || kind == StateKind::kState1) && core.opt.state_dtype == DType::kQ8) {
    return failed_precondition(
        "acquire(\"{}\", {}): the state is 8-bit codes with block scales (precision.states q8, Note [Q8 "
        "state chunks]), which a lease of float values cannot give; use read_tensor/write_tensor, which "
        "dequantize and quantize",
        info.spec.name, state_kind_name(kind));
  }
  if (is_optim_kind(kind) && core.dp_ranks() > 1) {
    return failed_precondition(
        "acquire(\"{}\", {}): with {} data-parallel ranks this rank holds only its shard of the tensor's "
        "optimizer states (Note [Sharded step]), which a lease of the whole tensor cannot give; use "
        "state_range and read_tensor/write_tensor",
        info.spec.name, state_kind_name(kind), core.dp_ranks());
  }
  if (kind != StateKind::kGrad && kind != StateKind::kParam && where == Where::kDevice &&
      core.plan().families[ts.family].optim_home != Tier::kGpu) {
    return failed_precondition(
        "acquire(\"{}\", {}) on the device: optimizer states of this family live on {}; "
        "lease them on Where::kHost between steps",
        info.spec.name, state_kind_name(kind), tier_name(core.plan().families[ts.family].optim_home));
  }
  if (kind == StateKind::kParam && access != Access::kRead && where == Where::kDevice) {
    return failed_precondition(
        "acquire(\"{}\", param) for write on the device: params change only through the "
        "optimizer or init_tensor",
        info.spec.name);
  }

  if (kind == StateKind::kParam && where == Where::kHost &&
      core.plan().families[ts.family].param_home == Tier::kNvme) {
    return failed_precondition(
        "acquire(\"{}\", param) on host: the family's param lives on NVMe (the host budget holds only "
        "staging for it); use read_tensor / init_tensor, or raise host_budget so params stay on host",
        info.spec.name);
  }
  if (where == Where::kHost && core.plan().families[ts.family].optim_home == Tier::kNvme &&
      kind != StateKind::kParam && kind != StateKind::kGrad) {
    return failed_precondition(
        "acquire(\"{}\", {}) on host: the family's states live on NVMe; use read_tensor", info.spec.name,
        state_kind_name(kind));
  }
  return Status::Ok();
}

// Pins chunk `c` on `where` and returns its base pointer there.
Result<std::byte*> pin(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, Chunk& c, const TensorInfo& info,
                       Access access, Where where) {
  if (where == Where::kDevice) {
    // An absent NVMe-homed param loads zeros through its staging (Note [NVMe-homed params]).
    const bool load = !c.absent() || m.residency().needs_staging(c);
    STRATA_RETURN_IF_ERROR(m.residency().ensure_on_device(lock, c, load));
    DeviceSlot& slot = m.residency().slot_of(c);
    STRATA_RETURN_IF_ERROR(m.core().device.wait(m.core().compute, slot.ready));
  } else {
    STRATA_RETURN_IF_ERROR(m.residency().ensure_on_host(c));
    if (access != Access::kRead) {
      // A load or prefetch may still be copying from the host copy.
      STRATA_RETURN_IF_ERROR(m.core().device.synchronize(m.core().h2d));
      if (c.readers > 0)
        return failed_precondition("acquire(\"{}\") for write on host while leased on the device",
                                   info.spec.name);
      m.residency().drop_device_copy(c);
    }
  }
  // (The caller counts the pin: Core::lease_taken.)
  if (access != Access::kRead && where == Where::kDevice)
    c.move_value(ChunkValue::kDevice);  // a host lease made it kHost
  return where == Where::kDevice ? m.residency().slot_of(c).ptr : c.host;
}

// Waits for what the use needs (another rank's param, the family's optimizer
// run) and pins the chunk.
Result<std::byte*> place(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, Chunk& c,
                         const TensorInfo& info, Access access, Where where) {
  // Rank 0's initial params, another rank's updated param still arriving (Note [Chunk events]).
  if (m.events() != nullptr) STRATA_RETURN_IF_ERROR(m.events()->on_use(lock, c));
  // A family whose optimizer is running is waited for: an update carried into this
  // forward (Note [Deferred updates]), or an unplanned access; a parked one goes now.
  m.pipeline().release_parked(c.family);
  if (m.pipeline().updating(c.family)) {
    const double t0 = m.core().timeline.now_us();
    m.core().cv.wait(lock, [&] { return !m.pipeline().updating(c.family); });
    m.core().timeline.add_stall((m.core().timeline.now_us() - t0) * 1e-6);
    if (!m.core().errors.background().ok()) return m.core().errors.background();
  }
  return pin(m, lock, c, info, access, where);
}

// Drops a lease's pin on chunk `c` (a device lease's compute fence recorded first).
void unpin(Runtime::Impl& m, const Chunk& c, Where where, Access access, TensorId tensor) {
  if (where == Where::kDevice && c.device_slot >= 0) {
    Status st = m.core().device.record(m.residency().slot_of(c).fence, m.core().compute);
    if (!st.ok()) m.core().errors.fail(st);
  }
  m.core().lease_returned(tensor, Core::chunk_index(c.family, c.kind), access != Access::kRead);
  --m.book().leases_out;
}

}  // namespace

Result<Lease> Runtime::acquire(TensorId tensor, StateKind kind, Access access, Where where) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (!m.core().errors.background().ok()) return m.poison_step(lock, m.core().errors.background());
  // (A failed prefetch: once; nothing done; the step goes on.)
  if (Status st = m.core().errors.take_prefetch(); !st.ok()) return m.poison_step(lock, st, false);
  if (tensor >= m.core().tensors().size()) {
    return invalid_argument("acquire: tensor id {} is not registered ({} tensors)", tensor,
                            m.core().tensors().size());
  }
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  const TensorInfo& info = m.core().tensors()[tensor];
  const TensorSlot& ts = m.core().layout().slots[tensor];
  Chunk& c = m.core().chunk_mut(ts.family, kind);
  STRATA_RETURN_IF_ERROR(check_acquire(m.core(), info, ts, c, kind, access, where));

  if (m.book().states_kept && m.book().leases_out == 0) m.rehome_kept_states(lock);  // (Note [Failed steps])
  m.schedule(lock, SchedulerEvent::kUseBegins).ignore();                             // (never fails)
  if (kind == StateKind::kGrad) m.tracker().set_in_backward(true);
  m.tracker().note_use(ts.family, m.tracker().in_backward() ? Phase::kBackward : Phase::kForward,
                       kind == StateKind::kGrad && access != Access::kRead);
  // From here an error fails the step (Note [Failed steps]).
  auto placed = place(m, lock, c, info, access, where);
  if (!placed.ok()) return m.poison_step(lock, placed.status());
  std::byte* base = *placed;
  m.core().lease_taken(tensor, m.core().chunk_index(ts.family, kind), access != Access::kRead);
  ++m.book().leases_out;
  // The gathers of the params the prefetch is about to load end first (Note [Chunk events]).
  if (m.events() != nullptr) {
    if (Status st = m.events()->on_placed(lock); !st.ok()) m.core().errors.fail(st);
  }
  // A failed prefetch is the next call's error (Note [Prefetch errors]); a failed
  // load of a prefetched param the background error.
  m.schedule(lock, SchedulerEvent::kUsePlaced).ignore();

  Lease lease;
  lease.runtime_ = this;
  lease.uncaught_ = std::uncaught_exceptions();
  lease.data_ = base + ts.offset_elems * dtype_bytes(m.core().kind_dtype(kind));
  lease.numel_ = ts.numel;
  lease.tensor_ = tensor;
  lease.kind_ = kind;
  lease.access_ = access;
  lease.where_ = where;
  lease.chunk_ = static_cast<std::uint32_t>(m.core().chunk_index(ts.family, kind));
  return lease;
}

Released Runtime::release(Lease& lease) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  const Chunk& c = m.core().chunks().at(static_cast<std::int32_t>(lease.chunk_));
  unpin(m, c, lease.where_, lease.access_, lease.tensor_);
  if (lease.access_ != Access::kRead && lease.kind_ == StateKind::kGrad) {
    if (m.core().grad_handed_over(lease.tensor_)) m.pipeline().note_grad_written(c.family);
  }
  // The scheduler decides what the release allows (Note [Scheduler], Note [Gradient completion]).
  const std::uint64_t launches = m.pipeline().launches();
  // Fails only with data parallelism (a reduce-scatter that cannot be posted); schedule
  // has then made it the runtime's error (core.fail), which the next call returns.
  m.schedule(lock, SchedulerEvent::kLeaseReleased, c.family, lease.kind_).ignore();
  return m.pipeline().launches() != launches ? Released::kOptimizerStarted : Released::kUnpinned;
}

void Runtime::abandon(Lease& lease) {
  Impl& m = *impl_;
  // Work launched with the lease may capture what the unwinding frees next (Note [Failed steps]).
  m.core().device.synchronize(m.core().compute).ignore();
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  unpin(m, m.core().chunks().at(static_cast<std::int32_t>(lease.chunk_)), lease.where_, lease.access_,
        lease.tensor_);
  if (m.book().step_error.ok()) {
    m.book().step_error = cancelled(
        "the lease on \"{}\" ({}) was abandoned (destroyed by an exception's unwinding, or Lease::abandon): "
        "the step is incomplete and handed nothing over (call abort_step(), or step() discards it)",
        m.core().tensors()[lease.tensor_].spec.name, state_kind_name(lease.kind_));
  }
}

const memory::Stream& Runtime::compute_stream() const {
  return impl_->core().compute;
}

Status Runtime::launch(std::function<void()> fn) {
  Impl& m = *impl_;
  std::size_t use = 0;
  {
    std::lock_guard lock(m.core().mu);
    InvariantCheck check(m);
    use = m.tracker().current_use();
    m.core().count_launch();
  }
  // Note [Completion records]: the host function captures only its record.
  LaunchRecord* r = m.core().take_launch_record();
  *r = LaunchRecord{
      .core = &m.core(), .fn = std::move(fn), .use = use, .enqueued_us = m.core().timeline.now_us()};
  Status st = m.core().device.launch_host(m.core().compute, [&m, r] {
    Core& core = *r->core;
    const double t0 = std::max(r->enqueued_us, core.timeline.now_us());
    r->fn();
    const double t1 = core.timeline.now_us();
    core.timeline.add(Track::kCompute, SpanName{"compute"}, t0, t1, 0);
    core.compute_ended(t1);
    m.tracker().add_compute(r->use, (t1 - t0) * 1e-6);
    r->fn = nullptr;  // the caller's captures end with the compute, as before
    core.give_back_launch_record(r);
  });
  if (!st.ok()) {  // never enqueued
    r->fn = nullptr;
    m.core().give_back_launch_record(r);
    std::unique_lock lock(m.core().mu);
    return m.poison_step(lock, st);  // Note [Failed steps]
  }
  return st;
}

void Runtime::set_grad_scale(float scale) {
  std::lock_guard lock(impl_->core().mu);
  InvariantCheck check(*impl_);
  OptimizerPipeline& p = impl_->pipeline();
  p.grad_scale = scale;
  // Families that start before step() (not deferred) take the scale in effect
  // when they start; step() sets it again for the deferred ones.
  if (!impl_->core().deferred()) p.step_scale = scale;
}

Status Runtime::no_gradient(TensorId tensor) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (!m.core().errors.background().ok()) return m.core().errors.background();
  if (tensor >= m.core().tensors().size()) {
    return invalid_argument("no_gradient: tensor id {} is not registered ({} tensors)", tensor,
                            m.core().tensors().size());
  }
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  const TensorInfo& info = m.core().tensors()[tensor];
  if (info.spec.frozen) {
    return failed_precondition("no_gradient(\"{}\"): the tensor is frozen and has no gradient",
                               info.spec.name);
  }
  if (info.written_in_micro_batch) {
    return failed_precondition(
        "no_gradient(\"{}\"): its gradient was already handed over (or declared absent) in this micro-batch",
        info.spec.name);
  }
  if (m.core().dp_ranks() > 1) {
    return failed_precondition(
        "no_gradient(\"{}\"): with {} data-parallel ranks every rank hands over every trainable tensor's "
        "gradient each step; write zeros for an unused one",
        info.spec.name, m.core().dp_ranks());
  }
  m.core().grad_declared_absent(tensor);
  const FamilyId family = m.core().layout().slots[tensor].family;
  m.pipeline().note_no_gradient(family);
  m.schedule(lock, SchedulerEvent::kNoGradient, family).ignore();  // (never fails: no data parallelism here)
  return Status::Ok();
}

Status Runtime::begin_micro_batch(bool last) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (m.book().leases_out > 0) {
    return failed_precondition("begin_micro_batch: {} leases are still held; release them first",
                               m.book().leases_out);
  }
  STRATA_RETURN_IF_ERROR(m.core().errors.take_prefetch());  // (once; nothing done)
  if (!last && !m.core().accumulation_seen) {
    // Gradients will wait between micro-batches: a plan that counted no room for
    // them is made again now, before any is written (Note [Host room]).
    m.core().accumulation_seen = true;
    if (m.core().finalized() && !m.core().accumulation_planned() && !m.core().tensors().any_grad_written())
      STRATA_RETURN_IF_ERROR(m.adopt_plan(lock, m.tracker().plan_trace()));
  }
  m.pipeline().begin_micro_batch(last);
  m.tracker().set_in_backward(false);  // a new forward begins
  m.core().micro_batch_ended();
  return Status::Ok();
}

}  // namespace strata::runtime
