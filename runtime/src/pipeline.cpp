// The CPU optimizer pipeline for families whose states live on host or NVMe.
//
// Note [Pipeline places]
// Two bounded resources gate the pipeline, each reserved by the planner:
//   - gradient slots (grad_staging_slots): a family holds one from the moment its
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
// Note [Copy-on-write NVMe slots]
// Updated NVMe states are written to fresh slots, and the param (the fp32 master
// itself for fp32 compute) is updated in a staging copy. Every fresh slot is
// taken before anything is committed, and the old slots are freed only when
// every write of the family succeeded; a failure surfaces from the next call.
// From the first failure on, no family starts; the ones already running finish.
// So after a failure every family holds either its state before the step or
// after it — never a mix: a full disk leaves the failed family (named in the
// error) before it, a failed write after it (Note [Write-back after step]).
//
// Note [Write-back after step]
// An NVMe family's write-back is not part of its step: once its kernel has run,
// the updated param is committed at once (the next forward needs it first —
// backward finishes with the first layers, so waiting for their writes would
// idle the device), and the updated states go to fresh slots in the background
// while step() returns and the next forward runs. The family keeps its NVMe
// place (and so its staging memory) until the writes end; its next read waits
// for them. When they succeed the new slots replace the old; when one fails the
// updated states stay in host memory as the authoritative copy (nothing is lost:
// read_tensor reads them), the error surfaces from the next call, and no further
// family starts. So a write failure leaves its family at the state *after* the
// step; a full disk (no slot to write to, found before anything is committed)
// leaves it at the state before. flush() waits for every write-back.

#include <cstring>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {
bool Runtime::Impl::on_nvme(FamilyId f) const {
  return plan.families[f].optim_home == Tier::kNvme;
}

void Runtime::Impl::pump() {
  if (!background_error.ok()) {
    // Nothing new starts after a failure (Note [Copy-on-write NVMe slots]);
    // families waiting for a place or a gradient end here, untouched.
    grad_queue.clear();
    for (FamilyId f : launch_fifo) {
      FamilyRun& run = runs[f];
      // (A gradient still being copied to host ends here when its copy lands.)
      const bool copying_grad = run.has_grad_slot && !run.grad_ready;
      if (!run.done && !run.computing && run.io_pending == 0 && !copying_grad) finish_family(f, Status::Ok());
    }
    return;
  }
  // 1. NVMe places: launched families first, in launch order.
  for (FamilyId f : launch_fifo) {
    FamilyRun& run = runs[f];
    if (!on_nvme(f) || run.has_nvme_place || run.done) continue;
    if (writebacks[f].active) continue;  // writeback_done pumps again
    if (nvme_places_used >= nvme_places_max) {
      // Take a place back from a read-ahead that is not launched yet.
      for (FamilyId g : nvme_order) {
        FamilyRun& other = runs[g];
        if (other.has_nvme_place && !other.launched && !other.cancel_read_ahead) {
          cancel_read_ahead(g);
          break;
        }
      }
      if (nvme_places_used >= nvme_places_max) break;
    }
    take_nvme_place(f);
  }
  // Then read ahead in the traced completion order.
  if (read_ahead) {
    for (; read_ahead_cursor < nvme_order.size() && nvme_places_used < nvme_places_max; ++read_ahead_cursor) {
      FamilyId f = nvme_order[read_ahead_cursor];
      FamilyRun& run = runs[f];
      if (run.has_nvme_place || run.states_ready || (run.launched && run.done)) continue;
      if (writebacks[f].active) break;  // its last step's states are still being written
      take_nvme_place(f);
    }
  }
  // 2. Gradient slots, first come first served.
  while (!grad_queue.empty() && grad_slots_used < grad_slots_max) {
    FamilyId f = grad_queue.front();
    grad_queue.pop_front();
    if (!runs[f].done) land_gradient(f);
  }
}

