// OptimizerPipeline: NVMe places, read-ahead of optimizer states and their
// write-back after the kernel (optimizer_pipeline.hpp).
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
// idle the core_.device), and the updated states go to fresh slots in the background
// while step() returns and the next forward runs_. The family keeps its NVMe
// place (and so its staging memory) until the writes end; its next read waits
// for them. When they succeed the new slots replace the old; when one fails the
// updated states stay in host memory as the authoritative copy (nothing is lost:
// read_tensor reads them), the error surfaces from the next call, and no further
// family starts. So a write failure leaves its family at the state *after* the
// step; a full disk (no slot to write to, found before anything is committed)
// leaves it at the state before. flush() waits for every write-back.

#include <cstring>

#include "pipeline/optimizer_pipeline.hpp"
#include "residency/residency.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {
namespace {

// The chunks of a family that its NVMe write-back writes: the optimizer states,
// and the param when it lives on NVMe too.
bool written_home(const Core& core, const Chunk& c) {
  return c.bytes > 0 &&
         (is_optim_kind(c.kind) || (c.kind == StateKind::kParam && core.param_on_nvme(c.family)));
}

}  // namespace

void OptimizerPipeline::take_nvme_place(FamilyId f) {
  FamilyRun& run = runs_[f];
  run.move_place(NvmePlace::kReading);
  ++nvme_places_used_;
  read_states(f);
}

void OptimizerPipeline::release_nvme_place(FamilyId f) {
  FamilyRun& run = runs_[f];
  if (run.param == ParamRead::kAwaitsGradients) run.move_param(ParamRead::kNone);
  if (run.place == NvmePlace::kNone) return;
  for (std::size_t k = 0; k < run.staging.size(); ++k) {
    if (run.staging[k] != nullptr)
      core_.host->free(run.staging[k], core_.chunks().at(f, static_cast<StateKind>(k)).bytes);
  }
  run.staging.clear();
  run.move_place(NvmePlace::kNone);
  --nvme_places_used_;
}

void OptimizerPipeline::cancel_read_ahead(FamilyId f) {
  FamilyRun& run = runs_[f];
  if (run.io_pending > 0) {
    run.move_place(NvmePlace::kCancelling);  // io_done releases the place
    return;
  }
  release_nvme_place(f);
}

void OptimizerPipeline::add_read_pieces(const Chunk& c, std::byte* buffer,
                                        std::vector<NvmePiece>& pieces) const {
  const std::uint64_t piece = core_.nvme.store().slot_bytes();
  for (std::size_t i = 0; i < c.nvme_slots.size(); ++i) {
    const std::uint64_t begin = i * piece;
    pieces.push_back({c.nvme_slots[i],
                      std::span<std::byte>(buffer + begin, std::min<std::uint64_t>(piece, c.bytes - begin))});
  }
}

void OptimizerPipeline::read_states(FamilyId f) {
  FamilyRun& run = runs_[f];
  run.staging.assign(kStateKindCount, nullptr);
  run.pieces.clear();                 // keeps its capacity (Note [Allocation-free hot paths] in leases.cpp)
  const Chunk* param_read = nullptr;  // an NVMe-homed param's value, on NVMe
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    const Chunk& c = core_.chunk(f, static_cast<StateKind>(k));
    if (c.bytes == 0 || (!is_optim_kind(c.kind) && c.kind != StateKind::kParam)) continue;
    auto buffer = core_.host->allocate(c.bytes);
    if (!buffer.ok()) {
      if (!run.launched()) {
        // Reading ahead is an optimisation: without room it waits for the launch.
        STRATA_LOG_DEBUG("runtime: no host room to read family {} ahead: {}", f, buffer.status().to_string());
        release_nvme_place(f);
        return;
      }
      // No room: the family waits, placeless, for pipeline work that frees some (Note [Backpressure]).
      release_nvme_place(f);
      note_no_room(buffer.status(), fmt::format("NVMe staging for family {}", f));
      return;
    }
    run.staging[k] = *buffer;
    // A host-homed param is copied when the kernel starts; an NVMe-homed one is
    // read here beside the states (Note [NVMe-homed params]).
    if (c.kind == StateKind::kParam && !core_.param_on_nvme(f)) continue;
    if (c.value == ChunkValue::kHost) {
      std::memcpy(*buffer, c.host, c.bytes);  // left in host memory by a failed write-back
      continue;
    }
    if (c.value != ChunkValue::kNvme) {
      std::memset(*buffer, 0, c.bytes);  // never written: zeros
      continue;
    }
    if (c.kind == StateKind::kParam) {
      param_read = &c;  // once every buffer is had
      continue;
    }
    add_read_pieces(c, *buffer, run.pieces);
  }
  if (param_read != nullptr) {
    // Staged for a use: copied from there, not read again (Note [NVMe-homed
    // params]); else it waits for the gradients, by when its backward use has
    // staged it (maybe_compute).
    run.lent_param = residency_.lend_staged(f);
    if (run.lent_param == nullptr) run.move_param(ParamRead::kAwaitsGradients);
  }
  if (run.pieces.empty() && run.lent_param == nullptr) {
    run.move_place(NvmePlace::kReady);
    maybe_compute(f);
    return;
  }
  start_reads(f);
}

