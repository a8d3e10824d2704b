// Data parallelism, after the update: the param all-gathers of Note [Sharded step]
// (in data_parallel.cpp): each rank's updated shard of every family's params
// reaches every rank, finished before the family's next use (finish_gather) or
// all at once (before a checkpoint load) (DataParallel, data_parallel.hpp).
// Every function expects Core::mu held.

#include <algorithm>
#include <cstring>

#include "data_parallel.hpp"
#include "residency/device_access.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

using namespace dp_detail;

Status DataParallel::gather_params(std::unique_lock<std::mutex>& lock) {
  if (core_.dp_ranks() == 1) return Status::Ok();
  STRATA_RETURN_IF_ERROR(finish_all_gathers(lock));  // (none left: step() finished them)
  comm::Communicator& c = *core_.opt.comm;
  const Rounds rounds(core_);
  // Only families with trainable tensors change (those with a gradient chunk);
  // every rank updated its shard of each.
  for (FamilyId f = 0; f < rounds.families; ++f) {
    if (core_.chunk(f, StateKind::kGrad).bytes == 0) continue;
    Chunk& p = core_.chunk_mut(f, StateKind::kParam);
    Gather g;
    g.first = f;
    g.slice = core_.shard_elems(f) * rounds.elem_bytes;
    if (c.device_buffers()) {
      STRATA_RETURN_IF_ERROR(stage_gather_on_device(lock, g, p));
      STRATA_ASSIGN_OR_RETURN(g.handle, c.all_gather(g.dev + rounds.me * g.slice, g.dev,
                                                     g.slice / rounds.elem_bytes, rounds.dtype));
      flags_[f].awaiting_gather = true;
      gathers_.push_back(std::move(g));
      continue;
    }
    g.all.resize(g.slice * rounds.w);
    std::byte* mine = g.all.data() + rounds.me * g.slice;
    if (p.dirty() && device_memory_host_readable(core_.device)) {
      // Updated in its device slot (GPU-homed states): this rank's shard is read
      // there, without copying the chunk down (the sim device's slots are host memory).
      DeviceSlot& slot = residency_.slot_of(p);
      STRATA_RETURN_IF_ERROR(core_.device.synchronize(slot.fence));
      std::memcpy(mine, slot.ptr + rounds.me * g.slice, g.slice);
    } else {
      STRATA_RETURN_IF_ERROR(host_copy(
          lock, p, false, [&](std::byte* h) { std::memcpy(mine, h + rounds.me * g.slice, g.slice); }));
    }
    STRATA_ASSIGN_OR_RETURN(g.handle,
                            c.all_gather(mine, g.all.data(), g.slice / rounds.elem_bytes, rounds.dtype));
    flags_[f].awaiting_gather = true;
    if (p.device_copy && p.readers == 0 && !p.dirty()) residency_.drop_device_copy(p);  // stale
    gathers_.push_back(std::move(g));
  }
  return Status::Ok();
}

Status DataParallel::stage_gather_on_device(std::unique_lock<std::mutex>& lock, Gather& g, Chunk& p) {
  const Rounds rounds(core_);
  const std::uint64_t mine = rounds.me * g.slice;
  // In place pins the slot until the param's first use: at most half the slots
  // (the rest are the next forward's), as land_done_rounds does for gradients.
  const std::size_t limit = std::max<std::size_t>(1, residency_.device_slots().size() / 2);
  const auto pinned =
      static_cast<std::size_t>(std::count_if(gathers_.begin(), gathers_.end(), [](const Gather& d) {
        return d.dev != nullptr && !d.staging.valid();
      }));
  if (p.device_copy && (p.dirty() || p.value == ChunkValue::kHost) && p.readers == 0 && p.writers == 0 &&
      (pinned < limit || p.dirty())) {
    // On the device: the gather fills the param's slot in place from this
    // rank's shard there (updated there, or a clean copy whose host value has
    // the update: only the shard goes up), so no whole chunk moves h2d. The
    // slot stays put (DpChunkFlags: in_collective) until the first use waits for the gather.
    DeviceSlot& slot = residency_.slot_of(p);
    g.dev = slot.ptr;
    if (!p.dirty()) {
      STRATA_RETURN_IF_ERROR(residency_.wait_host_reads(p));
      STRATA_RETURN_IF_ERROR(core_.device.wait(core_.h2d, slot.fence));
      STRATA_RETURN_IF_ERROR(core_.device.copy_async(core_.h2d, g.dev + mine, p.host + mine, g.slice,
                                                     memory::CopyKind::kHostToDevice));
      STRATA_RETURN_IF_ERROR(core_.device.record(slot.fence, core_.h2d));
    }
    // The update's writes (compute or h2d) are done before the collective starts.
    STRATA_RETURN_IF_ERROR(core_.device.synchronize(slot.fence));
    flags_[p.family].param_in_collective = true;
    return Status::Ok();
  }
  // Not on the device: this rank's shard goes up into a device buffer of its
  // own, the gather fills it, and the whole chunk comes down into the host
  // copy at the first use (finish_gather).
  STRATA_ASSIGN_OR_RETURN(g.staging, core_.device.allocate(g.slice * rounds.w));
  g.dev = static_cast<std::byte*>(g.staging.data());
  STRATA_RETURN_IF_ERROR(host_copy(lock, p, false, [&](std::byte* h) {
    g.all.assign(h + mine, h + mine + g.slice);  // (a host copy may be a temporary: NVMe)
  }));
  STRATA_RETURN_IF_ERROR(core_.device.copy_async(core_.h2d, g.dev + mine, g.all.data(), g.slice,
                                                 memory::CopyKind::kHostToDevice));
  STRATA_RETURN_IF_ERROR(core_.device.synchronize(core_.h2d));
  g.all.clear();
  if (p.device_copy && p.readers == 0 && !p.dirty()) residency_.drop_device_copy(p);  // stale
  return Status::Ok();
}

