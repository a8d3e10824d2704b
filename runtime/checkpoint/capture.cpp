// Checkpoint capture: the save's hold on optimizer updates (Note [Overlapped save]):
// capturing a family (host copies into the save's own buffers, NVMe slots pinned),
// the save's room, and the hooks the scheduler and step() ask
// (Runtime::Impl::checkpoint_*). It calls Core (stores, NVMe slot pins) and the
// pipeline's launches; every function expects Core::mu held. The save thread
// (save.cpp) calls it through checkpoint.hpp.

#include "checkpoint.hpp"

namespace strata::runtime {

// Note [Overlapped save]
// begin_checkpoint captures the state as of the call and returns; a background
// thread (CheckpointSave::run) writes it while training goes on. Forward and
// backward only read params, so only an optimizer update changes what the save
// must write: family f's update does not start until f is captured
// (Runtime::Impl::checkpoint_allows_update, asked by the scheduler before every
// launch). Capturing f takes, under the lock:
//   - a chunk whose value is on NVMe: its slots, pinned (Note [Pinned NVMe slots]
//     in nvme_tier.hpp). The copy-on-write write-back of f's update goes to fresh
//     slots and the old ones are released only when the save has read them, so
//     NVMe states stream from their slots and never pass through the device;
//   - any other chunk: a copy into a host buffer of the host store (the budget).
// The save thread captures ahead, in reverse family order (the order backward
// completes them), as much as its room holds (a quarter of the host budget, in
// ordinary memory: the plan gives the host store to training), and writes
// captured families first, host copies before NVMe pieces (Note [Save I/O
// priority] in save.cpp). The training thread captures a family
// not yet captured itself before launching its update (release, step()), waiting
// while the room is full until the writer frees some; a family it could not
// capture (an error) is held back and launched by the save thread once captured,
// and step() waits for such held-back launches. Metadata (step counters,
// groups, the step index) is taken at the call. Files are published as Note
// [Checkpoint publish] says; an error ends the save, releases every held update
// and surfaces in finish_checkpoint / checkpoint_in_flight, and the published
// checkpoint is untouched. write_tensor, init_tensor and load_checkpoint wait
// until every family is captured; a second begin_checkpoint waits for the first.
// begin_checkpoint does not wait for the last step's NVMe write-backs (Note
// [Write-back after step]): a family still writing back is captured once its
// write-back ends (until then its slots hold the states before that step).

CheckpointSave::~CheckpointSave() {
  for (auto& [bytes, p] : spares) allocated.erase(p);
  for (auto& [bytes, p] : spares) std::free(p);
  if (!allocated.empty()) {
    STRATA_LOG_WARN(
        "checkpoint: {} buffer(s) of the save were lost track of and are freed at its end (a bug: "
        "report it; runtime/checkpoint/checkpoint.hpp)",
        allocated.size());
  }
  for (std::byte* p : allocated) std::free(p);
}

namespace checkpoint_detail {

//! A buffer of the save (Note [Overlapped save]): ordinary memory, 4096-aligned as
//! NVMe reads need, never the host store's (the plan gave all of it to training).
//! Within the save's room, or past it with `force` (the save thread, one family at a
//! time); null otherwise.
std::byte* save_allocate(CheckpointSave& s, std::uint64_t bytes, bool force) {
  if (!force && s.held_bytes + bytes > s.room) return nullptr;
  std::byte* p = nullptr;
  // A spare of the same size first: chunks are mostly one size, and a fresh buffer
  // costs a page fault per 4 KiB.
  for (auto it = s.spares.begin(); it != s.spares.end(); ++it) {
    if (it->first == bytes) {
      p = it->second;
      s.spares.erase(it);
      s.held_bytes -= bytes;  // (counted again below)
      break;
    }
  }
  if (p == nullptr) {
    p = static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
    if (p == nullptr) return nullptr;
    s.allocated.insert(p);
  }
  s.held_bytes += bytes;
  s.high_water = std::max(s.high_water, s.held_bytes);
  return p;
}

void save_free(CheckpointSave& s, std::byte* p, std::uint64_t bytes) {
  s.held_bytes -= bytes;
  if (s.spares.size() < kSaveSpares && s.held_bytes + bytes <= s.room) {
    s.spares.emplace_back(bytes, p);
    s.held_bytes += bytes;  // a spare counts in the room
    return;
  }
  s.allocated.erase(p);
  std::free(p);
}

void release_pieces(Core& core, std::vector<CheckpointSave::Piece>& pieces, CheckpointSave& s) {
  for (CheckpointSave::Piece& p : pieces) {
    if (p.buf != nullptr && !p.borrowed) save_free(s, p.buf, p.bytes);
    for (std::uint32_t slot : p.slots) core.nvme.unpin_slot(slot);
  }
  pieces.clear();
}

//! Captures family f (Note [Overlapped save]). `force` (the save thread): past the
//! save's room, in ordinary memory; else false when the copies do not fit the room.
Result<bool> capture_family(Runtime::Impl& m, CheckpointSave& s, FamilyId f, bool force) {
  Core& core = m.core;
  // Once only: a second capture would replace the first's pieces, losing their buffers and
  // NVMe slot pins and counting `uncaptured` down twice (every caller checks the stage,
  // with Core::mu held since).
  STRATA_CHECK(s.stage[f] == CheckpointSave::Stage::kPending);
  // Its slots hold the states before the last step until its write-back ends.
  STRATA_CHECK(!force || !m.pipeline.writing_back(f));
  if (m.pipeline.writing_back(f)) return false;
  std::uint64_t need = 0;
  for (StateKind k : s.kinds[f]) {
    const Chunk& c = core.chunk(f, k);
    if (c.value != ChunkValue::kNvme) need += c.bytes;
  }
  if (!force && s.held_bytes + need > s.room) return false;
  std::vector<CheckpointSave::Piece> pieces;
  Status st = Status::Ok();
  for (StateKind k : s.kinds[f]) {
    Chunk& c = core.chunk(f, k);
    CheckpointSave::Piece p{.kind = k, .bytes = c.bytes};
    if (c.value == ChunkValue::kNvme) {
      p.slots = c.nvme_slots;
      for (std::uint32_t slot : p.slots) core.nvme.pin_slot(slot);
      pieces.push_back(std::move(p));
      continue;
    }
    if (s.blocking && c.value == ChunkValue::kHost) {
      p.buf = c.host;
      p.borrowed = true;
      pieces.push_back(p);
      continue;
    }
    p.buf = save_allocate(s, c.bytes, force);
    if (p.buf == nullptr) {
      st = out_of_budget("checkpoint save: no room for a copy of family {} {}", f, state_kind_name(k));
      break;
    }
    pieces.push_back(p);
    // Copied without changing where the chunk lives: the plan's host room is training's.
    switch (c.value) {
      case ChunkValue::kHost:
        std::memcpy(p.buf, c.host, c.bytes);
        break;
      case ChunkValue::kAbsent:  // optimizer states start as zeros
        std::memset(p.buf, 0, c.bytes);
        break;
      case ChunkValue::kDevice: {  // the device copy is the only one: copy it, as a write-back would
        DeviceSlot& slot = m.residency.slot_of(c);
        st = core.device.wait(core.d2h, slot.fence);
        if (st.ok())
          st = core.device.copy_async(core.d2h, p.buf, slot.ptr, c.bytes, memory::CopyKind::kDeviceToHost);
        if (st.ok()) st = core.device.record(slot.fence, core.d2h);
        if (st.ok()) st = core.device.synchronize(core.d2h);
        break;
      }
      default:
        st = internal_error("checkpoint save: family {} {} is in the optimizer pipeline's staging", f,
                            state_kind_name(k));
    }
    if (!st.ok()) break;
  }
  if (!st.ok()) {
    release_pieces(core, pieces, s);
    if (!force && st.code() == StatusCode::kOutOfBudget) return false;
    return st;
  }
  s.pieces[f] = std::move(pieces);
  s.stage[f] = CheckpointSave::Stage::kCaptured;
  --s.uncaptured;
  if (s.held[f]) {
    s.held[f] = false;
    --s.held_count;
    m.pipeline.launch_optimizer(f);
  }
  core.cv.notify_all();
  return true;
}

//! Ends the save's hold on every update (after an error): they launch now.
void release_all_holds(Runtime::Impl& m, CheckpointSave& s) {
  for (FamilyId f = 0; f < s.stage.size(); ++f) {
    if (s.stage[f] == CheckpointSave::Stage::kPending) {
      s.stage[f] = CheckpointSave::Stage::kWritten;
      --s.uncaptured;
    }
    release_pieces(m.core, s.pieces[f], s);
    if (s.held[f]) {
      s.held[f] = false;
      --s.held_count;
      m.pipeline.launch_optimizer(f);
    }
  }
  m.core.cv.notify_all();
}

}  // namespace checkpoint_detail

using namespace checkpoint_detail;

bool Runtime::Impl::checkpoint_allows_update(FamilyId f) {
  CheckpointSave* s = checkpoint.get();
  if (s == nullptr || s->done || s->stage[f] == CheckpointSave::Stage::kCaptured ||
      s->stage[f] == CheckpointSave::Stage::kWritten)
    return true;
  if (s->held[f]) return false;
  auto captured = capture_family(*this, *s, f, /*force=*/false);
  if (captured.ok() && *captured) return true;
  if (!captured.ok()) {
    // The save thread captures it again (and reports the error if it persists).
    STRATA_LOG_DEBUG("checkpoint: capturing family {} on the training thread: {}", f,
                     captured.status().to_string());
  }
  s->held[f] = true;
  ++s->held_count;
  core.cv.notify_all();
  return false;
}

Status Runtime::Impl::checkpoint_capture_for_update(std::unique_lock<std::mutex>& lock, FamilyId f) {
  std::shared_ptr<CheckpointSave> s = checkpoint;
  if (s == nullptr) return Status::Ok();
  bool updates = false;
  for (TensorId t : core.layout().families[f].tensors)
    updates = updates || (core.tensors[t].grad_written && !core.tensors[t].spec.frozen);
  if (!updates) return Status::Ok();
  while (!s->done && s->stage[f] == CheckpointSave::Stage::kPending) {
    auto captured = capture_family(*this, *s, f, /*force=*/false);
    if (!captured.ok() || *captured) return captured.status();
    core.cv.wait(lock);  // the save thread frees room as it writes
  }
  return Status::Ok();
}

Status Runtime::Impl::checkpoint_wait_captured(std::unique_lock<std::mutex>& lock, bool every_family) {
  std::shared_ptr<CheckpointSave> s = checkpoint;
  if (s == nullptr) return Status::Ok();
  core.cv.wait(lock,
               [&] { return s->done || (s->held_count == 0 && (!every_family || s->uncaptured == 0)); });
  return Status::Ok();
}

Status Runtime::Impl::checkpoint_finish(std::unique_lock<std::mutex>& lock) {
  std::shared_ptr<CheckpointSave> s = checkpoint;  // kept while it runs: its holds stay in force
  if (s == nullptr) return Status::Ok();
  lock.unlock();
  if (s->thread.joinable()) s->thread.join();
  lock.lock();
  if (checkpoint == s) checkpoint.reset();
  return s->status;
}

}  // namespace strata::runtime
