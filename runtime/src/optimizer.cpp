// The per-family optimizer pipeline (ARCHITECTURE.md, "One training step", 3).
//
// Note [Optimizer pipeline]
// States on the GPU: the fused kernel runs on the optimizer stream after the
// compute stream is done with the gradients (sim: the CPU kernel as the device's
// kernel). States on host: d2h of the gradient into a staging buffer, then the
// CPU kernel on the pool, which writes the new compute-dtype param into the
// family's host param chunk; the GPU copy is dropped and the next use (or a
// prefetch) brings the new one up. States on NVMe: as on host, with the master
// and moments read into staging first and written back after
// (pipeline.cpp: Note [Pipeline places], Note [Copy-on-write NVMe slots]).

#include <cmath>
#include <cstring>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

void Runtime::Impl::fail(Status status) {
  if (background_error.ok()) {
    STRATA_LOG_ERROR("runtime: {}", status.to_string());
    background_error = std::move(status);
  }
}

std::vector<kernels::Span> Runtime::Impl::spans_for(FamilyId f, const FamilyPtrs& ptrs,
                                                    std::vector<TensorId>* updated) {
  std::vector<kernels::Span> spans;
  const DType cdt = opt.compute_dtype;
  const std::uint64_t cb = dtype_bytes(cdt);
  const std::uint64_t sb = kernels::dtype_size(opt.state_dtype);
  for (TensorId t : layout.families[f].tensors) {
    const TensorInfo& info = tensors[t];
    if (info.spec.frozen || !info.grad_written) continue;
    const std::uint64_t off = layout.slots[t].offset_elems;
    kernels::Span s;
    s.n = info.numel;
    s.tensor = t;
    s.grad = ptrs.at[static_cast<int>(StateKind::kGrad)] + off * cb;
    s.grad_dtype = cdt;
    if (separate_master) {
      s.master = reinterpret_cast<float*>(ptrs.at[static_cast<int>(StateKind::kMaster)] + off * 4);
      s.param = ptrs.at[static_cast<int>(StateKind::kParam)] + off * cb;
      s.param_dtype = cdt;
    } else {
      s.master = reinterpret_cast<float*>(ptrs.at[static_cast<int>(StateKind::kParam)] + off * 4);
      s.param_dtype = DType::kNone;
    }
    for (std::uint32_t i = 0; i < state_count; ++i) {
      s.state[i] = ptrs.at[static_cast<int>(StateKind::kState0) + static_cast<int>(i)] + off * sb;
    }
    s.state_dtype = opt.state_dtype;
    spans.push_back(s);
    if (updated != nullptr) updated->push_back(t);
  }
  return spans;
}

void Runtime::Impl::kernel_keys(const std::vector<TensorId>& updated, std::vector<std::int64_t>* keys,
                                std::vector<kernels::Hyper>* hypers) const {
  std::uint32_t groups_used = 1;
  for (TensorId t : updated) {
    keys->push_back((static_cast<std::int64_t>(tensors[t].group) << 48) | (tensors[t].updates + 1));
    groups_used = std::max(groups_used, tensors[t].group + 1);
  }
  for (std::uint32_t g = 0; g < groups_used; ++g) hypers->push_back(hyper(g));
}

Result<kernels::StepReport> Runtime::Impl::run_kernels(const std::vector<kernels::Span>& spans,
                                                       const std::vector<std::int64_t>& keys, float scale,
                                                       const std::vector<kernels::Hyper>& hypers) {
  // Tensors updated a different number of times (one was unused in some step)
  // need their own bias corrections, and each parameter group its own lr and
  // weight decay: one kernel call per distinct (group, step) key.
  constexpr std::int64_t kStepMask = (std::int64_t{1} << 48) - 1;
  kernels::StepReport total{.grads_finite = true, .applied = true};
  std::vector<std::int64_t> distinct(keys);
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  for (std::int64_t key : distinct) {
    std::vector<kernels::Span> group;
    for (std::size_t i = 0; i < spans.size(); ++i) {
      if (keys[i] == key) group.push_back(spans[i]);
    }
    const auto g = static_cast<std::size_t>(key >> 48);
    STRATA_CHECK(g < hypers.size());
    kernels::StepArgs args{
        .hyper = hypers[g], .step = key & kStepMask, .grad_scale = scale, .spans = group, .pool = pool.get()};
    STRATA_ASSIGN_OR_RETURN(kernels::StepReport r, kernels::step(args));
    total.grads_finite = total.grads_finite && r.grads_finite;
    total.applied = total.applied && r.applied;
  }
  return total;
}