Status DataParallel::finish_gather(std::unique_lock<std::mutex>& lock, FamilyId f) {
  Chunk& p = core_.chunk_mut(f, StateKind::kParam);
  if (!flags_.awaiting_gather(p)) return Status::Ok();
  auto it = std::find_if(gathers_.begin(), gathers_.end(), [&](const Gather& g) { return g.first == f; });
  STRATA_CHECK(it != gathers_.end());
  Gather g = std::move(*it);
  gathers_.erase(it);
  flags_[f].awaiting_gather = false;
  lock.unlock();
  Status st = g.handle.wait();
  lock.lock();
  if (g.dev != nullptr && !g.staging.valid()) flags_[f].param_in_collective = false;
  STRATA_RETURN_IF_ERROR(st);
  if (g.dev != nullptr) {
    if (!g.staging.valid()) {
      // Gathered in place in its slot, which now holds the only current copy.
      if (!p.dirty()) p.move_value(ChunkValue::kDevice);
      return Status::Ok();
    }
    g.all.resize(g.slice * static_cast<std::uint64_t>(core_.dp_ranks()));
    STRATA_RETURN_IF_ERROR(core_.device.copy_async(core_.d2h, g.all.data(), g.dev, g.all.size(),
                                                   memory::CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(core_.device.synchronize(core_.d2h));
    g.staging = memory::DeviceAllocation();
  }
  // Every shard (this rank's is unchanged) into the param chunk: into its device
  // slot when that holds the only copy and the host can write it (no copy down and
  // up again), else into the host copy.
  if (p.dirty() && device_memory_host_readable(core_.device) && p.readers == 0) {
    DeviceSlot& slot = residency_.slot_of(p);
    STRATA_RETURN_IF_ERROR(core_.device.synchronize(slot.fence));
    std::memcpy(slot.ptr, g.all.data(), g.all.size());
    return Status::Ok();
  }
  return host_copy(lock, p, true, [&](std::byte* h) { std::memcpy(h, g.all.data(), g.all.size()); });
}

Status DataParallel::on_use(std::unique_lock<std::mutex>& lock, Chunk& c) {
  STRATA_RETURN_IF_ERROR(broadcast_initial(lock));
  // Another rank's updated param still arriving: its first use waits for it.
  if (c.kind == StateKind::kParam) STRATA_RETURN_IF_ERROR(finish_gather(lock, c.family));
  return Status::Ok();
}

Status DataParallel::on_placed(std::unique_lock<std::mutex>& lock) {
  return gather_ahead(lock);
}

Status DataParallel::on_host_access(std::unique_lock<std::mutex>& lock, Chunk& c, bool write) {
  // Rank 0's initial params first, before any read.
  if (!write) STRATA_RETURN_IF_ERROR(broadcast_initial(lock));
  if (c.kind == StateKind::kParam) STRATA_RETURN_IF_ERROR(finish_gather(lock, c.family));
  return Status::Ok();
}

Status DataParallel::finish_all_gathers(std::unique_lock<std::mutex>& lock) {
  while (!gathers_.empty()) STRATA_RETURN_IF_ERROR(finish_gather(lock, gathers_.front().first));
  return Status::Ok();
}

Status DataParallel::gather_ahead(std::unique_lock<std::mutex>& lock) {
  if (gathers_.empty() || !tracker_.following() || !core_.opt.plan.prefetch) return Status::Ok();
  const auto& uses = tracker_.plan_trace().uses;
  const std::size_t start = tracker_.next_position();
  for (std::size_t q = start; q < uses.size() && q < start + core_.plan().prefetch_depth; ++q) {
    STRATA_RETURN_IF_ERROR(finish_gather(lock, uses[q].family));
  }
  return Status::Ok();
}

}  // namespace strata::runtime