void OptimizerPipeline::fetch_deferred_param(FamilyId f) {
  FamilyRun& run = runs_[f];
  STRATA_CHECK(run.io_pending == 0);
  run.move_param(ParamRead::kNone);
  run.pieces.clear();  // the states' reads ended
  run.lent_param = residency_.lend_staged(f);
  const Chunk& p = core_.chunk(f, StateKind::kParam);
  if (run.lent_param == nullptr && p.device_copy && p.device_slot >= 0) {
    // Its backward use found the forward's device copy: copied back from there.
    if (Status st = copy_param_from_device(f); !st.ok()) finish_family(f, st);
    return;
  }
  if (run.lent_param == nullptr) {
    // Neither staged nor on the device (a use on demand took the buffer back): read once more.
    core_.param_update_read_bytes += p.bytes;
    add_read_pieces(p, run.staging[static_cast<std::size_t>(StateKind::kParam)], run.pieces);
  }
  start_reads(f);
}

Status OptimizerPipeline::copy_param_from_device(FamilyId f) {
  FamilyRun& run = runs_[f];
  const Chunk& p = core_.chunk(f, StateKind::kParam);
  DeviceSlot& slot = residency_.slot_of(p);
  // A reader of the slot (Note [Chunk state machine]): after its load and its
  // users, and the slot's next writer after it.
  Status st = core_.device.wait(core_.d2h, slot.fence);
  if (st.ok()) st = core_.device.wait(core_.d2h, slot.ready);
  if (st.ok())
    st = core_.timed_copy(core_.d2h, Track::kD2H, run.staging[static_cast<std::size_t>(StateKind::kParam)],
                          slot.ptr, p.bytes, memory::CopyKind::kDeviceToHost, SpanName{"d2h", f, "param"});
  if (st.ok()) st = core_.device.record(slot.fence, core_.d2h);
  if (st.ok()) {
    run.io_pending = 1;
    run.io_status = Status::Ok();
    ++io_families_;
    run.move_place(NvmePlace::kReading);
    st = core_.device.launch_host(core_.d2h, [this, f] {
      // Device-stream callbacks never take the mutex (Note [Runtime threading]).
      core_.pool->post([this, f] {
        std::lock_guard lock(core_.mu);
        read_piece_done(f, Status::Ok());
      });
    });
    if (!st.ok()) {
      run.io_pending = 0;
      --io_families_;
      run.move_place(NvmePlace::kReady);
    }
  }
  if (!st.ok()) {
    core_.device.synchronize(core_.d2h).ignore();  // nothing may still copy into the staging
    st.with_context(fmt::format("copying family {}'s param from its device copy for its optimizer", f));
  }
  return st;
}

void OptimizerPipeline::start_reads(FamilyId f) {
  FamilyRun& run = runs_[f];
  run.io_pending = static_cast<int>(run.pieces.size()) + (run.lent_param != nullptr ? 1 : 0);
  STRATA_CHECK(run.io_pending > 0);
  if (run.place == NvmePlace::kReady) run.move_place(NvmePlace::kReading);  // a deferred param
  run.io_status = Status::Ok();
  ++io_families_;
  // Submitted from a pool thread, without the lock: a store may call back on the
  // submitting thread, and the caller may be iterating the pipeline's queues.
  // The task gets the pieces' address and count, not the vector: nothing
  // changes them until the last piece completed (NvmeTier::submit_pieces).
  const double enqueued = core_.timeline.now_us();
  if (!run.pieces.empty()) {
    core_.pool->post([this, f, enqueued, pieces = std::span<const NvmePiece>(run.pieces)] {
      core_.nvme.submit_pieces(NvmeIo::kRead, pieces, &OptimizerPipeline::nvme_read_done, this, f, enqueued);
    });
  }
  if (run.lent_param != nullptr) {
    const Chunk& p = core_.chunk(f, StateKind::kParam);
    // Nothing frees either buffer until staged_param_copied: the lend holds the
    // source, the family's place the destination.
    core_.pool->post([this, f, dst = run.staging[static_cast<std::size_t>(StateKind::kParam)],
                      src = run.lent_param, bytes = p.bytes] {
      std::memcpy(dst, src, bytes);
      staged_param_copied(f);
    });
  }
}

