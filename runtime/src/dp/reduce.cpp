// Data parallelism, backward: the gradient reduce-scatters of Note [Sharded step]
// (in data_parallel.cpp), one per family, posted as backward completes the families
// (packed into a send buffer) and finished before the update (DataParallel,
// data_parallel.hpp). Every function expects Core::mu held.

#include <algorithm>
#include <cstring>

#include "data_parallel.hpp"
#include "residency/device_access.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

using namespace dp_detail;

namespace {

//! The communicator may read and write device slots directly where the host can
//! (device_access.hpp). Elsewhere (CUDA) the mpi/local backends need host buffers,
//! so a gradient is copied down first; a device-buffer communicator (nccl) takes
//! the device path of post_round instead.
bool comm_reads_device(const Core& core) {
  return device_memory_host_readable(core.device);
}

//! Reductions per step: one per family (Note [Sharded step]).
std::size_t round_count(const Core& core) {
  return core.layout().families.size();
}

//! The sum of family f's gradient shard is kept on the device: its optimizer
//! runs there. Otherwise the gradient leaves the device once packed, and only
//! this rank's shard of the sum lands in host memory at step().
bool sum_on_device(const Core& core, FamilyId f) {
  return core.plan().families[f].optim_home == Tier::kGpu;
}

}  // namespace

Status DataParallel::post_round(bool at_step) {
  comm::Communicator& c = *core_.opt.comm;
  const Rounds rounds(core_);
  const auto f = static_cast<FamilyId>(round_count(core_) - 1 - rounds_posted_);
  ++rounds_posted_;
  Chunk& g = core_.chunk_mut(f, StateKind::kGrad);
  if (g.bytes == 0) return Status::Ok();
  flags_[f].awaiting_reduction = false;
  for (TensorId t : core_.layout().families[f].tensors) {
    const TensorInfo& info = core_.tensors()[t];
    if (at_step && !info.spec.frozen && !info.grad_written) {
      return failed_precondition(
          "data parallel: tensor \"{}\" got no gradient this step on rank {}; every rank must hand over "
          "every trainable tensor's gradient each step (write zeros for an unused one), or the others "
          "would wait for it",
          info.spec.name, c.rank());
    }
  }
  // The whole chunk goes out (W shards); this rank gets the sum of its shard.
  const std::uint64_t shard = core_.shard_elems(f) * rounds.elem_bytes;
  const std::uint64_t whole = shard * rounds.w;
  Round round;
  round.first = f;
  round.slice = shard;
  if (c.device_buffers()) {
    STRATA_RETURN_IF_ERROR(stage_round_on_device(round, g, whole));
    inflight_.push_back(std::move(round));
    STRATA_RETURN_IF_ERROR(start_packed(false));
    return land_done_rounds();
  }
  round.send.resize(whole);
  round.recv.resize(shard);
  std::byte* dst = round.send.data();
  if (g.dirty() && comm_reads_device(core_)) {
    // Straight from the device slot, in compute order after the backward that
    // wrote it, without blocking this thread; no d2h copy of the gradient. The
    // slot's fence covers the pack, so the slot's next writer (or a write-back)
    // waits for it.
    DeviceSlot& slot = residency_.slot_of(g);
    const std::byte* src = slot.ptr;
    STRATA_RETURN_IF_ERROR(core_.device.wait(core_.compute, slot.fence));
    STRATA_RETURN_IF_ERROR(
        core_.device.launch_host(core_.compute, [dst, src, whole] { std::memcpy(dst, src, whole); }));
    STRATA_RETURN_IF_ERROR(core_.device.record(slot.fence, core_.compute));
    STRATA_ASSIGN_OR_RETURN(memory::Event e, core_.device.create_event());
    round.packed.emplace(std::move(e));
    STRATA_RETURN_IF_ERROR(core_.device.record(*round.packed, core_.compute));
  } else {
    STRATA_RETURN_IF_ERROR(residency_.ensure_on_host(g));
    std::memcpy(dst, g.host, whole);
  }
  if (!sum_on_device(core_, f)) {
    // The packed gradient is all the reduction needs; the shard's sum lands on
    // host at step(). (The tensors keep grad_written: their shards update.)
    if (g.host != nullptr) {
      STRATA_RETURN_IF_ERROR(residency_.wait_host_reads(g));
      core_.host->free(g.host, g.bytes);
    }
    g.host = nullptr;
    g.move_value(ChunkValue::kAbsent);
    residency_.drop_device_copy(g);
  }
  inflight_.push_back(std::move(round));
  return start_packed(false);
}
Status DataParallel::stage_round_on_device(Round& round, Chunk& g, std::uint64_t whole) {
  if (g.dirty()) {
    // In its device slot: the reduce-scatter reads the whole chunk there and
    // writes this rank's shard's sum in place (ncclReduceScatter's in-place
    // form), so the slot stays put (DpChunkFlags: in_collective) until step() waits for it.
    // It starts once an event on the compute stream after the backward that
    // wrote the slot completes (start_packed): ordered after those kernels
    // whatever stream the communicator issues on.
    DeviceSlot& slot = residency_.slot_of(g);
    round.dev = slot.ptr;
    STRATA_RETURN_IF_ERROR(core_.device.wait(core_.compute, slot.fence));
    STRATA_ASSIGN_OR_RETURN(memory::Event e, core_.device.create_event());
    round.packed.emplace(std::move(e));
    STRATA_RETURN_IF_ERROR(core_.device.record(*round.packed, core_.compute));
    flags_[g.family].grad_in_collective = true;
    return Status::Ok();
  }
  // On host (written there, or evicted before its round): up into a device
  // buffer of its own, which the collective reads and writes.
  STRATA_RETURN_IF_ERROR(residency_.ensure_on_host(g));
  STRATA_ASSIGN_OR_RETURN(round.staging, core_.device.allocate(whole));
  round.dev = static_cast<std::byte*>(round.staging.data());
  STRATA_RETURN_IF_ERROR(
      core_.device.copy_async(core_.h2d, round.dev, g.host, whole, memory::CopyKind::kHostToDevice));
  STRATA_ASSIGN_OR_RETURN(memory::Event e, core_.device.create_event());
  round.packed.emplace(std::move(e));
  return core_.device.record(*round.packed, core_.h2d);
}

