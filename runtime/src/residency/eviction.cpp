// Residency: eviction victims and prefetch along the adopted trace
// (residency.hpp; Note [Cyclic access sequence] in trace.hpp).
#include <algorithm>
#include <limits>

#include "core/step_tracker.hpp"
#include "residency/residency.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {
namespace {

// Note [Prefetch errors]
// A prefetch is work done ahead of a use the trace predicts; what happens to its
// error depends on whether the runtime can go on without it.
//  - Reading an NVMe-homed param ahead into a staging buffer (read_params_ahead;
//    Note [NVMe-homed params]) can fail without harm: the param's NVMe slots are
//    its home copy and are untouched, the failed buffer is dropped (bad bytes
//    never reach the device), and the use that needed it reads the param again
//    itself (Residency::wait_staged) — and fails the runtime then if the fault
//    persists. Such an error goes to ErrorState::prefetch_failed: it is logged, counted
//    in StepStats::prefetch_errors (with the first message), and the next of
//    acquire, step, flush, init_tensor and begin_micro_batch returns it once,
//    having done nothing (the caller may call again). The message names the
//    family, the tier and, from the I/O engine, the file and the offset.
//  - Moving a chunk to a device slot (evict_slot, load_to_slot) fails only when
//    the device or a store is broken, and leaves the slot's state half-changed:
//    that error is sticky (ErrorState::fail; every later call returns it).
//  - The optimizer pipeline's NVMe read-ahead of optimizer states
//    (nvme_pipeline.cpp) stays sticky: its family's update waits on it, and it
//    has no second reader to fall back on.
Status failed(Core& core, Status st) {
  if (!st.ok()) core.errors.fail(st);
  return st;
}

}  // namespace

bool Residency::movable(const DeviceSlot& slot) const {
  if (slot.chunk < 0) return true;
  const Chunk& c = core_.chunks().at(slot.chunk);
  if (c.readers > 0 || c.writers > 0 || dp_flags_->in_collective(c)) return false;
  // A complete gradient waiting for the optimizer pipeline leaves by itself;
  // writing it back to host would spend host memory the plan did not give it.
  // Waiting for the pipeline is the back-pressure (ensure_on_device).
  return !(c.kind == StateKind::kGrad && pipeline_->claims_gradient(c.family));
}

bool Residency::write_back_fits(const Chunk& c, std::uint64_t* in_use) const {
  *in_use = 0;
  if (!c.dirty() || c.host != nullptr || c.kind != StateKind::kGrad) return true;
  for (FamilyId f = 0; f < core_.layout().families.size(); ++f) {
    const Chunk& g = core_.chunk(f, StateKind::kGrad);
    if (g.host != nullptr) *in_use += g.bytes;
  }
  return *in_use + c.bytes <= core_.plan().grad_host_bytes;
}

