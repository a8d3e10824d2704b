// Residency: device slots and the moves between host and device
// (residency.hpp; Note [Chunk state machine] in chunk.hpp). Victims and prefetch
// are in eviction.cpp.
#include "residency/residency.hpp"

#include <algorithm>
#include <cstring>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {
namespace {
// The source of an all-GPU chunk's first zeros (load_to_slot); never written.
alignas(4096) const std::byte kZeros[256 * 1024] = {};
}  // namespace

Status Residency::init() {
  STRATA_ASSIGN_OR_RETURN(demand_, core_.device.create_event());
  return Status::Ok();
}

void Residency::clear() {
  device_slots_.clear();
  device_memory_.clear();
}

void Residency::occupy(Chunk& c, std::size_t s) {
  device_slots_[s].chunk = core_.chunk_index(c.family, c.kind);
  c.device_slot = static_cast<std::int32_t>(s);
}

// Note [Slot detach]: the one place a chunk lets go of a streaming slot without
// a write-back (the copy is stale or consumed); the slot's fence still orders
// its next occupant after every earlier user.
void Residency::drop_device_copy(Chunk& c) {
  STRATA_CHECK(!c.dirty());  // the only copy: write it back first
  c.device_copy = false;
  if (c.device_slot >= 0 && !slot_of(c).dedicated) {
    slot_of(c).chunk = -1;
    c.device_slot = -1;
  }
}

// Note [Host room] in planner.cpp: a gradient's host copy is the room's only while it is
// the gradient's value. Called when the gradient's d2h copy into staging has landed.
// The h2d load that last read the copy is usually done by then, but not always: under
// load the landing callback can run first (a test failed so on a busy machine), and the
// copy stays. An eviction that finds the room full with nothing in flight to free it
// then waits for those loads and frees the copies (drop_stale_host_copies) before it
// calls the room a planner bug.
void Residency::drop_stale_host_copy(Chunk& c) {
  if (c.value != ChunkValue::kStaged || c.host == nullptr) return;
  if (c.host_read.valid()) {
    auto done = core_.device.query(c.host_read);
    if (!done.ok() || !*done) return;  // (freed when the gradient is consumed)
  }
  core_.host->free(c.host, c.bytes);
  c.host = nullptr;
  core_.cv.notify_all();  // an eviction may wait for this room (Note [Backpressure])
}

bool Residency::drop_stale_host_copies() {
  bool freed = false;
  for (FamilyId f = 0; f < core_.layout().families.size(); ++f) {
    Chunk& g = core_.chunk_mut(f, StateKind::kGrad);
    if (g.value != ChunkValue::kStaged || g.host == nullptr || !wait_host_reads(g).ok()) continue;
    drop_stale_host_copy(g);
    freed = freed || g.host == nullptr;
  }
  return freed;
}

