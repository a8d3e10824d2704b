// OptimizerPipeline: running a family's optimizer kernel, on the CPU pool or on
// the device's optimizer stream (optimizer_pipeline.hpp).
//
// Note [Optimizer pipeline]
// States on the GPU: the fused kernel runs_ on the optimizer stream after the
// compute stream is done with the gradients (sim: the CPU kernel as the device's
// kernel). States on host: d2h of the gradient into a staging buffer, then the
// CPU kernel on the core_.pool, which writes the new compute-dtype param into the
// family's host param chunk; the GPU copy is dropped and the next use (or a
// prefetch) brings the new one up. States on NVMe: as on core_.host, with the master
// and moments read into staging first and written back after
// (optimizer_pipeline.cpp: Note [Pipeline places]; nvme_pipeline.cpp: Note [Copy-on-write NVMe slots]).

#include <algorithm>
#include <cstring>
#include <optional>

#include "pipeline/optimizer_pipeline.hpp"
#include "pipeline/q8_states.hpp"
#include "residency/residency.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"
#include "strata/kernels/cuda.hpp"
#include "strata/memory/device_caps.hpp"

namespace strata::runtime {

void OptimizerPipeline::spans_for(FamilyId f, const FamilyPtrs& ptrs, std::vector<kernels::Span>* spans,
                                  std::vector<TensorId>* updated) {
  spans->clear();
  if (updated != nullptr) updated->clear();
  const DType cdt = core_.opt.compute_dtype;
  const std::uint64_t cb = dtype_bytes(cdt);
  // (q8: a state pointer is the tensor's first code; prepare_call adds the scales.)
  const std::uint64_t sb = kernels::dtype_size(core_.opt.state_dtype);
  for (TensorId t : core_.layout().families[f].tensors) {
    const TensorInfo& info = core_.tensors()[t];
    if (info.spec.frozen || !info.grad_written) continue;
    // Every rank counts the tensor's step; it updates the part in its shard
    // (param and gradient at their chunk offset, master and states at the
    // shard's: Note [Sharded step]). One rank: the whole tensor.
    if (updated != nullptr) updated->push_back(t);
    const Core::ShardPart part = core_.shard_part(t);
    if (part.count == 0) continue;
    const std::uint64_t off = core_.layout().slots[t].offset_elems + part.first;
    kernels::Span s;
    s.n = part.count;
    s.tensor = t;
    // Norms sum in groups aligned to the chunk, which shard boundaries never
    // split (Note [Exact norms] in kernels/exact_sum.hpp).
    static_assert(kShardAlignElems % kernels::kGroupElems == 0, "a shard boundary is a group boundary");
    s.group_phase = static_cast<std::uint32_t>(off % kernels::kGroupElems);
    s.grad = ptrs.at[static_cast<int>(StateKind::kGrad)] + off * cb;
    s.grad_dtype = cdt;
    if (core_.separate_master) {
      s.master = reinterpret_cast<float*>(ptrs.at[static_cast<int>(StateKind::kMaster)] + part.at * 4);
      s.param = ptrs.at[static_cast<int>(StateKind::kParam)] + off * cb;
      s.param_dtype = cdt;
    } else {
      s.master = reinterpret_cast<float*>(ptrs.at[static_cast<int>(StateKind::kParam)] + off * 4);
      s.param_dtype = DType::kNone;
    }
    for (std::uint32_t i = 0; i < core_.state_count; ++i) {
      s.state[i] = ptrs.at[static_cast<int>(StateKind::kState0) + static_cast<int>(i)] + part.at * sb;
    }
    s.state_dtype = core_.opt.state_dtype;
    spans->push_back(s);
  }
}

void OptimizerPipeline::prepare_call(FamilyId f, const FamilyPtrs& ptrs, KernelCall& call) {
  std::vector<TensorId>& updated = runs_[f].updated;
  spans_for(f, ptrs, &call.spans, &updated);
  call.q8_spans.clear();
  if (core_.opt.state_dtype == DType::kQ8) {
    // Note [Q8 state chunks]: codes at the shard offset (one byte each), scales after the codes.
    const std::uint64_t elems = core_.shard_elems(f);
    const Q8Chunk m{.chunk = ptrs.at[static_cast<int>(StateKind::kState0)], .chunk_elems = elems};
    const Q8Chunk v{.chunk = ptrs.at[static_cast<int>(StateKind::kState1)], .chunk_elems = elems};
    for (const kernels::Span& s : call.spans) {
      const auto at = static_cast<std::uint64_t>(static_cast<const std::byte*>(s.state[0]) - m.chunk);
      call.q8_spans.push_back(q8_span(s, at, m, v));
    }
  }
  call.keys.clear();
  std::uint32_t groups_used = 1;
  for (const kernels::Span& s : call.spans) {
    const TensorInfo& info = core_.tensors()[s.tensor];
    call.keys.push_back((static_cast<std::int64_t>(info.group) << 48) | (info.updates + 1));
    groups_used = std::max(groups_used, info.group + 1);
  }
  if (runs_[f].carried()) {
    // Its step's hyperparameters, captured when that step ended (Note [Deferred updates]).
    STRATA_CHECK(groups_used <= call.hypers.size());
  } else {
    call.hypers.clear();
    for (std::uint32_t g = 0; g < groups_used; ++g) call.hypers.push_back(core_.hyper(g));
  }
  call.elems = 0;
  for (const kernels::Span& s : call.spans) call.elems += s.n;
  // The distinct keys, in order: one kernel call each.
  call.distinct.assign(call.keys.begin(), call.keys.end());
  std::sort(call.distinct.begin(), call.distinct.end());
  call.distinct.erase(std::unique(call.distinct.begin(), call.distinct.end()), call.distinct.end());
}

namespace {

//! The spans of `call` whose key is `key`, into call.group.
void gather_group(KernelCall& call, std::int64_t key) {
  call.group.clear();
  for (std::size_t i = 0; i < call.spans.size(); ++i) {
    if (call.keys[i] == key) call.group.push_back(call.spans[i]);
  }
}

//! The kernel arguments of key `key`'s spans (gathered into call.group): its
//! group's hyperparameters and its step number.
kernels::StepArgs group_args(KernelCall& call, std::int64_t key, ThreadPool* pool,
                             const kernels::GradStats* checked) {
  constexpr std::int64_t kStepMask = (std::int64_t{1} << 48) - 1;
  gather_group(call, key);
  const auto g = static_cast<std::size_t>(key >> 48);
  STRATA_CHECK(g < call.hypers.size());
  return kernels::StepArgs{
      .hyper = call.hypers[g],
      .step = key & kStepMask,
      .grad_scale = call.scale,
      .spans = call.group,
      .pool = pool,
      .check = checked != nullptr ? kernels::GradCheck::kCallerChecked : kernels::GradCheck::kSeparatePass,
      .checked = checked};
}

}  // namespace

Result<kernels::StepReport> OptimizerPipeline::run_kernels(FamilyId f, KernelCall& call,
                                                           const kernels::GradStats* checked) {
  if (exchanges_trust()) return run_trust_exchanged(f, call, checked);
  // Tensors updated a different number of times (one was unused in some step)
  // need their own bias corrections, and each parameter group its own lr and
  // weight decay: one kernel call per distinct (group, step) key.
  kernels::StepReport total{.grads_finite = true, .applied = true};
  const bool q8 = core_.opt.state_dtype == DType::kQ8;
  for (std::int64_t key : call.distinct) {
    const kernels::StepArgs args = group_args(call, key, core_.pool.get(), checked);
    if (q8) {  // the same key's spans, over codes and scales (Note [Q8 state chunks])
      call.q8_group.clear();
      for (std::size_t i = 0; i < call.spans.size(); ++i) {
        if (call.keys[i] == key) call.q8_group.push_back(call.q8_spans[i]);
      }
    }
    STRATA_ASSIGN_OR_RETURN(kernels::StepReport r,
                            q8 ? step_q8_group(args, call.q8_group) : kernels::step(args));
    total.grads_finite = total.grads_finite && r.grads_finite;
    total.applied = total.applied && r.applied;
  }
  return total;
}

bool OptimizerPipeline::exchanges_trust() const {
  const kernels::Optimizer o = core_.opt.hyper.optimizer;
  return core_.dp_ranks() > 1 && (o == kernels::Optimizer::kLamb || o == kernels::Optimizer::kLars);
}

Result<kernels::StepReport> OptimizerPipeline::run_trust_exchanged(FamilyId f, KernelCall& call,
                                                                   const kernels::GradStats* checked) {
  // Note [Sharded step]: a tensor crossing a shard boundary has parts on
  // several ranks. Each rank's phase 1 sums ||p||² and ||u||² (LARS: ||g||²)
  // over its part, exactly (Note [Exact norms]); the sums, laid out per updated
  // tensor (the same list on every rank), are all-reduced, so every rank takes
  // the same whole-tensor trust ratio as one rank with the whole tensor. step() runs one family at a time in
  // family order on every rank, so the all-reduces are issued in the same order everywhere.
  const std::vector<TensorId>& updated = runs_[f].updated;  // (written by prepare_call; read-only now)
  const bool lamb = core_.opt.hyper.optimizer == kernels::Optimizer::kLamb;
  auto index_of = [&](std::uint32_t t) {
    return static_cast<std::size_t>(std::find(updated.begin(), updated.end(), t) - updated.begin());
  };
  call.tensor_sums.assign(2 * updated.size(), kernels::ExactSum{});
  Status failed = Status::Ok();
  bool finite = true;
  for (std::int64_t key : call.distinct) {
    const kernels::StepArgs args = group_args(call, key, core_.pool.get(), checked);
    call.partials.assign(call.group.size(), kernels::TrustPartial{});
    Result<kernels::StepReport> r = kernels::trust_phase1(args, call.partials);
    if (!r.ok() || !r->grads_finite) {
      failed = r.ok() ? Status::Ok() : r.status();
      finite = false;
      break;
    }
    for (std::size_t i = 0; i < call.group.size(); ++i) {
      const std::size_t at = index_of(call.group[i].tensor);
      STRATA_CHECK(at < updated.size());
      STRATA_CHECK(call.partials[i].exact);  // the CPU kernels' sums
      call.tensor_sums[2 * at].add(call.partials[i].param_exact);
      call.tensor_sums[2 * at + 1].add(call.partials[i].other_exact);
    }
  }
  // Exact sums on the wire: the limbs add exactly in any order, so every rank
  // gets the whole tensors' sums bit for bit as one rank has them.
  constexpr std::size_t kWire = kernels::ExactSum::kWireDoubles;
  call.norms.assign(kWire * call.tensor_sums.size() + 1, 0.0);
  for (std::size_t k = 0; k < call.tensor_sums.size(); ++k) {
    call.tensor_sums[k].to_wire(std::span<double>(call.norms).subspan(k * kWire, kWire));
  }
  // Every rank reaches this all-reduce for family f, failed or not, so none waits in vain.
  call.norms.back() = finite ? 0.0 : 1.0;
  Result<comm::Handle> h = core_.opt.comm->all_reduce(call.norms, comm::ReduceOp::kSum);
  Status waited = h.ok() ? h->wait() : h.status();
  STRATA_RETURN_IF_ERROR(failed);
  if (!waited.ok()) {
    return waited.with_context(fmt::format("the all-reduce of family {}'s {} norms", f,
                                           kernels::optimizer_name(core_.opt.hyper.optimizer)));
  }
  // Some rank saw Inf/NaN in its part: no rank applies phase 2 (LAMB's phase 1
  // checks first and writes nothing then).
  if (call.norms.back() != 0.0) return kernels::StepReport{.grads_finite = false, .applied = false};
  for (std::size_t k = 0; k < call.tensor_sums.size(); ++k) {
    call.tensor_sums[k] =
        kernels::ExactSum::from_wire(std::span<const double>(call.norms).subspan(k * kWire, kWire));
  }
  for (std::int64_t key : call.distinct) {
    const kernels::StepArgs args = group_args(call, key, core_.pool.get(), checked);
    call.trust.resize(call.group.size());
    for (std::size_t i = 0; i < call.group.size(); ++i) {
      const std::size_t at = index_of(call.group[i].tensor);
      const double p = call.tensor_sums[2 * at].to_double(), o = call.tensor_sums[2 * at + 1].to_double();
      call.trust[i] = lamb ? kernels::lamb_trust_ratio(p, o) : kernels::lars_trust_ratio(args.hyper, p, o);
    }
    STRATA_RETURN_IF_ERROR(kernels::trust_phase2(args, call.trust));
  }
  return kernels::StepReport{.grads_finite = true, .applied = true};
}

void OptimizerPipeline::launch_device_optimizer(FamilyId f) {
  FamilyPtrs ptrs;
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = core_.chunk_mut(f, static_cast<StateKind>(k));
    if (c.bytes == 0) continue;
    STRATA_CHECK(c.device_slot >= 0);
    DeviceSlot& slot = residency_.slot_of(c);
    ptrs.at[k] = slot.ptr;
    Status st = core_.device.wait(core_.opt_stream, slot.fence);
    if (st.ok() && !c.device_copy) {
      // A state never loaded (zeros) or one whose host copy is newer: load it first.
      st = residency_.load_to_slot(c, slot);
      if (st.ok()) st = core_.device.wait(core_.opt_stream, slot.ready);
      c.device_copy = st.ok();
    }
    if (!st.ok()) {
      finish_family(f, st);
      return;
    }
  }
  KernelCall& call = calls_[f];
  prepare_call(f, ptrs, call);
  call.enqueued_us = core_.timeline.now_us();
  call.scale = step_scale;
  Status st = Status::Ok();
  if (memory::device_caps(core_.device).optimizer_kernels) {
    st = enqueue_cuda_optimizer(f);
  } else {
    // Sim: the CPU kernel is the device's kernel, run on the optimizer stream.
    // The host function captures (this, f) only: std::function keeps it in
    // place (Note [Allocation-free hot paths]).
    st = core_.device.launch_host(core_.opt_stream, [this, f] {
      KernelCall& c = calls_[f];
      // The device kernel's own pass checks the gradient in device memory.
      Result<kernels::StepReport> r = run_kernels(f, c, nullptr);
      c.status = r.ok() ? Status::Ok() : r.status();
      if (r.ok()) c.report = *r;
      core_.record_span(Track::kGpuOptimizer, SpanName{"optimizer", f}, c.enqueued_us, c.elems);
      // Device-stream callbacks never take the mutex (Note [Runtime threading]).
      core_.pool->post([this, f] { device_optimizer_done(f); });
    });
  }
  if (!st.ok()) {
    // Nothing was enqueued, so no completion will end the family: end it here
    // (Note [Failed work completes its waiters]).
    finish_family(f, st);
    return;
  }
  for (std::size_t k = 0; k < kStateKindCount && st.ok(); ++k) {
    Chunk& c = core_.chunk_mut(f, static_cast<StateKind>(k));
    if (c.bytes == 0) continue;
    DeviceSlot& slot = residency_.slot_of(c);
    st = core_.device.record(slot.ready, core_.opt_stream);
    if (st.ok()) st = core_.device.record(slot.fence, core_.opt_stream);
    if (k != static_cast<std::size_t>(StateKind::kGrad)) {
      c.move_value(ChunkValue::kDevice);  // the device copy is the authoritative one
    }
  }
  if (!st.ok()) core_.errors.fail(st);
}