std::int64_t Residency::pick_slot(FamilyId for_family, std::uint64_t farther_than, bool* room_full) {
  // A free slot, or a victim nobody leases: farthest next use when following
  // the plan (Note [Cyclic access sequence]), least recently used otherwise.
  // Clean chunks are preferred over dirty ones (no write-back).
  //
  // Note [Idle victims first]
  // The training thread runs ahead of the device, so the free slot or the
  // farthest-next-use victim is often one whose last use (a core_.compute, or the d2h
  // of a gradient) is still queued: a load into it waits for that work, and the
  // h2d stream (one queue) holds every later load behind it, so the next compute
  // stalls for the whole copy. So slots are ranked: idle (fence completed, and
  // not needed within the prefetch window) before busy; within each, free before
  // occupied; then by next use. The price is at most a few more fetches a step,
  // on a link that is rarely the bottleneck.
  const bool planned = tracker_.following() && tracker_.next_use().length() > 0;
  const std::size_t here = tracker_.here();
  std::int64_t best = -1;
  std::uint64_t best_key = 0;
  int best_rank = -5;
  for (std::size_t s = 0; s < cache_slots_; ++s) {
    if (!movable(device_slots_[s])) continue;
    const bool free = device_slots_[s].chunk < 0;
    std::uint64_t key = 0;
    bool soon = false;     // needed within the prefetch window: loaded for that use
    bool waiting = false;  // a gradient waiting for its round's reduction (Note [Sharded step])
    if (!free) {
      const Chunk& c = core_.chunks().at(device_slots_[s].chunk);
      if (c.family == for_family && c.kind != StateKind::kGrad) continue;
      waiting = dp_flags_->awaiting_reduction(c);
      // A gradient still being accumulated is used again at the family's next backward use.
      const std::uint64_t d = planned ? tracker_.next_use().distance(c.family, here) : 0;
      if (farther_than > 0 && (c.dirty() || d <= farther_than)) continue;
      std::uint64_t in_use = 0;
      if (!write_back_fits(c, &in_use)) {  // Note [Backpressure]
        if (room_full != nullptr) *room_full = true;
        continue;
      }
      if (planned) {
        key =
            (d == NextUse::kNever ? std::numeric_limits<std::uint32_t>::max() : d) * 2 + (c.dirty() ? 0 : 1);
        soon = d <= std::uint64_t{core_.plan().prefetch_depth} + 1;
      } else {
        key = (std::numeric_limits<std::uint64_t>::max() / 4 - c.tick) * 2 + (c.dirty() ? 0 : 1);
      }
    }
    auto done = core_.device.query(device_slots_[s].fence);
    const bool idle = done.ok() && *done && !soon;
    // Last of all: a gradient waiting for its round's reduction, which reads it
    // from the device soon (evicting it would copy it down for nothing).
    const int rank = (idle ? 2 : 0) + (free ? 1 : 0) - (waiting ? 4 : 0);
    if (rank > best_rank || (rank == best_rank && key > best_key)) {
      best = static_cast<std::int64_t>(s);
      best_key = key;
      best_rank = rank;
    }
  }
  return best;
}

Status Residency::prefetch() {
  const Plan& plan = core_.plan();
  if (!tracker_.following() || !core_.opt.plan.prefetch || plan.all_gpu || plan.prefetch_depth == 0)
    return Status::Ok();
  // NVMe-homed params of the next uses are read into staging first (Note [NVMe-homed params]).
  if (staging_max_ > 0) {
    if (Status st = read_params_ahead(); !st.ok()) {
      core_.errors.prefetch_failed(st);  // nothing changed: not fatal (Note [Prefetch errors])
      return st;
    }
  }
  const auto& uses = tracker_.plan_trace().uses;
  const std::size_t start = tracker_.next_position();
  for (std::size_t q = start; q < uses.size() && q < start + plan.prefetch_depth; ++q) {
    const FamilyId f = uses[q].family;
    Chunk& c = core_.chunk_mut(f, StateKind::kParam);
    if (c.device_copy || c.bytes == 0 || dp_flags_->awaiting_gather(c)) continue;  // (Note [Sharded step])
    if (needs_staging(c) ? !staged(c) : c.value != ChunkValue::kHost) continue;    // (not read yet)
    if (pipeline_->updating(f)) continue;
    if (c.device_slot >= 0 && device_slots_[static_cast<std::size_t>(c.device_slot)].dedicated) {
      STRATA_RETURN_IF_ERROR(failed(core_, load_to_slot(c, slot_of(c))));
      c.device_copy = true;
      continue;
    }
    // Leave two slots to the uses on demand (the next param and gradient): slots
    // hogged by gradients waiting for the optimizer pipeline would otherwise make
    // a prefetch and the next demand evict each other's chunk, round after round.
    std::size_t room = 0;
    for (std::size_t i = 0; i < cache_slots_; ++i) room += movable(device_slots_[i]) ? 1 : 0;
    if (room <= 2) return Status::Ok();
    // Take a slot only if its occupant is clean and used later than this prefetch target.
    const std::size_t here = tracker_.here();
    const std::int64_t s = pick_slot(f, std::max<std::uint64_t>(q - here, 1));
    if (s < 0) return Status::Ok();
    STRATA_RETURN_IF_ERROR(failed(core_, evict_slot(static_cast<std::size_t>(s))));
    occupy(c, static_cast<std::size_t>(s));
    STRATA_RETURN_IF_ERROR(failed(core_, load_to_slot(c, slot_of(c))));
    c.device_copy = true;
    c.tick = ++tick_;
    note_gpu_use();
  }
  return Status::Ok();
}

}  // namespace strata::runtime
