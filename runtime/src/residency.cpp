// Slots, moves, eviction and prefetch: Note [Chunk state machine].
#include <algorithm>
#include <cstring>
#include <limits>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

StepTrace registration_trace(std::size_t families) {
  StepTrace trace;
  for (std::size_t f = 0; f < families; ++f) {
    trace.uses.push_back({.family = static_cast<FamilyId>(f), .phase = Phase::kForward});
  }
  for (std::size_t f = families; f-- > 0;) {
    trace.uses.push_back(
        {.family = static_cast<FamilyId>(f), .phase = Phase::kBackward, .writes_grad = true});
  }
  return trace;
}

void Runtime::Impl::note_gpu_use() {
  std::uint64_t used = 0;
  for (const DeviceSlot& s : slots) {
    if (s.chunk >= 0 && chunks[static_cast<std::size_t>(s.chunk)].dev_valid) used += s.bytes;
  }
  gpu_high_water = std::max(gpu_high_water, used);
}

Status Runtime::Impl::timed_copy(const memory::Stream& stream, Track track, void* dst, const void* src,
                                 std::uint64_t bytes, memory::CopyKind kind, std::string name) {
  // The span starts when the stream reaches the copy (after any event waits),
  // not when it was enqueued.
  auto start = std::make_shared<double>(0.0);
  STRATA_RETURN_IF_ERROR(device.launch_host(stream, [this, start] { *start = timeline.now_us(); }));
  STRATA_RETURN_IF_ERROR(device.copy_async(stream, dst, src, bytes, kind));
  return device.launch_host(stream, [this, start, track, bytes, name = std::move(name)] {
    timeline.add(track, name, *start, timeline.now_us(), bytes);
  });
}

void Runtime::Impl::record_span(Track track, std::string name, double enqueued_us, std::uint64_t bytes) {
  // Called in stream order on the track's own stream: the span began when both
  // it was enqueued and the previous span on the track had ended.
  const double end = timeline.now_us();
  const double previous = track_end_us[static_cast<std::size_t>(track)].exchange(end);
  timeline.add(track, std::move(name), std::max(enqueued_us, previous), end, bytes);
}

Result<std::byte*> Runtime::Impl::host_buffer(Chunk& c) {
  if (c.host != nullptr) return c.host;
  auto buffer = host->allocate(c.bytes);
  if (!buffer.ok()) {
    Status s = buffer.status();
    s.with_context(fmt::format("host copy of family {} {} ({})", c.family, state_kind_name(c.kind),
                               format_bytes(c.bytes)));
    return s;
  }
  c.host = *buffer;
  return c.host;
}