void OptimizerPipeline::staged_param_copied(FamilyId f) {
  std::lock_guard lock(core_.mu);
  FamilyRun& run = runs_[f];
  residency_.give_back_staged(f);
  run.lent_param = nullptr;
  read_piece_done(f, Status::Ok());
  core_.cv.notify_all();  // drop_staging or a staging buffer's taker may wait for the lend
}

void OptimizerPipeline::nvme_read_done(void* self, FamilyId f, Status status, double enqueued_us,
                                       std::uint64_t bytes) {
  static_cast<OptimizerPipeline*>(self)->io_done(f, std::move(status), Track::kDiskRead, enqueued_us, bytes);
}

void OptimizerPipeline::nvme_write_done(void* self, FamilyId f, Status status, double enqueued_us,
                                        std::uint64_t bytes) {
  static_cast<OptimizerPipeline*>(self)->writeback_done(f, std::move(status), enqueued_us, bytes);
}

void OptimizerPipeline::io_done(FamilyId f, Status status, Track track, double enqueued_us,
                                std::uint64_t bytes) {
  const double end = core_.timeline.now_us();
  core_.timeline.add(track, SpanName{"nvme read", f}, enqueued_us, end, bytes);
  std::lock_guard lock(core_.mu);
  read_piece_done(f, std::move(status));
}

void OptimizerPipeline::read_piece_done(FamilyId f, Status status) {
  FamilyRun& run = runs_[f];
  if (!status.ok() && run.io_status.ok()) {
    status.with_context(fmt::format("NVMe read of family {}'s optimizer states", f));
    run.io_status = std::move(status);
  }
  if (--run.io_pending > 0) return;
  --io_families_;
  if (run.place == NvmePlace::kCancelling) {
    release_nvme_place(f);
    pump();
    core_.cv.notify_all();
    return;
  }
  if (!run.io_status.ok()) {
    if (run.launched()) {
      finish_family(f, run.io_status);
    } else {
      core_.errors.fail(run.io_status);  // a read-ahead failed: the data is bad or the disk is
      release_nvme_place(f);
      pump();  // ends the families waiting for a place (Note [Failed work completes its waiters])
      core_.cv.notify_all();
    }
    return;
  }
  // (An error may have ended the family, and released its place, meanwhile.)
  if (run.place == NvmePlace::kReading) run.move_place(NvmePlace::kReady);
  if (!core_.errors.background().ok()) {
    // Another family failed while these reads were in flight: pump's error path
    // ends this family too if it still waits, e.g. for a grad staging buffer the
    // failure took out of the queue (Note [Failed work completes its waiters]).
    pump();
  } else {
    maybe_compute(f);
  }
  core_.cv.notify_all();
}

void OptimizerPipeline::write_back(FamilyId f, std::unique_lock<std::mutex>& lock) {
  FamilyRun& run = runs_[f];
  Chunk& p = core_.chunk_mut(f, StateKind::kParam);
  WriteBack& wb = writebacks_[f];
  STRATA_CHECK(!wb.active);
  // Write the updated states to fresh slots (Note [Copy-on-write NVMe slots]);
  // every slot is taken before anything is committed, so a full disk leaves the
  // family as it was. The slot and piece lists are the write-back's own, reused
  // step to step (Note [Allocation-free hot paths] in leases.cpp).
  wb.new_slots.resize(kStateKindCount);
  const std::uint64_t piece = core_.nvme.store().slot_bytes();
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    const Chunk& c = core_.chunk(f, static_cast<StateKind>(k));
    if (!written_home(core_, c)) continue;
    for (std::uint64_t begin = 0; begin < c.bytes; begin += piece) {
      auto slot = core_.nvme.store().allocate_slot();
      if (!slot.ok()) {
        for (auto& list : wb.new_slots) {
          for (std::uint32_t s : list) core_.nvme.free_slot(s);
        }
        wb.reset();
        Status st = slot.status();
        st.with_context(fmt::format("NVMe write of family {}'s optimizer states", f));
        finish_family(f, st);
        return;
      }
      wb.new_slots[k].push_back(*slot);
      wb.writes.push_back(
          {*slot, std::span<std::byte>(run.staging[k] + begin, std::min(piece, c.bytes - begin))});
    }
  }
  // Commit the param now; the states follow in the background (Note [Write-back after step]).
  std::byte*& staged = run.staging[static_cast<std::size_t>(StateKind::kParam)];
  if (core_.param_on_nvme(f)) {
    // The updated param is the host copy until its write ends (Note [NVMe-homed params]);
    // the old value's staging copy goes (it may still be being read: unlocks).
    if (Status st = residency_.drop_staging(lock, p); !st.ok()) core_.errors.fail(st);
    // (The write reads `staged` too: it stays the host copy until writeback_done.)
    p.host = staged;
    p.move_value(ChunkValue::kHost);
  } else {
    // A load of the old param may still be copying from it.
    if (Status st = residency_.wait_host_reads(p); !st.ok()) core_.errors.fail(st);
    core_.host->free(p.host, p.bytes);
    p.host = staged;
  }
  staged = nullptr;
  commit_param(f);
  wb.active = true;
  wb.staging.swap(run.staging);  // run.staging gets wb's emptied list (and its capacity)
  wb.io_pending = static_cast<int>(wb.writes.size());
  wb.step = run.carried() ? steps_done_ : steps_done_ + 1;  // (a carried update is its last step's)
  ++writebacks_in_flight_;
  // The place (and its staging memory) goes with the write-back.
  run.staging.clear();
  run.move_place(NvmePlace::kNone);
  finish_family(f, Status::Ok());
  if (wb.writes.empty()) {
    lock.unlock();
    writeback_done(f, Status::Ok(), core_.timeline.now_us(), 0);  // (a family with no optimizer states)
    return;
  }
  // The pieces' address and count, taken under the lock: nothing changes them
  // until the last write completed (NvmeTier::submit_pieces).
  const std::span<const NvmePiece> writes(wb.writes);
  lock.unlock();  // a store may call back on this thread
  core_.nvme.submit_pieces(NvmeIo::kWrite, writes, &OptimizerPipeline::nvme_write_done, this, f,
                           core_.timeline.now_us());
}

