// Runtime::step(), planning and re-planning, and host access to state between steps.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {
Status Runtime::Impl::ensure_nvme_store() {
  if (nvme != nullptr) return Status::Ok();
  const std::uint64_t slot = nvme_slot_bytes(largest_optim_chunk());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NvmeStore> store,
                          make_nvme_store({.dirs = opt.nvme_dirs,
                                           .slot_bytes = slot,
                                           .capacity_bytes = opt.budgets.nvme_bytes,
                                           .engine = opt.io_engine,
                                           .fixed_buffers = host->regions()}));
  nvme = std::move(store);
  STRATA_LOG_INFO("runtime: NVMe tier {}", nvme->describe());
  return Status::Ok();
}

Status Runtime::Impl::nvme_transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                                    std::vector<std::uint32_t>& slots_io) {
  STRATA_RETURN_IF_ERROR(ensure_nvme_store());
  const std::uint64_t piece = nvme->slot_bytes();
  std::vector<std::uint32_t> fresh;
  if (write) {
    for (std::uint64_t begin = 0; begin < data.size(); begin += piece) {
      auto s = nvme->allocate_slot();
      if (!s.ok()) {
        for (std::uint32_t f : fresh) nvme->free_slot(f);
        return s.status();
      }
      fresh.push_back(*s);
    }
  }
  const std::vector<std::uint32_t>& targets = write ? fresh : slots_io;
  struct Latch {
    std::mutex mu;
    std::condition_variable cv;
    std::size_t pending;
    Status status;
  } latch{.pending = targets.size()};
  lock.unlock();
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const std::uint64_t begin = i * piece;
    auto part = data.subspan(begin, std::min<std::uint64_t>(piece, data.size() - begin));
    auto done = [&latch](Status s) {
      std::lock_guard g(latch.mu);
      if (!s.ok() && latch.status.ok()) latch.status = std::move(s);
      if (--latch.pending == 0) latch.cv.notify_all();
    };
    Status st = write ? nvme->write(targets[i], part, done) : nvme->read(targets[i], part, done);
    if (!st.ok()) done(st);
  }
  {
    std::unique_lock g(latch.mu);
    latch.cv.wait(g, [&] { return latch.pending == 0; });
  }
  lock.lock();
  if (!latch.status.ok()) {
    for (std::uint32_t f : fresh) nvme->free_slot(f);
    return latch.status;
  }
  if (write) {
    for (std::uint32_t old : slots_io) nvme->free_slot(old);
    slots_io = std::move(fresh);
  }
  return Status::Ok();
}

Status Runtime::Impl::with_host_copy(std::unique_lock<std::mutex>& lock, Chunk& c, bool write,
                                     const std::function<void(std::byte*)>& fn) {
  const bool on_nvme = is_optim_kind(c.kind) && plan.families[c.family].optim_home == Tier::kNvme;
  if (!on_nvme) {
    STRATA_RETURN_IF_ERROR(ensure_on_host(lock, c));
    // A load or prefetch may still be copying from the host copy.
    if (write) STRATA_RETURN_IF_ERROR(device.synchronize(h2d));
    fn(c.host);
    if (write && c.dev_valid) {
      STRATA_CHECK(c.readers == 0);
      c.dev_valid = false;
      c.dev_dirty = false;
      if (c.slot >= 0 && !slots[static_cast<std::size_t>(c.slot)].dedicated) {
        slots[static_cast<std::size_t>(c.slot)].chunk = -1;
        c.slot = -1;
      }
    }
    return Status::Ok();
  }
  if (c.host_valid) {
    // An NVMe write-back failed and left the states in host memory (Note [Write-back after step]).
    fn(c.host);
    return Status::Ok();
  }
  if (write && runs[c.family].has_nvme_place && !runs[c.family].launched) {
    // States read ahead before this write are stale now (callers waited for the I/O).
    STRATA_CHECK(runs[c.family].io_pending == 0);
    release_nvme_place(c.family);
  }
  STRATA_ASSIGN_OR_RETURN(std::byte * tmp, host->allocate(c.bytes));
  std::span<std::byte> data(tmp, c.bytes);
  Status st = Status::Ok();
  if (c.nvme_valid) {
    st = nvme_transfer(lock, false, data, c.nvme_slots);
  } else {
    std::memset(tmp, 0, c.bytes);
  }
  if (st.ok()) {
    fn(tmp);
    if (write) {
      st = nvme_transfer(lock, true, data, c.nvme_slots);
      if (st.ok()) {
        c.nvme_valid = true;
        c.absent = false;
      }
    }
  }
  host->free(tmp, c.bytes);
  return st;
}