void Runtime::Impl::take_nvme_place(FamilyId f) {
  FamilyRun& run = runs[f];
  STRATA_CHECK(!run.has_nvme_place);
  run.has_nvme_place = true;
  ++nvme_places_used;
  read_states(f);
}

void Runtime::Impl::release_nvme_place(FamilyId f) {
  FamilyRun& run = runs[f];
  if (!run.has_nvme_place) return;
  for (std::size_t k = 0; k < run.staging.size(); ++k) {
    if (run.staging[k] != nullptr) host->free(run.staging[k], chunks[f * kStateKindCount + k].bytes);
  }
  run.staging.clear();
  run.states_ready = false;
  run.has_nvme_place = false;
  --nvme_places_used;
}

void Runtime::Impl::cancel_read_ahead(FamilyId f) {
  FamilyRun& run = runs[f];
  if (run.io_pending > 0) {
    run.cancel_read_ahead = true;  // io_done releases the place
    return;
  }
  release_nvme_place(f);
}

void Runtime::Impl::read_states(FamilyId f) {
  FamilyRun& run = runs[f];
  run.staging.assign(kStateKindCount, nullptr);
  std::vector<std::pair<std::uint32_t, std::span<std::byte>>> pieces;
  const std::uint64_t piece = nvme->slot_bytes();
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = chunks[f * kStateKindCount + k];
    if (c.bytes == 0 || (!is_optim_kind(c.kind) && c.kind != StateKind::kParam)) continue;
    auto buffer = host->allocate(c.bytes);
    if (!buffer.ok()) {
      if (!run.launched) {
        // Reading ahead is an optimisation: without room it waits for the launch.
        STRATA_LOG_DEBUG("runtime: no host room to read family {} ahead: {}", f, buffer.status().to_string());
        release_nvme_place(f);
        return;
      }
      Status s = buffer.status();
      s.with_context(fmt::format("NVMe staging for family {}", f));
      finish_family(f, s);
      return;
    }
    run.staging[k] = *buffer;
    if (c.kind == StateKind::kParam) continue;  // copied when the kernel starts
    if (c.host_valid) {
      std::memcpy(*buffer, c.host, c.bytes);  // left in host memory by a failed write-back
      continue;
    }
    if (!c.nvme_valid) {
      std::memset(*buffer, 0, c.bytes);  // never written: zeros
      continue;
    }
    for (std::size_t i = 0; i < c.nvme_slots.size(); ++i) {
      const std::uint64_t begin = i * piece;
      pieces.emplace_back(
          c.nvme_slots[i],
          std::span<std::byte>(*buffer + begin, std::min<std::uint64_t>(piece, c.bytes - begin)));
    }
  }
  if (pieces.empty()) {
    run.states_ready = true;
    maybe_compute(f);
    return;
  }
  run.io_pending = static_cast<int>(pieces.size());
  run.io_status = Status::Ok();
  ++io_families;
  // Submitted from a pool thread, without the lock: a store may call back on the
  // submitting thread, and the caller may be iterating the pipeline's queues.
  const double enqueued = timeline.now_us();
  pool->post([this, f, enqueued, pieces = std::move(pieces)] {
    for (auto& [slot, data] : pieces) {
      const std::uint64_t len = data.size();
      auto done = [this, f, enqueued, len](Status s) {
        io_done(f, std::move(s), Track::kDiskRead, enqueued, len);
      };
      Status st = nvme->read(slot, data, done);
      if (!st.ok()) done(st);  // no callback will come for this piece
    }
  });
}