void OptimizerPipeline::writeback_done(FamilyId f, Status status, double enqueued_us, std::uint64_t bytes) {
  core_.timeline.add(Track::kDiskWrite, SpanName{"nvme write", f}, enqueued_us, core_.timeline.now_us(),
                     bytes);
  std::lock_guard lock(core_.mu);
  WriteBack& wb = writebacks_[f];
  if (!status.ok() && wb.status.ok()) wb.status = std::move(status);
  if (--wb.io_pending > 0) return;
  for (std::size_t k = 0; k < kStateKindCount; ++k) {
    Chunk& c = core_.chunk_mut(f, static_cast<StateKind>(k));
    if (!written_home(core_, c)) continue;
    if (c.kind == StateKind::kParam) {
      // An NVMe-homed param: its updated host copy (committed in write_back) goes
      // once its new slots hold it; after a failed write it stays the value.
      for (std::uint32_t s : wb.status.ok() ? c.nvme_slots : wb.new_slots[k]) core_.nvme.free_slot(s);
      if (wb.status.ok()) {
        c.nvme_slots.swap(wb.new_slots[k]);  // (wb.reset() empties the old list, keeping its capacity)
        if (Status st = residency_.wait_host_reads(c); !st.ok()) core_.errors.fail(st);  // a load may read it
        core_.host->free(c.host, c.bytes);
        c.host = nullptr;
        c.move_value(ChunkValue::kNvme);
      } else {
        for (std::uint32_t old : c.nvme_slots) core_.nvme.free_slot(old);
        c.nvme_slots.clear();
      }
      continue;
    }
    if (wb.status.ok()) {
      // The new slots replace the old (Note [Copy-on-write NVMe slots]).
      for (std::uint32_t old : c.nvme_slots) core_.nvme.free_slot(old);
      c.nvme_slots.swap(wb.new_slots[k]);
      c.move_value(ChunkValue::kNvme);
      core_.host->free(wb.staging[k], c.bytes);
    } else {
      // The updated states stay in host memory as the authoritative copy.
      for (std::uint32_t s : wb.new_slots[k]) core_.nvme.free_slot(s);
      for (std::uint32_t old : c.nvme_slots) core_.nvme.free_slot(old);
      c.nvme_slots.clear();
      c.move_value(ChunkValue::kHost);
      if (c.host != nullptr) core_.host->free(c.host, c.bytes);
      c.host = wb.staging[k];
    }
  }
  if (!wb.status.ok()) {
    Status s = std::move(wb.status);
    s.with_context(fmt::format(
        "NVMe write-back of family {}'s optimizer states{} after step {}; that step's {} kept in host "
        "memory (read_tensor reads them: save a checkpoint) and no further step runs",
        f, core_.param_on_nvme(f) ? " and param" : "", wb.step,
        core_.param_on_nvme(f) ? "param and states are" : "states are"));
    core_.errors.fail(std::move(s));
  }
  wb.reset();
  --writebacks_in_flight_;
  --nvme_places_used_;  // the family's place, held since its states were read
  pump();
  core_.cv.notify_all();
}

}  // namespace strata::runtime