void Runtime::Impl::launch_optimizer(FamilyId f) {
  FamilyRun& run = runs[f];
  if ((run.launched && !run.done) || !background_error.ok()) return;
  if (run.launched) run = FamilyRun{};  // a second completion in one step (a later last micro-batch)
  bool any = false;
  for (TensorId t : layout.families[f].tensors)
    any = any || (tensors[t].grad_written && !tensors[t].spec.frozen);
  if (!any) return;  // nothing to update (yet): step() looks again
  Chunk& g = chunk(f, StateKind::kGrad);
  if (g.writers > 0) return;  // release() launches it
  run.launched = true;
  run.done = false;
  ++tasks_in_flight;
  if (plan.families[f].optim_home == Tier::kGpu) {
    launch_device_optimizer(f);
    return;
  }
  launch_fifo.push_back(f);
  grad_queue.push_back(f);
  pump();
}

void Runtime::Impl::launch_device_optimizer(FamilyId f) {
  FamilyPtrs ptrs;
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = chunks[f * kStateKindCount + k];
    if (c.bytes == 0) continue;
    STRATA_CHECK(c.slot >= 0);
    DeviceSlot& slot = slots[static_cast<std::size_t>(c.slot)];
    ptrs.at[k] = slot.ptr;
    Status st = device.wait(opt_stream, slot.fence);
    if (st.ok() && !c.dev_valid) {
      // A state never loaded (zeros) or one whose host copy is newer: load it first.
      st = load_to_slot(c, slot);
      if (st.ok()) st = device.wait(opt_stream, slot.ready);
      c.dev_valid = st.ok();
    }
    if (!st.ok()) {
      finish_family(f, st);
      return;
    }
  }
  std::vector<TensorId> updated;
  std::vector<kernels::Span> spans = spans_for(f, ptrs, &updated);
  std::vector<std::int64_t> steps;
  std::vector<kernels::Hyper> hypers;
  kernel_keys(updated, &steps, &hypers);
  const double enqueued = timeline.now_us();
  const float scale = step_scale;
  Status st = device.launch_host(opt_stream, [this, f, spans, steps, hypers, updated, enqueued, scale] {
    Result<kernels::StepReport> r = run_kernels(spans, steps, scale, hypers);
    std::uint64_t elems = 0;
    for (const auto& s : spans) elems += s.n;
    record_span(Track::kGpuOptimizer, fmt::format("optimizer f{}", f), enqueued, elems);
    // Device-stream callbacks never take the mutex (Note [Runtime threading]).
    pool->post([this, f, r, updated] {
      std::lock_guard lock(mu);
      if (r.ok()) {
        runs[f].applied = r->applied;
        if (r->applied) {
          for (TensorId t : updated) ++tensors[t].updates;
        }
      }
      release_gradient(f, r.ok());
      finish_family(f, r.ok() ? Status::Ok() : r.status());
    });
  });
  for (std::size_t k = 0; k < kStateKindCount && st.ok(); ++k) {
    Chunk& c = chunks[f * kStateKindCount + k];
    if (c.bytes == 0) continue;
    DeviceSlot& slot = slots[static_cast<std::size_t>(c.slot)];
    st = device.record(slot.ready, opt_stream);
    if (st.ok()) st = device.record(slot.fence, opt_stream);
    if (k != static_cast<std::size_t>(StateKind::kGrad)) {
      c.dev_dirty = true;  // the device copy is the authoritative one
      c.host_valid = false;
      c.absent = false;
    }
  }
  if (!st.ok()) fail(st);
}

void Runtime::Impl::commit_param(FamilyId f) {
  for (TensorId t : runs[f].updated) ++tensors[t].updates;
  // The host param (and master) changed: the GPU copy is stale.
  Chunk& p = chunk(f, StateKind::kParam);
  STRATA_CHECK(p.readers == 0);
  if (p.slot >= 0 && !slots[static_cast<std::size_t>(p.slot)].dedicated) {
    slots[static_cast<std::size_t>(p.slot)].chunk = -1;
    p.slot = -1;
  }
  p.dev_valid = false;
  p.dev_dirty = false;
}

Status Runtime::Impl::wait_step_work(std::unique_lock<std::mutex>& lock) {
  cv.wait(lock, [&] { return tasks_in_flight == 0 && io_families == 0; });
  return background_error;
}

Status Runtime::Impl::wait_optimizers(std::unique_lock<std::mutex>& lock) {
  cv.wait(lock, [&] { return tasks_in_flight == 0 && io_families == 0 && writebacks_in_flight == 0; });
  return background_error;
}

}  // namespace strata::runtime