void Runtime::Impl::land_gradient(FamilyId f) {
  FamilyRun& run = runs[f];
  Chunk& g = chunk(f, StateKind::kGrad);
  run.has_grad_slot = true;
  ++grad_slots_used;
  if (g.dev_valid && g.dev_dirty) {
    auto buffer = host->allocate(g.bytes);
    if (!buffer.ok()) {
      Status s = buffer.status();
      s.with_context(fmt::format("gradient staging for family {}", f));
      finish_family(f, s);
      return;
    }
    run.grad_host = *buffer;
    DeviceSlot& slot = slots[static_cast<std::size_t>(g.slot)];
    Status st = device.wait(d2h, slot.fence);
    if (st.ok())
      st = timed_copy(d2h, Track::kD2H, run.grad_host, slot.ptr, g.bytes, memory::CopyKind::kDeviceToHost,
                      fmt::format("d2h f{} grad", f));
    if (st.ok()) st = device.record(slot.fence, d2h);
    if (st.ok()) {
      st = device.launch_host(d2h, [this, f] {
        // Device-stream callbacks never take the mutex (Note [Runtime threading]).
        pool->post([this, f] {
          std::lock_guard lock(mu);
          runs[f].grad_ready = true;
          if (background_error.ok()) {
            maybe_compute(f);
          } else {
            pump();  // ends this family, untouched, now that its staging is free to reuse
            cv.notify_all();
          }
        });
      });
    }
    // The slot may take a new occupant now: its writes wait on the fence.
    if (!slot.dedicated) {
      slot.chunk = -1;
      g.slot = -1;
    }
    g.dev_valid = false;
    g.dev_dirty = false;
    if (!st.ok()) finish_family(f, st);
    return;
  }
  if (g.host_valid) {
    run.grad_host = g.host;
    run.grad_host_owned_by_chunk = true;
    run.grad_ready = true;
    maybe_compute(f);
    return;
  }
  finish_family(f, internal_error("family {}: gradient is on no tier when its optimizer starts", f));
}

void Runtime::Impl::maybe_compute(FamilyId f) {
  FamilyRun& run = runs[f];
  if (!run.launched || run.computing || run.done || !run.grad_ready) return;
  if (on_nvme(f) && !run.states_ready) return;
  run.computing = true;
  pool->post([this, f] { compute_family(f); });
}

void Runtime::Impl::io_done(FamilyId f, Status status, Track track, double enqueued_us, std::uint64_t bytes) {
  const double end = timeline.now_us();
  timeline.add(track, "nvme read", enqueued_us, end, bytes);
  std::lock_guard lock(mu);
  FamilyRun& run = runs[f];
  if (!status.ok() && run.io_status.ok()) {
    status.with_context(fmt::format("NVMe read of family {}'s optimizer states", f));
    run.io_status = std::move(status);
  }
  if (--run.io_pending > 0) return;
  --io_families;
  if (run.cancel_read_ahead) {
    run.cancel_read_ahead = false;
    release_nvme_place(f);
    pump();
    cv.notify_all();
    return;
  }
  if (!run.io_status.ok()) {
    if (run.launched) {
      finish_family(f, run.io_status);
    } else {
      fail(run.io_status);  // a read-ahead failed: the data is bad or the disk is
      release_nvme_place(f);
      cv.notify_all();
    }
    return;
  }
  run.states_ready = true;
  maybe_compute(f);
  cv.notify_all();
}