void OptimizerPipeline::device_optimizer_done(FamilyId f) {
  std::lock_guard lock(core_.mu);
  const KernelCall& call = calls_[f];
  if (call.status.ok()) {
    runs_[f].move_outcome(call.report.applied ? RunOutcome::kApplied : RunOutcome::kNotApplied);
    if (call.report.applied) {
      core_.count_updates(runs_[f].updated);
    }
  }
  release_gradient(f, call.status.ok());
  finish_family(f, call.status);
}

Status OptimizerPipeline::enqueue_cuda_optimizer(FamilyId f) {
  // Note [CUDA optimizer]: one kernels::cuda_step_enqueue per (group, step) key
  // on the optimizer stream, each checking its gradients on the device and
  // gating its update by that check; nothing waits on the host. A host function
  // after them hands completion to the pool, whose cuda_step_finish calls find
  // their events already passed.
  KernelCall& call = calls_[f];
  if (core_.opt.state_dtype == DType::kQ8) {
    // Never reached: the plan keeps q8 states off a CUDA device (Note [Q8 state chunks]).
    return failed_precondition(
        "family {}: q8 optimizer states on the GPU, but the CUDA optimizer has no 8-bit kernel; keep them on "
        "host (plan.allow_gpu_optimizer = false)",
        f);
  }
  std::vector<kernels::CudaStepScratch>& scratch = cuda_scratch_[f];
  if (scratch.size() < call.distinct.size()) scratch.resize(call.distinct.size());  // kept for the next steps
  void* stream = reinterpret_cast<void*>(core_.opt_stream.native());
  constexpr std::int64_t kStepMask = (std::int64_t{1} << 48) - 1;
  for (std::size_t i = 0; i < call.distinct.size(); ++i) {
    gather_group(call, call.distinct[i]);
    const auto g = static_cast<std::size_t>(call.distinct[i] >> 48);
    STRATA_CHECK(g < call.hypers.size());
    kernels::StepArgs args{.hyper = call.hypers[g],
                           .step = call.distinct[i] & kStepMask,
                           .grad_scale = call.scale,
                           .spans = call.group};
    STRATA_RETURN_IF_ERROR(kernels::cuda_step_enqueue(args, scratch[i], stream));
  }
  return core_.device.launch_host(core_.opt_stream, [this, f] {
    const KernelCall& c = calls_[f];
    core_.record_span(Track::kGpuOptimizer, SpanName{"optimizer", f}, c.enqueued_us, c.elems);
    // No CUDA call in a stream callback: the pool finishes the steps.
    core_.pool->post([this, f] {
      KernelCall& done = calls_[f];
      done.status = Status::Ok();
      done.report = kernels::StepReport{.grads_finite = true, .applied = true};
      for (std::size_t i = 0; i < done.distinct.size(); ++i) {
        Result<kernels::StepReport> r = kernels::cuda_step_finish(cuda_scratch_[f][i]);
        if (!r.ok()) {
          if (done.status.ok()) done.status = r.status();
        } else {
          done.report.grads_finite = done.report.grads_finite && r->grads_finite;
          done.report.applied = done.report.applied && r->applied;
        }
      }
      device_optimizer_done(f);
    });
  });
}