Status Runtime::Impl::build_slots(const Plan& p) {
  STRATA_RETURN_IF_ERROR(device.synchronize());
  for (Chunk& c : chunks) {
    if (c.slot < 0) continue;
    STRATA_CHECK(!c.dev_dirty);  // at a step boundary device copies are clean
    c.slot = -1;
    c.dev_valid = false;
  }
  slots.clear();
  device_memory.clear();
  const std::uint64_t slot_bytes =
      align_up(std::max<std::uint64_t>(layout.chunk_elems * dtype_bytes(opt.compute_dtype), 4096), 4096);
  std::vector<std::pair<std::int32_t, std::uint64_t>> wanted;  // (dedicated chunk or -1, bytes)
  if (p.all_gpu) {
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      if (chunks[i].bytes > 0) wanted.emplace_back(static_cast<std::int32_t>(i), chunks[i].bytes);
    }
  } else {
    std::uint64_t stream_bytes = slot_bytes;
    for (const FamilyBytes& f : family_bytes)
      stream_bytes = std::max({stream_bytes, f.param_bytes, f.grad_bytes});
    for (std::uint64_t s = 0; s < p.gpu_cache_slots; ++s) wanted.emplace_back(-1, stream_bytes);
    for (FamilyId f = 0; f < p.families.size(); ++f) {
      if (p.families[f].param_resident_gpu) {
        wanted.emplace_back(chunk_index(f, StateKind::kParam), chunk(f, StateKind::kParam).bytes);
      }
    }
  }
  std::uint64_t total = 0;
  for (auto& [c, bytes] : wanted) total += align_up(bytes, 4096);
  if (total > opt.budgets.gpu_bytes) {
    return out_of_budget("gpu_budget {} cannot hold the planned {} of chunk slots; raise gpu_budget",
                         format_bytes(opt.budgets.gpu_bytes), format_bytes(total));
  }
  if (total == 0) return Status::Ok();
  auto allocation = device.allocate(total);
  if (!allocation.ok()) {
    Status s = allocation.status();
    s.with_context("allocating the runtime's device chunk slots");
    return s;
  }
  auto* base = static_cast<std::byte*>(allocation->data());
  device_memory.push_back(std::move(allocation).value());
  std::uint64_t offset = 0;
  cache_slots = p.all_gpu ? 0 : p.gpu_cache_slots;
  slots.resize(wanted.size());
  for (std::size_t i = 0; i < wanted.size(); ++i) {
    DeviceSlot& slot = slots[i];
    slot.ptr = base + offset;
    slot.bytes = wanted[i].second;
    offset += align_up(wanted[i].second, 4096);
    STRATA_ASSIGN_OR_RETURN(slot.fence, device.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.ready, device.create_event());
    if (wanted[i].first >= 0) {
      slot.dedicated = true;
      slot.chunk = wanted[i].first;
      chunks[static_cast<std::size_t>(wanted[i].first)].slot = static_cast<std::int32_t>(i);
    }
  }
  return Status::Ok();
}