// Enqueues the copy host -> slot on the h2d stream after the slot's previous users.
Status Runtime::Impl::load_to_slot(Chunk& c, DeviceSlot& slot) {
  if (!c.host_valid) {
    if (!c.absent) {
      return internal_error("family {} {}: loading to the device with no host copy", c.family,
                            state_kind_name(c.kind));
    }
    // Never written: its value is zeros (optimizer states start at zero).
    if (slot.dedicated) {
      // A chunk that lives on the device for good (an all-GPU plan) gets no host
      // copy: the plan gave it none, so the zeros go through a temporary buffer.
      STRATA_ASSIGN_OR_RETURN(std::byte * zeros, host->allocate(c.bytes));
      std::memset(zeros, 0, c.bytes);
      Status st = device.wait(h2d, slot.fence);
      if (st.ok())
        st = timed_copy(h2d, Track::kH2D, slot.ptr, zeros, c.bytes, memory::CopyKind::kHostToDevice,
                        fmt::format("h2d f{} {} zeros", c.family, state_kind_name(c.kind)));
      if (st.ok()) st = device.synchronize(h2d);  // once per chunk, at its first use
      host->free(zeros, c.bytes);
      STRATA_RETURN_IF_ERROR(st);
      STRATA_RETURN_IF_ERROR(device.record(slot.ready, h2d));
      STRATA_RETURN_IF_ERROR(device.record(slot.fence, h2d));
      c.absent = false;
      c.dev_valid = true;
      c.dev_dirty = true;  // the device copy is the only one
      return Status::Ok();
    }
    STRATA_ASSIGN_OR_RETURN(std::byte * zeros, host_buffer(c));
    std::memset(zeros, 0, c.bytes);
    c.host_valid = true;
    c.absent = false;
  }
  STRATA_RETURN_IF_ERROR(device.wait(h2d, slot.fence));
  if (!opt.plan.prefetch) {
    // Without prefetch a move starts when the compute that needs it is reached
    // (PlanOptions::prefetch), not when the host thread, running ahead, asks.
    STRATA_RETURN_IF_ERROR(device.record(demand, compute));
    STRATA_RETURN_IF_ERROR(device.wait(h2d, demand));
  }
  STRATA_RETURN_IF_ERROR(timed_copy(h2d, Track::kH2D, slot.ptr, c.host, c.bytes,
                                    memory::CopyKind::kHostToDevice,
                                    fmt::format("h2d f{} {}", c.family, state_kind_name(c.kind))));
  STRATA_RETURN_IF_ERROR(device.record(slot.ready, h2d));
  STRATA_RETURN_IF_ERROR(device.record(slot.fence, h2d));
  if (!c.host_read.valid()) {
    STRATA_ASSIGN_OR_RETURN(c.host_read, device.create_event());
  }
  return device.record(c.host_read, h2d);
}

Status Runtime::Impl::wait_host_reads(Chunk& c) {
  // Rare: the slot the load went to may have been given away already, so the
  // chunk's own event, not the slot's, says when its host copy is free. The h2d
  // stream never needs the runtime's lock (Note [Runtime threading]).
  if (!c.host_read.valid()) return Status::Ok();  // never loaded
  auto done = device.query(c.host_read);
  if (done.ok() && *done) return Status::Ok();
  return device.synchronize(c.host_read);
}