void OptimizerPipeline::compute_family(FamilyId f) {
  std::unique_lock lock(core_.mu);
  FamilyRun& run = runs_[f];
  const bool nvme_family = core_.on_nvme(f);
  FamilyPtrs ptrs;
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = core_.chunk_mut(f, static_cast<StateKind>(k));
    if (c.bytes == 0) continue;
    if (c.kind == StateKind::kGrad) {
      ptrs.at[k] = run.grad_host;
    } else if (nvme_family && (is_optim_kind(c.kind) || c.kind == StateKind::kParam)) {
      ptrs.at[k] = run.staging[k];
    } else {
      Status st = residency_.ensure_on_host(c);
      if (!st.ok()) {
        finish_family(f, st);
        return;
      }
      ptrs.at[k] = c.host;
    }
  }
  Chunk& p = core_.chunk_mut(f, StateKind::kParam);
  KernelCall& call = calls_[f];
  prepare_call(f, ptrs, call);
  // The gradient was checked on its way to host (Note [Gradient check on the
  // device]); else the kernel reads it once first. A family that starts before
  // step() uses the scale its check took when it started; a deferred one the
  // step's (x the clip coefficient <= 1: finite stays finite).
  const GradCheckResult& check = checks_[f];
  call.scale = run.carried()                      ? run.carried_scale
               : check.valid && !core_.deferred() ? check.scale
                                                  : step_scale;
  std::optional<kernels::GradStats> checked;
  if (check.valid) {
    checked = kernels::GradStats{.sum_squares = check.sum_squares(), .finite = check.finite};
  } else {
    for (const kernels::Span& s : call.spans) host_check_bytes_ += s.n * kernels::dtype_size(s.grad_dtype);
  }
  // The kernel writes a host family's param in place: no load may still read it.
  if (!nvme_family) {
    if (Status st = residency_.wait_host_reads(p); !st.ok()) {
      finish_family(f, st);
      return;
    }
  }
  lock.unlock();

  const double t0 = core_.timeline.now_us();
  // The param is updated in its staging copy for NVMe families; nothing else
  // writes the host param while this family's optimizer runs.
  // (An NVMe-homed param was read into its staging beside the states.)
  if (nvme_family && !core_.param_on_nvme(f))
    std::memcpy(ptrs.at[static_cast<int>(StateKind::kParam)], p.host, p.bytes);
  Result<kernels::StepReport> r = run_kernels(f, call, checked ? &*checked : nullptr);
  core_.timeline.add(Track::kCpuOptimizer, SpanName{"optimizer", f}, t0, core_.timeline.now_us(), call.elems);

  lock.lock();
  release_gradient(f, r.ok());
  if (!r.ok()) {
    finish_family(f, r.status());
    return;
  }
  // (run.updated was filled by prepare_call.)
  run.move_outcome(r->applied ? RunOutcome::kApplied : RunOutcome::kNotApplied);
  if (run.carried() && !r->applied) {
    STRATA_LOG_WARN(
        "runtime: step {}: family {} had Inf/NaN gradients and was not updated (its update ran "
        "in the next forward: Note [Deferred updates])",
        steps_done_, f);
  }
  if (!nvme_family || !r->applied) {
    if (r->applied) commit_param(f);
    finish_family(f, Status::Ok());
    return;
  }
  write_back(f, lock);
}

}  // namespace strata::runtime