Status Runtime::Impl::migrate_homes(std::unique_lock<std::mutex>& lock, const Plan& p) {
  for (FamilyId f = 0; f < p.families.size(); ++f) {
    const Tier from = plan.families[f].optim_home;
    const Tier to = p.families[f].optim_home;
    if (from == to) continue;
    for (StateKind k : {StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      Chunk& c = chunk(f, k);
      if (c.bytes == 0) continue;
      if (to == Tier::kNvme) {
        if (!c.absent) {
          STRATA_RETURN_IF_ERROR(ensure_on_host(lock, c));
          STRATA_RETURN_IF_ERROR(nvme_transfer(lock, true, {c.host, c.bytes}, c.nvme_slots));
          c.nvme_valid = true;
        }
        if (c.host != nullptr) host->free(c.host, c.bytes);
        c.host = nullptr;
        c.host_valid = false;
      } else if (from == Tier::kNvme) {
        if (c.nvme_valid) {
          STRATA_ASSIGN_OR_RETURN(std::byte * buffer, host_buffer(c));
          STRATA_RETURN_IF_ERROR(nvme_transfer(lock, false, {buffer, c.bytes}, c.nvme_slots));
          for (std::uint32_t s : c.nvme_slots) nvme->free_slot(s);
          c.nvme_slots.clear();
          c.nvme_valid = false;
          c.host_valid = true;
        }
      }
    }
  }
  return Status::Ok();
}

Status Runtime::Impl::adopt_plan(std::unique_lock<std::mutex>& lock, StepTrace trace) {
  PlanInput in{.families = family_bytes,
               .trace = trace,
               .budgets = opt.budgets,
               .options = opt.plan,
               .slot_bytes = layout.chunk_elems * dtype_bytes(opt.compute_dtype)};
  // The chunk budget is the runtime's own (Note [Chunk budget]): activations are the caller's.
  in.trace.non_chunk_peak_bytes = 0;
  if (device.kind() != memory::DeviceKind::kSim && in.options.allow_gpu_optimizer) {
    in.options.allow_gpu_optimizer = false;
    STRATA_LOG_INFO(
        "runtime: optimizer steps run on the CPU: the CUDA multi-tensor optimizer is not wired into "
        "the runtime yet");
  }
  const bool first = !finalized;
  STRATA_ASSIGN_OR_RETURN(Plan p, make_plan(in));
  if (p.nvme_bytes > 0) STRATA_RETURN_IF_ERROR(ensure_nvme_store());
  if (first) {
    // Homes start where the plan puts them: nothing to migrate.
  } else {
    STRATA_CHECK(p.all_gpu == plan.all_gpu);        // sizes do not change between plans
    STRATA_RETURN_IF_ERROR(wait_optimizers(lock));  // write-backs end before homes move
    STRATA_RETURN_IF_ERROR(migrate_homes(lock, p));
  }
  if (first || !p.all_gpu) STRATA_RETURN_IF_ERROR(build_slots(p));
  plan = std::move(p);
  plan_trace = std::move(trace);
  next_use = NextUse(plan_trace.uses, layout.families.size());
  grad_slots_max = static_cast<int>(opt.plan.grad_staging_slots);
  nvme_places_max = static_cast<int>(opt.plan.nvme_families_in_flight);
  // NVMe families in the order their gradients complete in the trace (Note [Pipeline places]).
  {
    std::vector<long> last(layout.families.size(), -1);
    for (std::size_t i = 0; i < plan_trace.uses.size(); ++i) {
      if (plan_trace.uses[i].phase == Phase::kBackward)
        last[plan_trace.uses[i].family] = static_cast<long>(i);
    }
    nvme_order.clear();
    for (FamilyId f = 0; f < plan.families.size(); ++f) {
      if (plan.families[f].optim_home == Tier::kNvme && family_bytes[f].numel > 0) nvme_order.push_back(f);
    }
    std::stable_sort(nvme_order.begin(), nvme_order.end(), [&](FamilyId a, FamilyId b) {
      const long la = last[a] < 0 ? std::numeric_limits<long>::max() : last[a];
      const long lb = last[b] < 0 ? std::numeric_limits<long>::max() : last[b];
      return la < lb;
    });
  }
  STRATA_LOG_INFO("runtime: plan ({}): {}", first ? "from registration order" : "from the traced step",
                  plan.summary());
  return Status::Ok();
}

Status Runtime::Impl::deferred_prepass(std::unique_lock<std::mutex>& lock, bool* skip) {
  *skip = false;
  // Bring every written gradient to the host and check them all at once.
  std::vector<kernels::Span> all;
  for (FamilyId f = 0; f < layout.families.size(); ++f) {
    Chunk& g = chunk(f, StateKind::kGrad);
    if (g.bytes == 0 || g.absent) continue;
    bool any = false;
    for (TensorId t : layout.families[f].tensors) any = any || tensors[t].grad_written;
    if (!any) continue;
    Status st = ensure_on_host(lock, g);
    if (!st.ok()) {
      st.with_context("clipping and loss scaling keep every gradient on host until all are checked");
      return st;
    }
    FamilyPtrs ptrs;
    ptrs.at[static_cast<int>(StateKind::kGrad)] = g.host;
    // Only the gradient pointers matter for the check; the others are never read.
    std::byte dummy[64] = {};
    for (std::size_t k = 0; k < kStateKindCount; ++k) {
      if (ptrs.at[k] == nullptr) ptrs.at[k] = dummy;
    }
    for (kernels::Span s : spans_for(f, ptrs, nullptr)) {
      s.master = nullptr;
      s.param = nullptr;
      s.param_dtype = DType::kNone;
      s.state = {};
      all.push_back(s);
    }
  }
  lock.unlock();
  auto stats = kernels::grad_stats(all, grad_scale, pool.get());
  lock.lock();
  STRATA_RETURN_IF_ERROR(stats.status());
  if (!stats->finite) {
    *skip = true;
    return Status::Ok();
  }
  step_scale = grad_scale;
  if (opt.clip_max_norm > 0.0) {
    step_scale *= kernels::clip_coefficient(std::sqrt(stats->sum_squares), opt.clip_max_norm);
  }
  // The device copies are clean now (ensure_on_host wrote them back): the CPU
  // pipelines take the host copies; device optimizers read the device copies.
  return Status::Ok();
}

Result<StepStats> Runtime::step() {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  if (m.leases_out > 0) {
    return failed_precondition("step(): {} leases are still held; release every lease before step()",
                               m.leases_out);
  }
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  if (!m.background_error.ok()) return m.background_error;
  lock.unlock();
  STRATA_RETURN_IF_ERROR(m.device.synchronize(m.compute));
  lock.lock();

  StepStats stats;
  stats.followed_plan = m.following && !m.deviated && m.warm;
  bool skip = false;
  m.step_scale = m.grad_scale;
  if (m.deferred()) STRATA_RETURN_IF_ERROR(m.deferred_prepass(lock, &skip));
  if (skip) {
    STRATA_LOG_WARN(
        "runtime: step {} skipped: a gradient is Inf/NaN (loss scale too high?); no state changed",
        m.step_index + 1);
    for (FamilyId f = 0; f < m.layout.families.size(); ++f) {
      Chunk& g = m.chunk(f, StateKind::kGrad);
      if (g.host != nullptr) m.host->free(g.host, g.bytes);
      g.host = nullptr;
      g.host_valid = false;
      g.dev_valid = g.slot >= 0 && m.slots[static_cast<std::size_t>(g.slot)].dedicated ? false : g.dev_valid;
      g.dev_dirty = false;
      g.absent = true;
      if (g.slot >= 0 && !m.slots[static_cast<std::size_t>(g.slot)].dedicated) {
        m.slots[static_cast<std::size_t>(g.slot)].chunk = -1;
        g.slot = -1;
        g.dev_valid = false;
      }
    }
    for (TensorInfo& t : m.tensors) t.grad_written = false;
  } else {
    for (FamilyId f = 0; f < m.layout.families.size(); ++f) m.launch_optimizer(f);
  }
  // States read ahead for families that got no gradient this step are dropped.
  m.read_ahead = false;
  for (FamilyId f = 0; f < m.runs.size(); ++f) {
    if (m.runs[f].has_nvme_place && !m.runs[f].launched) m.cancel_read_ahead(f);
  }
  m.pump();
  // NVMe write-backs go on past step() (Note [Write-back after step]).
  Status waited = m.wait_step_work(lock);
  if (!waited.ok()) return waited;
  stats.applied = !skip;
  for (const FamilyRun& run : m.runs) {
    if (run.launched && !run.applied) stats.applied = false;
  }
  if (!stats.applied && !skip) {
    STRATA_LOG_WARN("runtime: step {}: some families had Inf/NaN gradients and were not updated",
                    m.step_index + 1);
  }

  // Trace: the compute time measured per use, then re-plan if this was the
  // warm-up step or it departed from the plan.
  StepTrace trace = m.tracer.take();
  {
    std::lock_guard g(m.compute_mu);
    for (std::size_t i = 0; i < trace.uses.size() && i < m.compute_by_use.size(); ++i) {
      trace.uses[i].compute_s = m.compute_by_use[i];
    }
    m.compute_by_use.clear();
  }
  if (!m.warm || m.deviated) {
    if (!trace.uses.empty()) STRATA_RETURN_IF_ERROR(m.adopt_plan(lock, std::move(trace)));
    m.warm = true;
  } else if (trace.uses.size() == m.plan_trace.uses.size()) {
    m.plan_trace = std::move(trace);  // keep the freshest compute times
  }
  m.following = m.warm;
  m.deviated = false;
  m.pos = SIZE_MAX;
  m.in_backward = false;
  std::fill(m.grads_written.begin(), m.grads_written.end(), 0);
  for (TensorInfo& t : m.tensors) t.written_in_micro_batch = false;
  m.launch_fifo.clear();
  m.grad_queue.clear();
  m.read_ahead_cursor = 0;
  for (FamilyRun& run : m.runs) run = FamilyRun{};
  ++m.step_index;

  // Counters.
  stats.step = m.step_index;
  const double now = m.timeline.now_us();
  stats.step_s = (now - m.step_start_us) * 1e-6;
  m.step_start_us = now;
  const memory::CopyStats h2d = m.device.copy_stats(memory::CopyKind::kHostToDevice);
  const memory::CopyStats d2h = m.device.copy_stats(memory::CopyKind::kDeviceToHost);
  stats.bytes_h2d = h2d.bytes - m.prev_copy_bytes[0];
  stats.bytes_d2h = d2h.bytes - m.prev_copy_bytes[1];
  m.prev_copy_bytes[0] = h2d.bytes;
  m.prev_copy_bytes[1] = d2h.bytes;
  for (std::size_t t = 0; t < kTrackCount; ++t) {
    TrackStats ts = m.timeline.stats(static_cast<Track>(t));
    stats.busy_s[t] = ts.busy_s - m.prev_tracks[t].busy_s;
    if (static_cast<Track>(t) == Track::kDiskRead) stats.bytes_disk_read = ts.bytes - m.prev_tracks[t].bytes;
    if (static_cast<Track>(t) == Track::kDiskWrite)
      stats.bytes_disk_write = ts.bytes - m.prev_tracks[t].bytes;
    m.prev_tracks[t] = ts;
  }
  const double stall = m.timeline.stall_s();
  stats.stall_s = stall - m.prev_stall_s;
  m.prev_stall_s = stall;
  stats.gpu_high_water_bytes = m.gpu_high_water;
  stats.host_high_water_bytes = m.host->high_water_bytes();
  stats.nvme_bytes = m.nvme != nullptr ? m.nvme->used_bytes() : 0;
  return stats;
}

Status Runtime::flush() {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  return m.wait_optimizers(lock);
}

}  // namespace strata::runtime