Status Runtime::Impl::evict_slot(std::size_t s) {
  DeviceSlot& slot = slots[s];
  if (slot.chunk < 0) return Status::Ok();
  Chunk& c = chunks[static_cast<std::size_t>(slot.chunk)];
  STRATA_CHECK(c.readers == 0);
  STRATA_CHECK(c.writers == 0);
  if (c.dev_valid && c.dev_dirty) {
    // Write back before the slot is reused (a gradient between micro-batches, or
    // any dirty chunk pushed out by an unplanned access).
    STRATA_ASSIGN_OR_RETURN(std::byte * dst, host_buffer(c));
    STRATA_RETURN_IF_ERROR(device.wait(d2h, slot.fence));
    STRATA_RETURN_IF_ERROR(device.copy_async(d2h, dst, slot.ptr, c.bytes, memory::CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(device.record(slot.fence, d2h));
    // The host copy is authoritative from here; readers of it synchronise on d2h.
    STRATA_RETURN_IF_ERROR(device.synchronize(d2h));
    c.host_valid = true;
    c.dev_dirty = false;
  }
  c.dev_valid = false;
  c.slot = -1;
  slot.chunk = -1;
  return Status::Ok();
}

bool Runtime::Impl::movable(const DeviceSlot& slot) const {
  if (slot.chunk < 0) return true;
  const Chunk& c = chunks[static_cast<std::size_t>(slot.chunk)];
  if (c.readers > 0 || c.writers > 0) return false;
  // A complete gradient waiting for the optimizer pipeline leaves by itself;
  // writing it back to host would spend host memory the plan did not give it.
  // Waiting for the pipeline is the back-pressure (ensure_on_device).
  return !(c.kind == StateKind::kGrad && runs[c.family].launched);
}

std::int64_t Runtime::Impl::pick_slot(FamilyId for_family, std::uint64_t farther_than) {
  // A free slot, or a victim nobody leases: farthest next use when following
  // the plan (Note [Cyclic access sequence]), least recently used otherwise.
  // Clean chunks are preferred over dirty ones (no write-back).
  //
  // Note [Idle victims first]
  // The training thread runs ahead of the device, so the free slot or the
  // farthest-next-use victim is often one whose last use (a compute, or the d2h
  // of a gradient) is still queued: a load into it waits for that work, and the
  // h2d stream (one queue) holds every later load behind it, so the next compute
  // stalls for the whole copy. So slots are ranked: idle (fence completed, and
  // not needed within the prefetch window) before busy; within each, free before
  // occupied; then by next use. The price is at most a few more fetches a step,
  // on a link that is rarely the bottleneck.
  const bool planned = following && next_use.length() > 0;
  const std::size_t here = pos == SIZE_MAX ? 0 : pos;
  std::int64_t best = -1;
  std::uint64_t best_key = 0;
  int best_rank = -1;
  for (std::size_t s = 0; s < cache_slots; ++s) {
    if (!movable(slots[s])) continue;
    const bool free = slots[s].chunk < 0;
    std::uint64_t key = 0;
    bool soon = false;  // needed within the prefetch window: loaded for that use
    if (!free) {
      const Chunk& c = chunks[static_cast<std::size_t>(slots[s].chunk)];
      if (c.family == for_family && c.kind != StateKind::kGrad) continue;
      // A gradient still being accumulated is used again at the family's next backward use.
      const std::uint64_t d = planned ? next_use.distance(c.family, here) : 0;
      if (farther_than > 0 && (c.dev_dirty || d <= farther_than)) continue;
      if (planned) {
        key = (d == NextUse::kNever ? std::numeric_limits<std::uint32_t>::max() : d) * 2 +
              (c.dev_dirty ? 0 : 1);
        soon = d <= std::uint64_t{plan.prefetch_depth} + 1;
      } else {
        key = (std::numeric_limits<std::uint64_t>::max() / 4 - c.tick) * 2 + (c.dev_dirty ? 0 : 1);
      }
    }
    auto done = device.query(slots[s].fence);
    const bool idle = done.ok() && *done && !soon;
    const int rank = (idle ? 2 : 0) + (free ? 1 : 0);
    if (rank > best_rank || (rank == best_rank && key > best_key)) {
      best = static_cast<std::int64_t>(s);
      best_key = key;
      best_rank = rank;
    }
  }
  return best;
}

Status Runtime::Impl::ensure_on_device(std::unique_lock<std::mutex>& lock, Chunk& c, bool load) {
  c.tick = ++tick;
  if (c.slot >= 0 && c.dev_valid) return Status::Ok();
  if (c.slot >= 0 && slots[static_cast<std::size_t>(c.slot)].dedicated) {
    DeviceSlot& slot = slots[static_cast<std::size_t>(c.slot)];
    if (load) STRATA_RETURN_IF_ERROR(load_to_slot(c, slot));
    c.dev_valid = true;
    return Status::Ok();
  }
  for (;;) {
    std::int64_t s = pick_slot(c.family);
    if (s >= 0) {
      STRATA_RETURN_IF_ERROR(evict_slot(static_cast<std::size_t>(s)));
      DeviceSlot& slot = slots[static_cast<std::size_t>(s)];
      slot.chunk = chunk_index(c.family, c.kind);
      c.slot = static_cast<std::int32_t>(s);
      if (load) {
        STRATA_RETURN_IF_ERROR(load_to_slot(c, slot));
      } else {
        // Nothing to load, but the new content must still wait for the slot's
        // previous users: order the next writer (compute) after the fence.
        STRATA_RETURN_IF_ERROR(device.wait(h2d, slot.fence));
        STRATA_RETURN_IF_ERROR(device.record(slot.ready, h2d));
      }
      c.dev_valid = true;
      note_gpu_use();
      return Status::Ok();
    }
    // Every slot is leased or holds a gradient on its way to the optimizer.
    if (tasks_in_flight == 0) {
      return out_of_budget(
          "gpu_budget: all {} chunk slots of {} are held by leases or gradients; the working set does not "
          "fit. Release leases sooner, or raise gpu_budget (now {})",
          cache_slots, format_bytes(slots.empty() ? 0 : slots[0].bytes), format_bytes(opt.budgets.gpu_bytes));
    }
    const double t0 = timeline.now_us();
    cv.wait(lock);
    timeline.add_stall((timeline.now_us() - t0) * 1e-6);
    if (!background_error.ok()) return background_error;
  }
}

Status Runtime::Impl::ensure_on_host(std::unique_lock<std::mutex>& lock, Chunk& c) {
  (void)lock;
  if (c.dev_valid && c.dev_dirty) {
    STRATA_ASSIGN_OR_RETURN(std::byte * dst, host_buffer(c));
    DeviceSlot& slot = slots[static_cast<std::size_t>(c.slot)];
    STRATA_RETURN_IF_ERROR(device.wait(d2h, slot.fence));
    STRATA_RETURN_IF_ERROR(device.copy_async(d2h, dst, slot.ptr, c.bytes, memory::CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(device.record(slot.fence, d2h));
    STRATA_RETURN_IF_ERROR(device.synchronize(d2h));
    c.host_valid = true;
    c.dev_dirty = false;
    return Status::Ok();
  }
  if (c.host_valid) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(std::byte * dst, host_buffer(c));
  if (c.nvme_valid) {
    return internal_error("family {} {} is on NVMe; host copies of NVMe chunks go through staging", c.family,
                          state_kind_name(c.kind));
  }
  std::memset(dst, 0, c.bytes);
  c.host_valid = true;
  c.absent = false;
  return Status::Ok();
}

void Runtime::Impl::prefetch() {
  if (!following || !opt.plan.prefetch || plan.all_gpu || plan.prefetch_depth == 0) return;
  const auto& uses = plan_trace.uses;
  const std::size_t start = pos == SIZE_MAX ? 0 : pos + 1;
  for (std::size_t q = start; q < uses.size() && q < start + plan.prefetch_depth; ++q) {
    const FamilyId f = uses[q].family;
    Chunk& c = chunk(f, StateKind::kParam);
    if (c.dev_valid || !c.host_valid || c.bytes == 0) continue;
    if (runs[f].launched && !runs[f].done) continue;  // being updated
    if (c.slot >= 0 && slots[static_cast<std::size_t>(c.slot)].dedicated) {
      if (!load_to_slot(c, slots[static_cast<std::size_t>(c.slot)]).ok()) return;
      c.dev_valid = true;
      continue;
    }
    // Leave two slots to the uses on demand (the next param and gradient): slots
    // hogged by gradients waiting for the optimizer pipeline would otherwise make
    // a prefetch and the next demand evict each other's chunk, round after round.
    std::size_t room = 0;
    for (std::size_t i = 0; i < cache_slots; ++i) room += movable(slots[i]) ? 1 : 0;
    if (room <= 2) return;
    // Take a slot only if its occupant is clean and used later than this prefetch target.
    const std::size_t here = pos == SIZE_MAX ? 0 : pos;
    const std::int64_t s = pick_slot(f, std::max<std::uint64_t>(q - here, 1));
    if (s < 0) return;
    if (!evict_slot(static_cast<std::size_t>(s)).ok()) return;
    DeviceSlot& slot = slots[static_cast<std::size_t>(s)];
    slot.chunk = chunk_index(f, StateKind::kParam);
    c.slot = static_cast<std::int32_t>(s);
    Status st = load_to_slot(c, slot);
    if (!st.ok()) {
      fail(st);
      return;
    }
    c.dev_valid = true;
    c.tick = ++tick;
    note_gpu_use();
  }
}

}  // namespace strata::runtime