Status DataParallel::land_device_round(Round& round) {
  const Rounds rounds(core_);
  Chunk& g = core_.chunk_mut(round.first, StateKind::kGrad);
  const std::uint64_t at = core_.shard_begin(round.first) * rounds.elem_bytes;
  const std::byte* sum = round.dev + at;
  if (!round.staging.valid()) {
    flags_[round.first].grad_in_collective = false;
    // A GPU-homed family: the shard's sum is in place in its slot, where the
    // device kernel reads it; nothing moves.
    if (sum_on_device(core_, round.first)) return Status::Ok();
  }
  // Only this rank's shard of the sum comes down (1/W of the chunk). The rest
  // of the host copy is other ranks' shards: nothing reads it here.
  STRATA_ASSIGN_OR_RETURN(std::byte * h, core_.host_buffer(g));
  STRATA_RETURN_IF_ERROR(residency_.wait_host_reads(g));
  if (g.dirty()) {
    DeviceSlot& slot = residency_.slot_of(g);
    STRATA_RETURN_IF_ERROR(core_.device.wait(core_.d2h, slot.fence));
    STRATA_RETURN_IF_ERROR(
        core_.device.copy_async(core_.d2h, h + at, sum, round.slice, memory::CopyKind::kDeviceToHost));
    STRATA_RETURN_IF_ERROR(core_.device.record(slot.fence, core_.d2h));
    STRATA_RETURN_IF_ERROR(core_.device.synchronize(slot.fence));
    g.move_value(ChunkValue::kHost);
    residency_.drop_device_copy(g);
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(
      core_.device.copy_async(core_.d2h, h + at, sum, round.slice, memory::CopyKind::kDeviceToHost));
  STRATA_RETURN_IF_ERROR(core_.device.synchronize(core_.d2h));
  round.staging = memory::DeviceAllocation();
  if (g.device_copy) {  // a clean copy of the gradient on the device: refreshed
    STRATA_RETURN_IF_ERROR(residency_.load_to_slot(g, residency_.slot_of(g)));
    STRATA_RETURN_IF_ERROR(core_.device.synchronize(core_.h2d));
  }
  return Status::Ok();
}

Status DataParallel::land_done_rounds() {
  // A round holding a device slot (DpChunkFlags: in_collective, not evictable) counts against
  // half the slots; past that, the oldest is waited for here, with mu held: what
  // completes a collective (the communicator's stream, the other ranks issuing
  // it in the same order) never takes mu. Landing frees an off-GPU family's
  // slot and lets a GPU-homed family's be evicted again.
  const std::size_t limit = std::max<std::size_t>(1, residency_.device_slots().size() / 2);
  std::size_t holding = 0;
  for (Round& round : inflight_) {
    if (round.dev == nullptr || round.landed) continue;
    if (round.started && round.handle.done()) {
      STRATA_RETURN_IF_ERROR(round.handle.wait());
      STRATA_RETURN_IF_ERROR(land_device_round(round));
      round.landed = true;
      continue;
    }
    if (!round.staging.valid()) ++holding;
  }
  for (Round& round : inflight_) {
    if (holding <= limit) break;
    if (round.dev == nullptr || round.landed || round.staging.valid()) continue;
    if (!round.started) STRATA_RETURN_IF_ERROR(start_packed(true));
    STRATA_RETURN_IF_ERROR(round.handle.wait());
    STRATA_RETURN_IF_ERROR(land_device_round(round));
    round.landed = true;
    --holding;
  }
  return Status::Ok();
}

Status DataParallel::start_packed(bool block) {
  comm::Communicator& c = *core_.opt.comm;
  const Rounds rounds(core_);
  for (Round& round : inflight_) {
    if (round.started) continue;
    if (round.packed) {
      if (block) {
        STRATA_RETURN_IF_ERROR(core_.device.synchronize(*round.packed));
      } else {
        STRATA_ASSIGN_OR_RETURN(bool done, core_.device.query(*round.packed));
        if (!done) return Status::Ok();  // later rounds start after it: the same order on every rank
      }
    }
    if (round.dev != nullptr) {
      const std::uint64_t at = core_.shard_begin(round.first) * rounds.elem_bytes;
      STRATA_ASSIGN_OR_RETURN(round.handle, c.reduce_scatter(round.dev, round.dev + at,
                                                             round.slice / rounds.elem_bytes, rounds.dtype));
    } else {
      STRATA_ASSIGN_OR_RETURN(round.handle, c.reduce_scatter(round.send.data(), round.recv.data(),
                                                             round.slice / rounds.elem_bytes, rounds.dtype));
    }
    round.started = true;
  }
  return Status::Ok();
}

Status DataParallel::post_complete_rounds() {
  if (core_.dp_ranks() == 1 || !pipeline_.last_micro_batch) return Status::Ok();
  const std::size_t total = round_count(core_);
  while (rounds_posted_ < total) {
    const auto f = static_cast<FamilyId>(total - 1 - rounds_posted_);
    if (core_.chunk(f, StateKind::kGrad).bytes > 0 && !pipeline_.gradients_complete(f)) break;
    STRATA_RETURN_IF_ERROR(post_round(false));
  }
  STRATA_RETURN_IF_ERROR(start_packed(false));  // reductions whose packs ended since
  if (core_.opt.comm->device_buffers()) STRATA_RETURN_IF_ERROR(land_done_rounds());
  // Complete gradients not posted yet (a later family, in the fixed order, is
  // incomplete) stay on the device for their reduction.
  for (FamilyId f = 0; f < static_cast<FamilyId>(total - rounds_posted_); ++f) {
    flags_[f].awaiting_reduction =
        core_.chunk(f, StateKind::kGrad).bytes > 0 && pipeline_.gradients_complete(f);
  }
  return Status::Ok();
}

Status DataParallel::reduce_gradients(std::unique_lock<std::mutex>& lock) {
  if (core_.dp_ranks() == 1) return Status::Ok();
  while (rounds_posted_ < round_count(core_)) STRATA_RETURN_IF_ERROR(post_round(true));
  STRATA_RETURN_IF_ERROR(start_packed(true));
  const Rounds rounds(core_);
  std::vector<Round> inflight = std::move(inflight_);
  inflight_.clear();
  rounds_posted_ = 0;
  for (Round& round : inflight) {
    if (round.landed) continue;
    lock.unlock();
    Status st = round.handle.wait();
    lock.lock();
    STRATA_RETURN_IF_ERROR(st);
    if (round.dev != nullptr) {
      STRATA_RETURN_IF_ERROR(land_device_round(round));
      continue;
    }
    Chunk& g = core_.chunk_mut(round.first, StateKind::kGrad);
    const std::uint64_t at = core_.shard_begin(round.first) * rounds.elem_bytes;
    // The sum over ranks of this rank's shard replaces it where the gradient is
    // (the rest of the chunk is other ranks' shards: nothing reads it here).
    if (g.dirty() && comm_reads_device(core_)) {
      DeviceSlot& slot = residency_.slot_of(g);
      STRATA_RETURN_IF_ERROR(core_.device.synchronize(slot.fence));
      std::memcpy(slot.ptr + at, round.recv.data(), round.slice);
      continue;
    }
    if (g.absent()) {  // dropped once packed: only the shard's sum comes back
      STRATA_ASSIGN_OR_RETURN(std::byte * h, core_.host_buffer(g));
      std::memcpy(h + at, round.recv.data(), round.slice);
      g.move_value(ChunkValue::kHost);
      continue;
    }
    STRATA_RETURN_IF_ERROR(residency_.ensure_on_host(g));
    STRATA_RETURN_IF_ERROR(residency_.wait_host_reads(g));
    std::memcpy(g.host + at, round.recv.data(), round.slice);
    if (g.device_copy) {
      STRATA_RETURN_IF_ERROR(residency_.load_to_slot(g, residency_.slot_of(g)));
      STRATA_RETURN_IF_ERROR(core_.device.synchronize(core_.h2d));
    }
  }
  return Status::Ok();
}

void DataParallel::abandon_rounds(std::unique_lock<std::mutex>& lock) {
  // A round's buffers stay alive until its collective ended (a dead peer fails
  // it within the communicator's timeout: Note [Peer failure]).
  std::vector<Round> inflight = std::move(inflight_);
  inflight_.clear();
  rounds_posted_ = 0;
  lock.unlock();
  for (Round& round : inflight) {
    if (!round.landed && round.started) round.handle.wait().ignore();
  }
  inflight.clear();
  lock.lock();
  for (FamilyId f = 0; f < flags_.size(); ++f) {
    flags_[f].awaiting_reduction = false;
    flags_[f].grad_in_collective = false;
    flags_[f].param_in_collective = false;
  }
}

}  // namespace strata::runtime