Status Residency::load_to_slot(Chunk& c, DeviceSlot& slot) {
  if (needs_staging(c) && !staged(c)) {
    return internal_error("family {} param: loading an NVMe-homed param that is not staged", c.family);
  }
  // An NVMe-homed param loads from its staging copy (Note [NVMe-homed params]).
  if (c.value != ChunkValue::kHost && !needs_staging(c)) {
    if (!c.absent()) {
      return internal_error("family {} {}: loading to the device with no host copy", c.family,
                            state_kind_name(c.kind));
    }
    // Never written: its value is zeros (optimizer states start at zero).
    if (slot.dedicated) {
      // A chunk that lives on the device for good (an all-GPU plan) gets no host
      // copy: the plan gave it none, so the zeros come from a static page of zeros,
      // not the host store (Note [Host room] in planner.cpp counts no such buffer).
      STRATA_RETURN_IF_ERROR(core_.device.wait(core_.h2d, slot.fence));
      for (std::uint64_t at = 0; at < c.bytes; at += sizeof(kZeros)) {
        const std::uint64_t n = std::min<std::uint64_t>(sizeof(kZeros), c.bytes - at);
        STRATA_RETURN_IF_ERROR(core_.timed_copy(core_.h2d, Track::kH2D, slot.ptr + at, kZeros, n,
                                                memory::CopyKind::kHostToDevice,
                                                SpanName{"h2d zeros", c.family, state_kind_name(c.kind)}));
      }
      STRATA_RETURN_IF_ERROR(core_.device.record(slot.ready, core_.h2d));
      STRATA_RETURN_IF_ERROR(core_.device.record(slot.fence, core_.h2d));
      c.move_value(ChunkValue::kDevice);  // the device copy is the only one
      return Status::Ok();
    }
    STRATA_ASSIGN_OR_RETURN(std::byte * zeros, core_.host_buffer(c));
    std::memset(zeros, 0, c.bytes);
    c.move_value(ChunkValue::kHost);
  }
  STRATA_RETURN_IF_ERROR(core_.device.wait(core_.h2d, slot.fence));
  if (!core_.opt.plan.prefetch) {
    // Without prefetch a move starts when the compute that needs it is reached
    // (PlanOptions::prefetch), not when the host thread, running ahead, asks.
    STRATA_RETURN_IF_ERROR(core_.device.record(demand_, core_.compute));
    STRATA_RETURN_IF_ERROR(core_.device.wait(core_.h2d, demand_));
  }
  STRATA_RETURN_IF_ERROR(core_.timed_copy(core_.h2d, Track::kH2D, slot.ptr, c.host, c.bytes,
                                          memory::CopyKind::kHostToDevice,
                                          SpanName{"h2d", c.family, state_kind_name(c.kind)}));
  STRATA_RETURN_IF_ERROR(core_.device.record(slot.ready, core_.h2d));
  STRATA_RETURN_IF_ERROR(core_.device.record(slot.fence, core_.h2d));
  if (!c.host_read.valid()) {
    STRATA_ASSIGN_OR_RETURN(c.host_read, core_.device.create_event());
  }
  return core_.device.record(c.host_read, core_.h2d);
}

Status Residency::wait_host_reads(Chunk& c) {
  // Rare: the slot the load went to may have been given away already, so the
  // chunk's own event, not the slot's, says when its host copy is free. The h2d
  // stream never needs the runtime's lock (Note [Runtime threading]).
  if (!c.host_read.valid()) return Status::Ok();  // never loaded
  auto done = core_.device.query(c.host_read);
  if (done.ok() && *done) return Status::Ok();
  return core_.device.synchronize(c.host_read);
}

Status Residency::write_back(Chunk& c, DeviceSlot& slot) {
  STRATA_ASSIGN_OR_RETURN(std::byte * dst, core_.host_buffer(c));
  STRATA_RETURN_IF_ERROR(core_.device.wait(core_.d2h, slot.fence));
  STRATA_RETURN_IF_ERROR(
      core_.device.copy_async(core_.d2h, dst, slot.ptr, c.bytes, memory::CopyKind::kDeviceToHost));
  STRATA_RETURN_IF_ERROR(core_.device.record(slot.fence, core_.d2h));
  // The host copy is authoritative from here; readers of it synchronise on d2h.
  STRATA_RETURN_IF_ERROR(core_.device.synchronize(core_.d2h));
  c.move_value(ChunkValue::kHost);
  return Status::Ok();
}

Status Residency::evict_slot(std::size_t s) {
  DeviceSlot& slot = device_slots_[s];
  if (slot.chunk < 0) return Status::Ok();
  Chunk& c = core_.chunk_mut(slot.chunk);
  STRATA_CHECK(c.readers == 0);
  STRATA_CHECK(c.writers == 0);
  if (c.dirty()) {
    // Write back before the slot is reused (a gradient between micro-batches, or
    // any dirty chunk pushed out by an unplanned access).
    STRATA_RETURN_IF_ERROR(write_back(c, slot));
  }
  c.device_copy = false;
  c.device_slot = -1;
  slot.chunk = -1;
  return Status::Ok();
}

