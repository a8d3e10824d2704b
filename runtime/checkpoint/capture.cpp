// Checkpoint capture: the save's hold on optimizer updates (Note [Overlapped save]):
// capturing a family (host copies into the save's own buffers, NVMe slots pinned),
// the save's room, and the hooks the runtime's scheduler and step() ask
// (Checkpointer::allows_update, capture_for_update, wait_captured, finish). It
// calls the source (its chunks' places and copies, NVMe slot pins, launching a
// held update); every function expects the source's lock held. The save thread
// (save_thread.cpp) calls it through checkpoint.hpp.

#include "checkpoint.hpp"

namespace strata::checkpoint {

// Note [Overlapped save]
// begin_checkpoint captures the state as of the call and returns; a background
// thread (SaveState::run) writes it while training goes on. Forward and
// backward only read params, so only an optimizer update changes what the save
// must write: family f's update does not start until f is captured
// (Checkpointer::allows_update, asked by the runtime's scheduler before every
// launch). Capturing f takes, under the lock:
//   - a chunk whose value is on NVMe: its slots, pinned (Source::pin_slot; Note
//     [Pinned NVMe slots] in the runtime's nvme_tier.hpp). The copy-on-write write-back of f's update goes to
//     fresh slots and the old ones are released only when the save has read them, so NVMe states stream from
//     their slots and never pass through the device;
//   - any other chunk: a copy into a buffer of the save's own (Source::copy_value).
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

SaveState::~SaveState() {
  for (auto& [bytes, p] : spares) allocated.erase(p);
  for (auto& [bytes, p] : spares) std::free(p);
  if (!allocated.empty()) {
    STRATA_LOG_WARN(
        "checkpoint: {} buffer(s) of the save were lost track of and are freed at its end (a bug: "
        "report it; runtime/checkpoint/checkpoint.hpp: SaveState)",
        allocated.size());
  }
  for (std::byte* p : allocated) std::free(p);
}

namespace detail {

//! A buffer of the save (Note [Overlapped save]): ordinary memory, 4096-aligned as
//! NVMe reads need, never the host store's (the plan gave all of it to training).
//! Within the save's room, or past it with `force` (the save thread, one family at a
//! time); null otherwise.
std::byte* save_allocate(SaveState& s, std::uint64_t bytes, bool force) {
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

void save_free(SaveState& s, std::byte* p, std::uint64_t bytes) {
  s.held_bytes -= bytes;
  if (s.spares.size() < kSaveSpares && s.held_bytes + bytes <= s.room) {
    s.spares.emplace_back(bytes, p);
    s.held_bytes += bytes;  // a spare counts in the room
    return;
  }
  s.allocated.erase(p);
  std::free(p);
}

void release_pieces(SaveState& s, std::vector<SaveState::Piece>& pieces) {
  for (SaveState::Piece& p : pieces) {
    if (p.buf != nullptr && !p.borrowed) save_free(s, p.buf, p.bytes);
    for (std::uint32_t slot : p.slots) s.src.unpin_slot(slot);
  }
  pieces.clear();
}

//! Captures family f (Note [Overlapped save]). `force` (the save thread): past the
//! save's room, in ordinary memory; else false when the copies do not fit the room.
Result<bool> capture_family(SaveState& s, FamilyId f, bool force) {
  Source& src = s.src;
  // Once only: a second capture would replace the first's pieces, losing their buffers and
  // NVMe slot pins and counting `uncaptured` down twice (every caller checks the stage,
  // with the lock held since).
  STRATA_CHECK(s.stage[f] == SaveState::Stage::kPending);
  // Its slots hold the states before the last step until its write-back ends.
  STRATA_CHECK(!force || !src.writing_back(f));
  if (src.writing_back(f)) return false;
  const FamilyEntry& fam = s.desc.families[f];
  std::vector<ChunkPlace> places;
  std::uint64_t need = 0;
  for (StateKind k : s.kinds[f]) {
    places.push_back(src.place(f, k));
    if (places.back().where != ChunkPlace::Where::kNvme) need += fam.chunk_bytes[static_cast<std::size_t>(k)];
  }
  if (!force && s.held_bytes + need > s.room) return false;
  std::vector<SaveState::Piece> pieces;
  Status st = Status::Ok();
  for (std::size_t i = 0; i < s.kinds[f].size(); ++i) {
    const StateKind k = s.kinds[f][i];
    ChunkPlace& place = places[i];
    SaveState::Piece p{.kind = k, .bytes = fam.chunk_bytes[static_cast<std::size_t>(k)]};
    if (place.where == ChunkPlace::Where::kNvme) {
      p.slots = std::move(place.slots);
      for (std::uint32_t slot : p.slots) src.pin_slot(slot);
      pieces.push_back(std::move(p));
      continue;
    }
    if (s.blocking && place.where == ChunkPlace::Where::kHost) {
      p.buf = place.host;
      p.borrowed = true;
      pieces.push_back(p);
      continue;
    }
    p.buf = save_allocate(s, p.bytes, force);
    if (p.buf == nullptr) {
      st = out_of_budget("checkpoint save: no room for a copy of family {} {}", f, state_kind_name(k));
      break;
    }
    pieces.push_back(p);
    // Copied without changing where the chunk lives: the plan's host room is training's.
    st = src.copy_value(f, k, p.buf);
    if (!st.ok()) break;
  }
  if (!st.ok()) {
    release_pieces(s, pieces);
    if (!force && st.code() == StatusCode::kOutOfBudget) return false;
    return st;
  }
  s.pieces[f] = std::move(pieces);
  s.stage[f] = SaveState::Stage::kCaptured;
  --s.uncaptured;
  if (s.held[f]) {
    s.held[f] = false;
    --s.held_count;
    src.launch_update(f);
  }
  src.changed().notify_all();
  return true;
}

//! Ends the save's hold on every update (after an error): they launch now.
void release_all_holds(SaveState& s) {
  for (FamilyId f = 0; f < s.stage.size(); ++f) {
    if (s.stage[f] == SaveState::Stage::kPending) {
      s.stage[f] = SaveState::Stage::kWritten;
      --s.uncaptured;
    }
    release_pieces(s, s.pieces[f]);
    if (s.held[f]) {
      s.held[f] = false;
      --s.held_count;
      s.src.launch_update(f);
    }
  }
  s.src.changed().notify_all();
}

}  // namespace detail

using namespace detail;

bool Checkpointer::allows_update(FamilyId f) {
  SaveState* s = save_.get();
  if (s == nullptr || s->done || s->stage[f] == SaveState::Stage::kCaptured ||
      s->stage[f] == SaveState::Stage::kWritten)
    return true;
  if (s->held[f]) return false;
  auto captured = capture_family(*s, f, /*force=*/false);
  if (captured.ok() && *captured) return true;
  if (!captured.ok()) {
    // The save thread captures it again (and reports the error if it persists).
    STRATA_LOG_DEBUG("checkpoint: capturing family {} on the training thread: {}", f,
                     captured.status().to_string());
  }
  s->held[f] = true;
  ++s->held_count;
  src_.changed().notify_all();
  return false;
}

Status Checkpointer::capture_for_update(std::unique_lock<std::mutex>& lock, FamilyId f) {
  std::shared_ptr<SaveState> s = save_;
  if (s == nullptr || !src_.updates_pending(f)) return Status::Ok();
  while (!s->done && s->stage[f] == SaveState::Stage::kPending) {
    auto captured = capture_family(*s, f, /*force=*/false);
    if (!captured.ok() || *captured) return captured.status();
    src_.changed().wait(lock);  // the save thread frees room as it writes
  }
  return Status::Ok();
}

Status Checkpointer::wait_captured(std::unique_lock<std::mutex>& lock, bool every_family) {
  std::shared_ptr<SaveState> s = save_;
  if (s == nullptr) return Status::Ok();
  src_.changed().wait(
      lock, [&] { return s->done || (s->held_count == 0 && (!every_family || s->uncaptured == 0)); });
  return Status::Ok();
}

Status Checkpointer::finish(std::unique_lock<std::mutex>& lock) {
  std::shared_ptr<SaveState> s = save_;  // kept while it runs: its holds stay in force
  if (s == nullptr) return Status::Ok();
  lock.unlock();
  if (s->thread.joinable()) s->thread.join();
  lock.lock();
  if (save_ == s) save_.reset();
  return s->status;
}

}  // namespace strata::checkpoint
