// Data parallelism, backward: the gradient reduce-scatters of Note [Sharded step]
// (in data_parallel.cpp), posted round by round as backward completes the families
// (packed into a send buffer) and finished before the update. It calls Core and
// the rounds of dp.hpp; every function expects Core::mu held.

#include <algorithm>
#include <cstring>

#include "device_access.hpp"
#include "dp.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

using namespace dp_detail;

namespace {

//! The communicator may read and write device slots directly where the host can
//! (device_access.hpp). Elsewhere (CUDA) the mpi/local backends need host buffers,
//! so a gradient is copied down first (the nccl backend, which could reduce device
//! buffers, is refused by options.cpp).
bool comm_reads_device(const Core& core) {
  return device_memory_host_readable(core.device);
}

std::size_t round_count(const Core& core) {
  const std::size_t w = static_cast<std::size_t>(core.dp_ranks());
  return (core.layout.families.size() + w - 1) / w;
}

}  // namespace

Status Runtime::Impl::dp_post_round(bool at_step) {
  comm::Communicator& c = *core.opt.comm;
  const Rounds rounds(core);
  const FamilyId first = static_cast<FamilyId>(round_count(core) - 1 - dp_rounds_posted) * rounds.w;
  ++dp_rounds_posted;
  const std::uint64_t slice = rounds.slice(core, first, StateKind::kGrad, [](FamilyId) { return true; });
  if (slice == 0) return Status::Ok();
  DpRound round;
  round.first = first;
  round.slice = slice;
  round.send.assign(slice * rounds.w, std::byte{0});
  round.recv.resize(slice);
  for (FamilyId f = first; f < rounds.end(first); ++f) {
    Chunk& g = core.chunk(f, StateKind::kGrad);
    if (g.bytes == 0) continue;
    g.awaiting_reduction = false;
    for (TensorId t : core.layout.families[f].tensors) {
      const TensorInfo& info = core.tensors[t];
      if (at_step && !info.spec.frozen && !info.grad_written) {
        return failed_precondition(
            "data parallel: tensor \"{}\" got no gradient this step on rank {}; every rank must hand over "
            "every trainable tensor's gradient each step (write zeros for an unused one), or the others "
            "would wait for it",
            info.spec.name, c.rank());
      }
    }
    std::byte* dst = round.send.data() + (f - first) * slice;
    if (g.dirty() && comm_reads_device(core)) {
      // Straight from the device slot, in compute order after the backward that
      // wrote it, without blocking this thread; no d2h copy (only the owner's
      // sum comes down, at step()). The slot's fence covers the pack, so the
      // slot's next writer (or a write-back) waits for it.
      DeviceSlot& slot = residency.slot_of(g);
      const std::byte* src = slot.ptr;
      const std::uint64_t bytes = g.bytes;
      STRATA_RETURN_IF_ERROR(core.device.wait(core.compute, slot.fence));
      STRATA_RETURN_IF_ERROR(
          core.device.launch_host(core.compute, [dst, src, bytes] { std::memcpy(dst, src, bytes); }));
      STRATA_RETURN_IF_ERROR(core.device.record(slot.fence, core.compute));
      if (!round.packed) {
        STRATA_ASSIGN_OR_RETURN(memory::Event e, core.device.create_event());
        round.packed.emplace(std::move(e));
      }
    } else {
      STRATA_RETURN_IF_ERROR(residency.ensure_on_host(g));
      std::memcpy(dst, g.host, g.bytes);
    }
    if (f - first == rounds.me) continue;  // the sum replaces it at step()
    // Another rank's family: its gradient went there; nothing to keep here.
    if (g.host != nullptr) {
      STRATA_RETURN_IF_ERROR(residency.wait_host_reads(g));
      core.host->free(g.host, g.bytes);
    }
    g.host = nullptr;
    g.move_value(ChunkValue::kAbsent);
    residency.drop_device_copy(g);
    for (TensorId t : core.layout.families[f].tensors) core.tensors[t].grad_written = false;
  }
  if (round.packed) STRATA_RETURN_IF_ERROR(core.device.record(*round.packed, core.compute));
  dp_inflight.push_back(std::move(round));
  return dp_start_packed(false);
}

