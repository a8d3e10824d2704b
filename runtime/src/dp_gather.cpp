// Data parallelism, after the update: the param all-gathers of Note [Sharded step]
// (in data_parallel.cpp): each owner's updated params reach every rank, round by
// round, finished before a family's next use (dp_finish_gather) or all at once
// (before a checkpoint load). It calls Core and the rounds of dp.hpp; every
// function expects Core::mu held.

#include <algorithm>
#include <cstring>

#include "dp.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

using namespace dp_detail;

Status Runtime::Impl::dp_gather_params(std::unique_lock<std::mutex>& lock) {
  if (core.dp_ranks() == 1) return Status::Ok();
  STRATA_RETURN_IF_ERROR(dp_finish_all_gathers(lock));  // (none left: step() finished them)
  comm::Communicator& c = *core.opt.comm;
  const Rounds rounds(core);
  // Only families with trainable tensors change (those with a gradient chunk).
  auto trainable = [&](FamilyId f) { return core.chunk(f, StateKind::kGrad).bytes > 0; };
  for (FamilyId first = 0; first < rounds.families; first += rounds.w) {
    const std::uint64_t slice = rounds.slice(core, first, StateKind::kParam, trainable);
    if (slice == 0) continue;
    DpGather g;
    g.first = first;
    g.slice = slice;
    g.all.assign(slice * rounds.w, std::byte{0});
    std::byte* mine = g.all.data() + rounds.me * slice;
    const FamilyId own = first + rounds.me;
    if (own < rounds.families && trainable(own)) {
      Chunk& p = core.chunk(own, StateKind::kParam);
      STRATA_RETURN_IF_ERROR(
          with_host_copy(lock, p, false, [&](std::byte* h) { std::memcpy(mine, h, p.bytes); }));
    }
    STRATA_ASSIGN_OR_RETURN(g.handle,
                            c.all_gather(mine, g.all.data(), slice / rounds.elem_bytes, rounds.dtype));
    for (FamilyId f = first; f < rounds.end(first); ++f) {
      if (f == own || !trainable(f)) continue;
      Chunk& p = core.chunk(f, StateKind::kParam);
      p.awaiting_gather = true;
      if (p.device_copy && p.readers == 0) residency.drop_device_copy(p);  // stale
    }
    dp_gathers.push_back(std::move(g));
  }
  return Status::Ok();
}

Status Runtime::Impl::dp_finish_gather(std::unique_lock<std::mutex>& lock, FamilyId f) {
  if (!core.chunk(f, StateKind::kParam).awaiting_gather) return Status::Ok();
  const Rounds rounds(core);
  const FamilyId first = f / rounds.w * rounds.w;
  auto it =
      std::find_if(dp_gathers.begin(), dp_gathers.end(), [&](const DpGather& g) { return g.first == first; });
  STRATA_CHECK(it != dp_gathers.end());
  DpGather g = std::move(*it);
  dp_gathers.erase(it);
  for (FamilyId q = first; q < rounds.end(first); ++q)
    core.chunk(q, StateKind::kParam).awaiting_gather = false;
  lock.unlock();
  Status st = g.handle.wait();
  lock.lock();
  STRATA_RETURN_IF_ERROR(st);
  for (FamilyId q = first; q < rounds.end(first); ++q) {
    if (q - first == rounds.me || core.chunk(q, StateKind::kGrad).bytes == 0) continue;
    Chunk& p = core.chunk(q, StateKind::kParam);
    const std::byte* theirs = g.all.data() + (q - first) * g.slice;
    STRATA_RETURN_IF_ERROR(
        with_host_copy(lock, p, true, [&](std::byte* h) { std::memcpy(h, theirs, p.bytes); }));
  }
  return Status::Ok();
}

Status Runtime::Impl::dp_finish_all_gathers(std::unique_lock<std::mutex>& lock) {
  const Rounds rounds(core);
  while (!dp_gathers.empty()) {
    // A family of the round that awaits it (the round's first may be this rank's own).
    const FamilyId first = dp_gathers.front().first;
    std::optional<FamilyId> awaiting;
    for (FamilyId q = first; q < rounds.end(first) && !awaiting; ++q) {
      if (core.chunk(q, StateKind::kParam).awaiting_gather) awaiting = q;
    }
    if (awaiting) {
      STRATA_RETURN_IF_ERROR(dp_finish_gather(lock, *awaiting));
      continue;
    }
    DpGather g = std::move(dp_gathers.front());  // nothing here awaits it: only its end
    dp_gathers.erase(dp_gathers.begin());
    lock.unlock();
    Status st = g.handle.wait();
    lock.lock();
    STRATA_RETURN_IF_ERROR(st);
  }
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