// Note [Backpressure]
// A plan the runtime adopted counts every host buffer it can hold at once (Note
// [Host room] in planner.cpp), and each kind of buffer stays inside its own room:
// grad staging by grad_staging_slots, NVMe staging by nvme_families_in_flight, param
// staging by param_staging_buffers, gradient host copies by Plan::grad_host_bytes.
// A request that finds its room (or the store) full waits for in-flight work that
// frees room, instead of failing:
//  - the training thread (ensure_on_device) passes over a dirty gradient whose
//    write-back does not fit the gradients' room, and waits on Core::cv, dropping
//    Core::mu, while the optimizer pipeline has launched work (busy()); the
//    pipeline's consuming a gradient frees its host copy and its slot;
//  - the pipeline, on a pool or I/O thread, never blocks: a gradient that finds no
//    staging memory goes back to the head of its queue, a family that finds no NVMe
//    staging gives its place back, and both are retried by the next pump(), which
//    every end of pipeline work (a kernel, a gradient copy, NVMe reads, a
//    write-back) calls after freeing what it held;
//  - a save's shadow writer (checkpoint load) finishes its own writes first.
// Why it cannot deadlock: the waits form no cycle. The training thread waits only
// for launched pipeline work, and that work needs nothing the training thread
// holds: not Core::mu (released while waiting), not a lease, a device slot or
// gradient host room (landing a gradient takes grad staging, a room of its own;
// a kernel and a write-back take only what the family already holds). Pipeline
// work waits only for other pipeline work, retried on its end, never on a pool
// thread (no pool thread blocks, so the work it waits for always gets one). A
// read-ahead that holds an NVMe place a launched family needs is cancelled (Note
// [Pipeline places]). So every wait ends when some in-flight work ends, and the
// work in flight is finite. When nothing in flight can free room (the pipeline is
// idle, or only its stalled requests remain), waiting would never end: that is a
// budget the planner counted wrong, and the request fails with OutOfBudget saying
// so (a planner bug), naming the room, the sizes and the budget to raise.
Status Residency::ensure_on_device(std::unique_lock<std::mutex>& lock, Chunk& c, bool load) {
  c.tick = ++tick_;
  if (c.device_slot >= 0 && c.device_copy) return Status::Ok();
  // An NVMe-homed param is read into a staging buffer first (unlocking).
  if (load && needs_staging(c)) STRATA_RETURN_IF_ERROR(wait_staged(lock, c));
  if (c.device_slot >= 0 && device_slots_[static_cast<std::size_t>(c.device_slot)].dedicated) {
    DeviceSlot& slot = device_slots_[static_cast<std::size_t>(c.device_slot)];
    if (load) STRATA_RETURN_IF_ERROR(load_to_slot(c, slot));
    c.device_copy = true;
    return Status::Ok();
  }
  for (;;) {
    bool room_full = false;
    std::int64_t s = pick_slot(c.family, 0, &room_full);
    if (s >= 0) {
      STRATA_RETURN_IF_ERROR(evict_slot(static_cast<std::size_t>(s)));
      occupy(c, static_cast<std::size_t>(s));
      DeviceSlot& slot = device_slots_[static_cast<std::size_t>(s)];
      // (A write-back that ended while this waited for a slot may have sent the param home to NVMe.)
      if (load && needs_staging(c)) STRATA_RETURN_IF_ERROR(wait_staged(lock, c));
      if (load) {
        STRATA_RETURN_IF_ERROR(load_to_slot(c, slot));
      } else {
        // Nothing to load, but the new content must still wait for the slot's
        // previous users: order the next writer (compute) after the fence.
        STRATA_RETURN_IF_ERROR(core_.device.wait(core_.h2d, slot.fence));
        STRATA_RETURN_IF_ERROR(core_.device.record(slot.ready, core_.h2d));
      }
      c.device_copy = true;
      note_gpu_use();
      return Status::Ok();
    }
    // Every slot is leased, holds a gradient on its way to the optimizer, or holds
    // a gradient the host room cannot take now (Note [Backpressure]).
    if (!pipeline_->busy()) {
      if (room_full && drop_stale_host_copies()) continue;  // (Note [Host room]: their loads ended)
      return no_slot_error(room_full);
    }
    const double t0 = core_.timeline.now_us();
    core_.cv.wait(lock);
    core_.timeline.add_stall((core_.timeline.now_us() - t0) * 1e-6);
    if (!core_.errors.background().ok()) return core_.errors.background();
  }
}