void Runtime::Impl::writeback_done(FamilyId f, Status status, double enqueued_us, std::uint64_t bytes) {
  timeline.add(Track::kDiskWrite, "nvme write", enqueued_us, timeline.now_us(), bytes);
  std::lock_guard lock(mu);
  WriteBack& wb = writebacks[f];
  if (!status.ok() && wb.status.ok()) wb.status = std::move(status);
  if (--wb.io_pending > 0) return;
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = chunks[f * kStateKindCount + k];
    if (c.bytes == 0 || !is_optim_kind(c.kind)) continue;
    if (wb.status.ok()) {
      // The new slots replace the old (Note [Copy-on-write NVMe slots]).
      for (std::uint32_t old : c.nvme_slots) nvme->free_slot(old);
      c.nvme_slots = std::move(wb.new_slots[k]);
      c.nvme_valid = true;
      host->free(wb.staging[k], c.bytes);
    } else {
      // The updated states stay in host memory as the authoritative copy.
      for (std::uint32_t s : wb.new_slots[k]) nvme->free_slot(s);
      for (std::uint32_t old : c.nvme_slots) nvme->free_slot(old);
      c.nvme_slots.clear();
      c.nvme_valid = false;
      if (c.host != nullptr) host->free(c.host, c.bytes);
      c.host = wb.staging[k];
      c.host_valid = true;
    }
    c.absent = false;
  }
  if (!wb.status.ok()) {
    Status s = std::move(wb.status);
    s.with_context(fmt::format(
        "NVMe write-back of family {}'s optimizer states after step {}; that step's states are kept in host "
        "memory (read_tensor reads them: save a checkpoint) and no further step runs",
        f, wb.step));
    fail(std::move(s));
  }
  wb = WriteBack{};
  --writebacks_in_flight;
  --nvme_places_used;  // the family's place, held since its states were read
  pump();
  cv.notify_all();
}

void Runtime::Impl::compute_family(FamilyId f) {
  std::unique_lock lock(mu);
  FamilyRun& run = runs[f];
  const bool nvme_family = on_nvme(f);
  FamilyPtrs ptrs;
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = chunks[f * kStateKindCount + k];
    if (c.bytes == 0) continue;
    if (c.kind == StateKind::kGrad) {
      ptrs.at[k] = run.grad_host;
    } else if (nvme_family && (is_optim_kind(c.kind) || c.kind == StateKind::kParam)) {
      ptrs.at[k] = run.staging[k];
    } else {
      Status st = ensure_on_host(lock, c);
      if (!st.ok()) {
        finish_family(f, st);
        return;
      }
      ptrs.at[k] = c.host;
    }
  }
  Chunk& p = chunk(f, StateKind::kParam);
  std::vector<TensorId> updated;
  std::vector<kernels::Span> spans = spans_for(f, ptrs, &updated);
  std::vector<std::int64_t> steps;
  std::vector<kernels::Hyper> hypers;
  kernel_keys(updated, &steps, &hypers);
  const float scale = step_scale;
  // The kernel writes a host family's param in place: no load may still read it.
  if (!nvme_family) {
    if (Status st = wait_host_reads(p); !st.ok()) {
      finish_family(f, st);
      return;
    }
  }
  lock.unlock();

  const double t0 = timeline.now_us();
  // The param is updated in its staging copy for NVMe families; nothing else
  // writes the host param while this family's optimizer runs.
  if (nvme_family) std::memcpy(ptrs.at[static_cast<int>(StateKind::kParam)], p.host, p.bytes);
  Result<kernels::StepReport> r = run_kernels(spans, steps, scale, hypers);
  std::uint64_t elems = 0;
  for (const auto& s : spans) elems += s.n;
  timeline.add(Track::kCpuOptimizer, fmt::format("optimizer f{}", f), t0, timeline.now_us(), elems);

  lock.lock();
  release_gradient(f, r.ok());
  if (!r.ok()) {
    finish_family(f, r.status());
    return;
  }
  run.applied = r->applied;
  run.updated = std::move(updated);
  if (!nvme_family || !r->applied) {
    if (r->applied) commit_param(f);
    finish_family(f, Status::Ok());
    return;
  }
  // Write the updated states to fresh slots (Note [Copy-on-write NVMe slots]);
  // every slot is taken before anything is committed, so a full disk leaves the
  // family as it was.
  std::vector<std::vector<std::uint32_t>> new_slots(kStateKindCount);
  std::vector<std::pair<std::uint32_t, std::span<const std::byte>>> writes;
  const std::uint64_t piece = nvme->slot_bytes();
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = chunks[f * kStateKindCount + k];
    if (c.bytes == 0 || !is_optim_kind(c.kind)) continue;
    for (std::uint64_t begin = 0; begin < c.bytes; begin += piece) {
      auto slot = nvme->allocate_slot();
      if (!slot.ok()) {
        for (auto& list : new_slots) {
          for (std::uint32_t s : list) nvme->free_slot(s);
        }
        Status st = slot.status();
        st.with_context(fmt::format("NVMe write of family {}'s optimizer states", f));
        finish_family(f, st);
        return;
      }
      new_slots[k].push_back(*slot);
      writes.emplace_back(
          *slot, std::span<const std::byte>(run.staging[k] + begin, std::min(piece, c.bytes - begin)));
    }
  }
  // Commit the param now; the states follow in the background (Note [Write-back after step]).
  std::byte*& staged = run.staging[static_cast<std::size_t>(StateKind::kParam)];
  // A load of the old param may still be copying from it.
  if (Status st = wait_host_reads(p); !st.ok()) fail(st);
  host->free(p.host, p.bytes);
  p.host = staged;
  staged = nullptr;
  commit_param(f);
  WriteBack& wb = writebacks[f];
  STRATA_CHECK(!wb.active);
  wb.active = true;
  wb.staging = std::move(run.staging);
  wb.new_slots = std::move(new_slots);
  wb.io_pending = static_cast<int>(writes.size());
  wb.step = step_index + 1;
  ++writebacks_in_flight;
  // The place (and its staging memory) goes with the write-back.
  run.staging.clear();
  run.states_ready = false;
  run.has_nvme_place = false;
  finish_family(f, Status::Ok());
  if (writes.empty()) {
    lock.unlock();
    writeback_done(f, Status::Ok(), timeline.now_us(), 0);  // (a family with no optimizer states)
    return;
  }
  lock.unlock();  // a store may call back on this thread
  const double enqueued = timeline.now_us();
  for (auto& [slot, data] : writes) {
    auto done = [this, f, enqueued, n = data.size()](Status s) {
      writeback_done(f, std::move(s), enqueued, n);
    };
    Status st = nvme->write(slot, data, done);
    if (!st.ok()) done(st);
  }
}

