// Data parallelism, after the update: the param all-gathers of Note [Sharded step]
// (in data_parallel.cpp): each rank's updated shard of every family's params
// reaches every rank, finished before the family's next use (dp_finish_gather) or
// all at once (before a checkpoint load). It calls Core and the rounds of dp.hpp; every
// function expects Core::mu held.

#include <algorithm>
#include <cstring>

#include "device_access.hpp"
#include "dp.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

using namespace dp_detail;

Status Runtime::Impl::dp_gather_params(std::unique_lock<std::mutex>& lock) {
  if (core.dp_ranks() == 1) return Status::Ok();
  STRATA_RETURN_IF_ERROR(dp_finish_all_gathers(lock));  // (none left: step() finished them)
  comm::Communicator& c = *core.opt.comm;
  const Rounds rounds(core);
  // Only families with trainable tensors change (those with a gradient chunk);
  // every rank updated its shard of each.
  for (FamilyId f = 0; f < rounds.families; ++f) {
    if (core.chunk(f, StateKind::kGrad).bytes == 0) continue;
    Chunk& p = core.chunk(f, StateKind::kParam);
    DpGather g;
    g.first = f;
    g.slice = core.shard_elems(f) * rounds.elem_bytes;
    g.all.resize(g.slice * rounds.w);
    std::byte* mine = g.all.data() + rounds.me * g.slice;
    if (p.dirty() && device_memory_host_readable(core.device)) {
      // Updated in its device slot (GPU-homed states): this rank's shard is read
      // there, without copying the chunk down (the sim device's slots are host memory).
      DeviceSlot& slot = residency.slot_of(p);
      STRATA_RETURN_IF_ERROR(core.device.synchronize(slot.fence));
      std::memcpy(mine, slot.ptr + rounds.me * g.slice, g.slice);
    } else {
      STRATA_RETURN_IF_ERROR(with_host_copy(
          lock, p, false, [&](std::byte* h) { std::memcpy(mine, h + rounds.me * g.slice, g.slice); }));
    }
    STRATA_ASSIGN_OR_RETURN(g.handle,
                            c.all_gather(mine, g.all.data(), g.slice / rounds.elem_bytes, rounds.dtype));
    p.awaiting_gather = true;
    if (p.device_copy && p.readers == 0 && !p.dirty()) residency.drop_device_copy(p);  // stale
    dp_gathers.push_back(std::move(g));
  }
  return Status::Ok();
}

Status Runtime::Impl::dp_finish_gather(std::unique_lock<std::mutex>& lock, FamilyId f) {
  Chunk& p = core.chunk(f, StateKind::kParam);
  if (!p.awaiting_gather) return Status::Ok();
  auto it =
      std::find_if(dp_gathers.begin(), dp_gathers.end(), [&](const DpGather& g) { return g.first == f; });
  STRATA_CHECK(it != dp_gathers.end());
  DpGather g = std::move(*it);
  dp_gathers.erase(it);
  p.awaiting_gather = false;
  lock.unlock();
  Status st = g.handle.wait();
  lock.lock();
  STRATA_RETURN_IF_ERROR(st);
  // Every shard (this rank's is unchanged) into the param chunk: into its device
  // slot when that holds the only copy and the host can write it (no copy down and
  // up again), else into the host copy.
  if (p.dirty() && device_memory_host_readable(core.device) && p.readers == 0) {
    DeviceSlot& slot = residency.slot_of(p);
    STRATA_RETURN_IF_ERROR(core.device.synchronize(slot.fence));
    std::memcpy(slot.ptr, g.all.data(), g.all.size());
    return Status::Ok();
  }
  return with_host_copy(lock, p, true, [&](std::byte* h) { std::memcpy(h, g.all.data(), g.all.size()); });
}

Status Runtime::Impl::dp_finish_all_gathers(std::unique_lock<std::mutex>& lock) {
  while (!dp_gathers.empty()) STRATA_RETURN_IF_ERROR(dp_finish_gather(lock, dp_gathers.front().first));
  return Status::Ok();
}

Status Runtime::Impl::dp_gather_ahead(std::unique_lock<std::mutex>& lock) {
  if (dp_gathers.empty() || !tracker.following() || !core.opt.plan.prefetch) return Status::Ok();
  const auto& uses = tracker.plan_trace().uses;
  const std::size_t start = tracker.next_position();
  for (std::size_t q = start; q < uses.size() && q < start + core.plan.prefetch_depth; ++q) {
    STRATA_RETURN_IF_ERROR(dp_finish_gather(lock, uses[q].family));
  }
  return Status::Ok();
}

}  // namespace strata::runtime