std::size_t Residency::incomplete_gradients_max() const {
  const std::size_t families = core_.layout().families.size();
  std::uint64_t grad_max = 0;
  for (const Chunk& c : core_.chunks())
    grad_max = c.kind == StateKind::kGrad ? std::max(grad_max, c.bytes) : grad_max;
  // write_back_fits lets an eviction write a gradient back while the host copies
  // stay within plan.grad_host_bytes; a family complete on host leaves by itself.
  if (families == 0 || core_.plan().gpu_cache_slots == 0 || grad_max == 0) return families;
  return static_cast<std::size_t>(
      std::clamp<std::uint64_t>(core_.plan().grad_host_bytes / grad_max, 1, families));
}

Status Residency::no_slot_error(bool room_full) const {
  std::size_t leased = 0, claimed = 0;
  for (std::size_t i = 0; i < cache_slots_; ++i) {
    const DeviceSlot& slot = device_slots_[i];
    if (slot.chunk < 0) continue;
    const Chunk& o = core_.chunks().at(slot.chunk);
    leased += (o.readers > 0 || o.writers > 0 || dp_flags_->in_collective(o)) ? 1 : 0;
    claimed += (o.kind == StateKind::kGrad && pipeline_->claims_gradient(o.family)) ? 1 : 0;
  }
  const std::uint64_t slot_bytes = device_slots_.empty() ? 0 : device_slots_[0].bytes;
  if (room_full) {
    std::uint64_t in_use = 0;
    for (FamilyId f = 0; f < core_.layout().families.size(); ++f) {
      const Chunk& g = core_.chunk(f, StateKind::kGrad);
      if (g.host != nullptr) in_use += g.bytes;
    }
    const std::size_t incomplete = pipeline_->incomplete_families(), most = incomplete_gradients_max();
    if (incomplete > most) {
      return out_of_budget(
          "host room for gradients written back from the GPU is full ({} of the plan's {}): {} families' "
          "gradients are incomplete at once (some of their tensors' gradients handed over in this "
          "micro-batch, "
          "not all), and the plan's room holds {} (Runtime::incomplete_gradients_max()). The gradients come "
          "in "
          "another order than the warm-up step's: hand a family's gradients together, keeping back one that "
          "would open more families and declaring those that get none (Runtime::no_gradient; strata.torch "
          "does both: Note [Gradients in pieces] in runtime/include/strata/runtime/gradient_order.hpp), or "
          "raise "
          "host_budget by {} per gradient",
          format_bytes(in_use), format_bytes(core_.plan().grad_host_bytes), incomplete, most,
          format_bytes(slot_bytes));
    }
    return out_of_budget(
        "host room for gradients written back from the GPU is full ({} of the plan's {}; {} of the {} "
        "chunk slots leased, the others hold gradients no optimizer can take yet) and no optimizer work in "
        "flight can free any: a planner bug (Note [Host room] in runtime/plan/planner.cpp). Raise "
        "host_budget (by {} per gradient) or gpu_budget, and report it",
        format_bytes(in_use), format_bytes(core_.plan().grad_host_bytes), leased, cache_slots_,
        format_bytes(slot_bytes));
  }
  // Name the real counts: the streaming slots are only part of what the budget
  // holds when the plan dedicates slots to GPU-homed families.
  const std::size_t dedicated = device_slots_.size() - cache_slots_;
  const std::uint64_t chunk_bytes = core_.layout().chunk_elems * dtype_bytes(core_.opt.compute_dtype);
  return out_of_budget(
      "gpu_budget: all {} streaming chunk slots are held ({} by leases, {} by gradients waiting for their "
      "optimizer){}; each is {}, the largest chunk's size (the layout's chunk is {}), so gpu_budget {} "
      "holds {} slots in all; the working set does not fit. Release leases sooner, or raise gpu_budget",
      cache_slots_, leased, claimed,
      dedicated == 0
          ? std::string()
          : fmt::format(", and {} more are dedicated to families the plan keeps on the GPU", dedicated),
      format_bytes(slot_bytes), format_bytes(chunk_bytes), format_bytes(core_.opt.budgets.gpu_bytes),
      device_slots_.size());
}