void Runtime::Impl::release_gradient(FamilyId f, bool consumed) {
  FamilyRun& run = runs[f];
  Chunk& g = chunk(f, StateKind::kGrad);
  if (run.grad_host != nullptr && !run.grad_host_owned_by_chunk) host->free(run.grad_host, g.bytes);
  run.grad_host = nullptr;
  if (consumed) {
    if (g.host != nullptr) {
      host->free(g.host, g.bytes);
      g.host = nullptr;
    }
    g.host_valid = false;
    g.absent = true;
    g.dev_dirty = false;
    g.dev_valid = false;
    if (g.slot >= 0 && !slots[static_cast<std::size_t>(g.slot)].dedicated) {
      slots[static_cast<std::size_t>(g.slot)].chunk = -1;
      g.slot = -1;
    }
    for (TensorId t : layout.families[f].tensors) tensors[t].grad_written = false;
  }
  if (run.has_grad_slot) {
    run.has_grad_slot = false;
    --grad_slots_used;
  }
}

void Runtime::Impl::finish_family(FamilyId f, Status status) {
  FamilyRun& run = runs[f];
  STRATA_CHECK(run.launched);
  STRATA_CHECK(!run.done);
  if (run.has_grad_slot && !run.grad_ready && run.grad_host != nullptr && !run.grad_host_owned_by_chunk) {
    // An error ends the family while its gradient is still being copied into
    // the staging buffer: the copy must land before the buffer is reused (the
    // d2h stream never takes this lock, Note [Runtime threading]).
    device.synchronize(d2h).ignore();
  }
  if (run.has_grad_slot) release_gradient(f, /*consumed=*/false);
  release_nvme_place(f);
  if (!status.ok()) fail(status);
  run.done = true;
  --tasks_in_flight;
  pump();
  cv.notify_all();
}

}  // namespace strata::runtime