Status Runtime::Impl::dp_start_packed(bool block) {
  comm::Communicator& c = *core.opt.comm;
  const Rounds rounds(core);
  for (DpRound& round : dp_inflight) {
    if (round.started) continue;
    if (round.packed) {
      if (block) {
        STRATA_RETURN_IF_ERROR(core.device.synchronize(*round.packed));
      } else {
        STRATA_ASSIGN_OR_RETURN(bool done, core.device.query(*round.packed));
        if (!done) return Status::Ok();  // later rounds start after it: the same order on every rank
      }
    }
    STRATA_ASSIGN_OR_RETURN(round.handle, c.reduce_scatter(round.send.data(), round.recv.data(),
                                                           round.slice / rounds.elem_bytes, rounds.dtype));
    round.started = true;
  }
  return Status::Ok();
}

Status Runtime::Impl::dp_post_complete_rounds() {
  if (core.dp_ranks() == 1 || !pipeline.last_micro_batch) return Status::Ok();
  const Rounds rounds(core);
  const std::size_t total = round_count(core);
  while (dp_rounds_posted < total) {
    const FamilyId first = static_cast<FamilyId>(total - 1 - dp_rounds_posted) * rounds.w;
    bool complete = true;
    for (FamilyId f = first; f < rounds.end(first); ++f) {
      complete = complete && (core.chunk(f, StateKind::kGrad).bytes == 0 || pipeline.gradients_complete(f));
    }
    if (!complete) break;
    STRATA_RETURN_IF_ERROR(dp_post_round(false));
  }
  STRATA_RETURN_IF_ERROR(dp_start_packed(false));  // rounds whose packs ended since
  // Complete gradients of rounds not started (a later round, in the fixed order,
  // is incomplete) stay on the device for their reduction.
  for (FamilyId f = 0; f < static_cast<FamilyId>(total - dp_rounds_posted) * rounds.w && f < rounds.families;
       ++f) {
    Chunk& g = core.chunk(f, StateKind::kGrad);
    g.awaiting_reduction = g.bytes > 0 && pipeline.gradients_complete(f);
  }
  return Status::Ok();
}

Status Runtime::Impl::dp_reduce_gradients(std::unique_lock<std::mutex>& lock) {
  if (core.dp_ranks() == 1) return Status::Ok();
  while (dp_rounds_posted < round_count(core)) STRATA_RETURN_IF_ERROR(dp_post_round(true));
  STRATA_RETURN_IF_ERROR(dp_start_packed(true));
  const Rounds rounds(core);
  std::vector<DpRound> inflight = std::move(dp_inflight);
  dp_inflight.clear();
  dp_rounds_posted = 0;
  for (DpRound& round : inflight) {
    lock.unlock();
    Status st = round.handle.wait();
    lock.lock();
    STRATA_RETURN_IF_ERROR(st);
    const FamilyId own = round.first + rounds.me;
    if (own >= rounds.end(round.first)) continue;
    Chunk& g = core.chunk(own, StateKind::kGrad);
    if (g.bytes == 0) continue;
    // The sum over ranks replaces this rank's gradient where it is now.
    if (g.dirty() && comm_reads_device(core)) {
      DeviceSlot& slot = residency.slot_of(g);
      STRATA_RETURN_IF_ERROR(core.device.synchronize(slot.fence));
      std::memcpy(slot.ptr, round.recv.data(), g.bytes);
      continue;
    }
    STRATA_RETURN_IF_ERROR(residency.ensure_on_host(g));
    STRATA_RETURN_IF_ERROR(residency.wait_host_reads(g));
    std::memcpy(g.host, round.recv.data(), g.bytes);
    if (g.device_copy) {
      STRATA_RETURN_IF_ERROR(residency.load_to_slot(g, residency.slot_of(g)));
      STRATA_RETURN_IF_ERROR(core.device.synchronize(core.h2d));
    }
  }
  return Status::Ok();
}

}  // namespace strata::runtime