Status Residency::ensure_on_host(Chunk& c) {
  if (c.dirty()) return write_back(c, device_slots_[static_cast<std::size_t>(c.device_slot)]);
  if (c.value == ChunkValue::kHost) return Status::Ok();
  if (c.value == ChunkValue::kStaged) {
    return internal_error("family {} {} is in the optimizer pipeline's staging", c.family,
                          state_kind_name(c.kind));
  }
  STRATA_ASSIGN_OR_RETURN(std::byte * dst, core_.host_buffer(c));
  if (c.value == ChunkValue::kNvme) {
    return internal_error("family {} {} is on NVMe; host copies of NVMe chunks go through staging", c.family,
                          state_kind_name(c.kind));
  }
  std::memset(dst, 0, c.bytes);
  c.move_value(ChunkValue::kHost);
  return Status::Ok();
}

void Residency::note_gpu_use() {
  std::uint64_t used = 0;
  for (const DeviceSlot& s : device_slots_) {
    if (s.chunk >= 0 && core_.chunks().at(s.chunk).device_copy) used += s.bytes;
  }
  gpu_high_water_ = std::max(gpu_high_water_, used);
}

Status Residency::build_slots(const Plan& p) {
  STRATA_RETURN_IF_ERROR(core_.device.synchronize());
  for (Chunk& c : core_.chunks_mut()) {
    if (c.device_slot < 0) continue;
    STRATA_CHECK(!c.dirty());  // at a step boundary device copies are clean
    c.device_slot = -1;
    c.device_copy = false;
  }
  device_slots_.clear();
  device_memory_.clear();
  const std::uint64_t slot_bytes = align_up(
      std::max<std::uint64_t>(core_.layout().chunk_elems * dtype_bytes(core_.opt.compute_dtype), 4096), 4096);
  std::vector<std::pair<std::int32_t, std::uint64_t>> wanted;  // (dedicated chunk or -1, bytes)
  if (p.all_gpu) {
    for (std::size_t i = 0; i < core_.chunks().size(); ++i) {
      const auto ci = static_cast<std::int32_t>(i);
      if (core_.chunks().at(ci).bytes > 0) wanted.emplace_back(ci, core_.chunks().at(ci).bytes);
    }
  } else {
    std::uint64_t stream_bytes = slot_bytes;
    for (const FamilyBytes& f : core_.chunks().family_bytes())
      stream_bytes = std::max({stream_bytes, f.param_bytes, f.grad_bytes});
    for (std::uint64_t s = 0; s < p.gpu_cache_slots; ++s) wanted.emplace_back(-1, stream_bytes);
    for (FamilyId f = 0; f < p.families.size(); ++f) {
      if (p.families[f].param_resident_gpu) {
        wanted.emplace_back(core_.chunk_index(f, StateKind::kParam), core_.chunk(f, StateKind::kParam).bytes);
      }
    }
  }
  std::uint64_t total = 0;
  for (auto& [c, bytes] : wanted) total += align_up(bytes, 4096);
  if (total > core_.opt.budgets.gpu_bytes) {
    return out_of_budget("gpu_budget {} cannot hold the planned {} of chunk slots; raise gpu_budget",
                         format_bytes(core_.opt.budgets.gpu_bytes), format_bytes(total));
  }
  if (total == 0) return Status::Ok();
  auto allocation = core_.device.allocate(total);
  if (!allocation.ok()) {
    Status s = allocation.status();
    s.with_context("allocating the runtime's device chunk slots");
    return s;
  }
  auto* base = static_cast<std::byte*>(allocation->data());
  device_memory_.push_back(std::move(allocation).value());
  std::uint64_t offset = 0;
  cache_slots_ = p.all_gpu ? 0 : p.gpu_cache_slots;
  device_slots_.resize(wanted.size());
  for (std::size_t i = 0; i < wanted.size(); ++i) {
    DeviceSlot& slot = device_slots_[i];
    slot.ptr = base + offset;
    slot.bytes = wanted[i].second;
    offset += align_up(wanted[i].second, 4096);
    STRATA_ASSIGN_OR_RETURN(slot.fence, core_.device.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.ready, core_.device.create_event());
    if (wanted[i].first >= 0) {
      slot.dedicated = true;
      slot.chunk = wanted[i].first;
      core_.chunk_mut(wanted[i].first).device_slot = static_cast<std::int32_t>(i);
    }
  }
  return Status::Ok();
}

}  // namespace strata::runtime
