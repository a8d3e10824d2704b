// Checkpoint save: the save thread's work (save.cpp starts it) — reading pinned NVMe
// pieces ahead (Note [Save read-ahead]), creating the files ahead (Note [Save file
// creation]), capturing ahead and appending each family's pieces in the order
// next_family picks, then the manifest (Note [Checkpoint format]). It calls the
// capture side and the format side through checkpoint.hpp, and the source (its
// lock, NVMe slot pins).

#include "checkpoint.hpp"

namespace strata::checkpoint {

using namespace detail;

//! Family f's data file name in this save (Note [Checkpoint format]).
static std::string family_file(const SaveState& s, FamilyId f) {
  return fmt::format("family-{}.g{}.bin", f, s.generation);
}

// Note [Save read-ahead]
// A family's NVMe-held states are not in host memory: the save reads their pinned
// slots into buffers of its own before appending them. Read one piece at a time,
// the disk sat idle while the save thread copied and checksummed, and the writes
// waited while it read: the save took the read time plus the write time. So the
// save thread keeps up to kSaveReadAheadBytes of reads in flight ahead of the
// piece it appends: the rest of the current family's NVMe pieces, then those of
// the captured families next_family picks next — in a blocking save the captured
// ones (it captures ahead for this: its host pieces are borrowed, its NVMe pieces
// only pinned, so capturing costs no room but a device copy's); in an overlapped
// save, once it writes the deferred NVMe pieces, the other deferred families'
// (before, a captured family's NVMe pieces wait, and so would their buffers). The buffers are
// ordinary memory past the room (as the one-piece reads' were), kSaveReadAheadBytes
// at most; a read's buffer and its pins live until the piece is appended, or until
// the save fails and ReadAhead's destructor has waited for the read.

//! One piece's NVMe read in flight (or done) into a buffer of the save.
struct PieceRead {
  FamilyId family = 0;
  std::size_t piece = 0;
  std::byte* buf = nullptr;
  std::uint64_t bytes = 0;
  struct Latch {
    std::mutex mu;
    std::condition_variable cv;
    std::size_t pending = 0;
    Status status;
  };
  std::shared_ptr<Latch> latch = std::make_shared<Latch>();

  Status wait() const {
    std::unique_lock g(latch->mu);
    latch->cv.wait(g, [&] { return latch->pending == 0; });
    return latch->status;
  }
};

//! Starts reading a piece's pinned NVMe slots into a buffer of the save.
static PieceRead start_read(SaveState& s, FamilyId f, std::size_t index) {
  const SaveState::Piece& p = s.pieces[f][index];
  PieceRead r{.family = f, .piece = index, .bytes = p.bytes};
  {
    std::lock_guard lock(s.src.mutex());
    r.buf = save_allocate(s, p.bytes, true);
  }
  const std::uint64_t piece = s.nvme->slot_bytes();
  r.latch->pending = p.slots.size();
  for (std::size_t i = 0; i < p.slots.size(); ++i) {
    const std::uint64_t begin = i * piece;
    std::span<std::byte> part(r.buf + begin, std::min<std::uint64_t>(piece, p.bytes - begin));
    auto done = [latch = r.latch](Status st) {
      std::lock_guard g(latch->mu);
      if (!st.ok() && latch->status.ok()) latch->status = std::move(st);
      if (--latch->pending == 0) latch->cv.notify_all();
    };
    Status st = s.nvme->read(p.slots[i], part, done);
    if (!st.ok()) done(st);
  }
  return r;
}

//! The save's reads ahead of its writer (Note [Save read-ahead]).
class ReadAhead {
 public:
  explicit ReadAhead(SaveState& s) : s_(s) {}
  ReadAhead(const ReadAhead&) = delete;
  ReadAhead& operator=(const ReadAhead&) = delete;
  //! Waits for every read still in flight (a failed save) and frees its buffer.
  ~ReadAhead() {
    for (PieceRead& r : reads_) {
      (void)r.wait();
      std::lock_guard lock(s_.src.mutex());
      save_free(s_, r.buf, r.bytes);
    }
  }

  //! Piece `index` of family f, read: the read ahead's buffer, or a read started now.
  //! The caller frees the buffer (save_free) once appended.
  Result<std::byte*> take(FamilyId f, std::size_t index) {
    auto it = std::find_if(reads_.begin(), reads_.end(),
                           [&](const PieceRead& r) { return r.family == f && r.piece == index; });
    PieceRead r = it != reads_.end() ? std::move(*it) : start_read(s_, f, index);
    if (it != reads_.end()) {
      reads_.erase(it);
      bytes_ -= r.bytes;
    }
    Status read = r.wait();
    if (!read.ok()) {
      std::lock_guard lock(s_.src.mutex());
      save_free(s_, r.buf, r.bytes);
      return read;
    }
    return r.buf;
  }

  //! Starts reads of the NVMe pieces the writer appends next: family f's from piece
  //! `from` on, then the captured families' next_family picks next, up to
  //! kSaveReadAheadBytes in flight.
  void fill(FamilyId f, std::size_t from) {
    add_family(f, from);
    std::vector<FamilyId> next;
    {
      std::lock_guard lock(s_.src.mutex());
      const bool deferred_phase = !s_.blocking && s_.deferred[f];
      for (FamilyId g = 0; g < s_.stage.size(); ++g) {
        if (g == f || s_.stage[g] != SaveState::Stage::kCaptured) continue;
        if (s_.blocking ? !s_.deferred[g] : deferred_phase && s_.deferred[g]) next.push_back(g);
      }
    }
    for (FamilyId g : next) {
      if (bytes_ >= kSaveReadAheadBytes) break;
      add_family(g, 0);
    }
  }

 private:
  void add_family(FamilyId f, std::size_t from) {
    // The save thread alone changes a captured family's pieces (appending them).
    const std::vector<SaveState::Piece>& pieces = s_.pieces[f];
    for (std::size_t i = from; i < pieces.size() && bytes_ < kSaveReadAheadBytes; ++i) {
      if (pieces[i].buf != nullptr || pieces[i].slots.empty()) continue;
      const bool started = std::any_of(reads_.begin(), reads_.end(),
                                       [&](const PieceRead& r) { return r.family == f && r.piece == i; });
      if (started) continue;
      reads_.push_back(start_read(s_, f, i));
      bytes_ += pieces[i].bytes;
    }
  }

  SaveState& s_;
  std::deque<PieceRead> reads_;
  std::uint64_t bytes_ = 0;
};

// Note [Save file creation]
// Creating a file took 0.6-0.8 ms here (ext4 on a virtio disk; creates in one
// directory take its lock one at a time, so more threads do not help): 0.09-0.14 s
// for the 170 files of a 256 MiB save with 512 KiB chunks, on the save thread
// between the families it wrote. So a thread of the save creates the families'
// files ahead of the writer, last family first (the order a save captures pending
// families in); the writer takes a file created, waits for one being created, or
// creates it itself when the creator has not reached it. The files, and their
// errors, are the ones the writer would have made (before_create runs for each). A
// failed save removes its temporaries, written or not (remove_temporaries); a
// crashed save's are removed by the next publish.

//! Creates a save's files ahead of its writer (Note [Save file creation]).
class FileCreator {
 public:
  //! `paths[f]`: family f's final path, empty for a family this rank does not write.
  explicit FileCreator(std::vector<fs::path> paths)
      : paths_(std::move(paths)), state_(paths_.size(), State::kUnclaimed), made_(paths_.size()) {
    thread_ = std::thread([this] { run(); });
  }
  FileCreator(const FileCreator&) = delete;
  FileCreator& operator=(const FileCreator&) = delete;
  ~FileCreator() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    thread_.join();
  }

  //! Family f's temporary file, created.
  Result<Fd> take(FamilyId f) {
    std::unique_lock lock(mu_);
    if (state_[f] == State::kUnclaimed) {
      state_[f] = State::kTaken;
      lock.unlock();
      return create_tmp(paths_[f]);
    }
    cv_.wait(lock, [&] { return state_[f] == State::kMade; });
    state_[f] = State::kTaken;
    Result<Fd> fd = std::move(*made_[f]);
    made_[f].reset();
    return fd;
  }

 private:
  enum class State : std::uint8_t { kUnclaimed, kCreating, kMade, kTaken };

  void run() {
    for (std::size_t f = paths_.size(); f-- > 0;) {
      {
        std::lock_guard lock(mu_);
        if (stop_) return;
        if (paths_[f].empty() || state_[f] != State::kUnclaimed) continue;
        state_[f] = State::kCreating;
      }
      Result<Fd> fd = create_tmp(paths_[f]);
      std::lock_guard lock(mu_);
      made_[f].emplace(std::move(fd));
      state_[f] = State::kMade;
      cv_.notify_all();
    }
  }

  const std::vector<fs::path> paths_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<State> state_;
  std::vector<std::optional<Result<Fd>>> made_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the rest is constructed
};

//! One family's file while it is written: its pieces go in file order, and an
//! overlapped save may stop before the first NVMe piece (Note [Save I/O priority]).
struct FamilyFile {
  std::optional<StripedWriter> w;
  std::vector<json> entries;  //!< per tensor of the family: "states"
  std::size_t next = 0;       //!< the next piece to append
};

//! Appends family f's captured pieces from file.next on to its file (each state's
//! dtype and offset into file.entries). A host copy is freed as soon as it is
//! appended (its room is training's again), pinned NVMe slots once read. With
//! `host_only`, stops at the first NVMe piece. True once every piece is appended.
static Result<bool> write_family(SaveState& s, FamilyId f, FamilyFile& file, bool host_only,
                                 ReadAhead& ahead) {
  const Description& d = s.desc;
  const FamilyEntry& fam = d.families[f];
  std::vector<SaveState::Piece>& pieces = s.pieces[f];
  for (; file.next < pieces.size(); ++file.next) {
    SaveState::Piece& p = pieces[file.next];
    const DType dtype = d.kind_dtype[static_cast<std::size_t>(p.kind)];
    const std::uint64_t esize = dtype_bytes(dtype);
    std::byte* base = p.buf;
    std::byte* read_buf = nullptr;
    if (base == nullptr) {  // pinned NVMe slots: read into a buffer of the save (Note [Save read-ahead])
      if (host_only) return false;
      ahead.fill(f, file.next);
      STRATA_ASSIGN_OR_RETURN(read_buf, ahead.take(f, file.next));
      base = read_buf;
    }
    for (std::size_t i = 0; i < fam.tensors.size(); ++i) {
      const TensorEntry& ts = d.tensors[fam.tensors[i]];
      file.entries[i]["states"][std::string(state_kind_name(p.kind))] = {
          {"dtype", std::string(runtime::dtype_name(dtype))}, {"offset", file.w->size()}};
      file.w->append(base + ts.offset_elems * esize, ts.numel * esize);
      if (dtype == DType::kQ8) {  // its block scales after its codes (Note [Q8 checkpoints] in q8_states.cpp)
        // The scales follow the chunk's codes: this rank's shard, or all of them once gathered.
        const std::uint64_t codes =
            s.sharded ? fam.shard_elems * static_cast<std::uint64_t>(s.src.ranks()) : fam.shard_elems;
        file.w->append(base + codes + ts.offset_elems / runtime::kQ8BlockElems * 4,
                       4 * ((ts.numel + runtime::kQ8BlockElems - 1) / runtime::kQ8BlockElems));
      }
    }
    std::lock_guard lock(s.src.mutex());
    if (read_buf != nullptr) save_free(s, read_buf, p.bytes);
    // Appended: what the piece held goes back now (release_pieces skips it later).
    if (p.buf != nullptr && !p.borrowed) save_free(s, p.buf, p.bytes);
    p.buf = nullptr;
    p.borrowed = false;
    for (std::uint32_t slot : p.slots) s.src.unpin_slot(slot);
    p.slots.clear();
    s.src.changed().notify_all();
  }
  return true;
}

//! Captures ahead, in backward order, what the room holds (one family per lock hold),
//! so the training thread finds its families captured and copies nothing itself,
//! and the read-ahead finds the NVMe pieces to read (Note [Save read-ahead]).
static Status capture_ahead(SaveState& s) {
  for (FamilyId g = s.stage.size(); g-- > 0;) {
    std::unique_lock lock(s.src.mutex());
    if (s.stage[g] != SaveState::Stage::kPending || s.src.writing_back(g)) continue;
    STRATA_ASSIGN_OR_RETURN(const bool captured, capture_family(s, g, /*force=*/false));
    if (!captured) break;
  }
  return Status::Ok();
}

//! Captures and launches held-back updates whose copies fit the room. The lock held.
static Status capture_held(SaveState& s) {
  for (FamilyId g = 0; g < s.stage.size(); ++g) {
    if (s.held[g] && s.stage[g] == SaveState::Stage::kPending) {
      STRATA_ASSIGN_OR_RETURN(const bool captured, capture_family(s, g, /*force=*/false));
      if (!captured) break;
    }
  }
  s.src.changed().notify_all();
  return Status::Ok();
}

//! The family the save thread writes next, captured: a held-back one first (the
//! training thread waits for exactly that capture); then captured ones; then
//! pending ones in backward order (captured past the room if need be); last, the
//! NVMe pieces deferred (Note [Save I/O priority]).
static Result<FamilyId> next_family(SaveState& s) {
  const std::size_t families = s.stage.size();
  std::unique_lock lock(s.src.mutex());
  std::optional<FamilyId> pick;
  for (FamilyId g = 0; g < families && !pick; ++g) {
    if (s.held[g]) pick = g;
  }
  for (FamilyId g = 0; g < families && !pick; ++g) {
    if (s.stage[g] == SaveState::Stage::kCaptured && !s.deferred[g]) pick = g;
  }
  for (FamilyId g = families; g-- > 0 && !pick;) {
    if (s.stage[g] == SaveState::Stage::kPending) pick = g;
  }
  for (FamilyId g = 0; g < families && !pick; ++g) {
    if (s.stage[g] == SaveState::Stage::kCaptured) pick = g;
  }
  STRATA_CHECK(pick.has_value());
  const FamilyId f = *pick;
  if (s.stage[f] == SaveState::Stage::kPending) {
    s.src.changed().wait(lock, [&] { return !s.src.writing_back(f); });
    // The wait dropped the lock: the training thread may have captured f meanwhile (its
    // release path, Note [Overlapped save]). Capturing it again replaced those pieces,
    // losing their buffers and their NVMe slot pins (the "lost track" of SaveState).
    if (s.stage[f] == SaveState::Stage::kPending) {
      STRATA_ASSIGN_OR_RETURN(const bool captured, capture_family(s, f, /*force=*/true));
      STRATA_CHECK(captured);
    }
  }
  return f;
}

//! Family f is written: frees what its pieces still hold, and captures and launches
//! held-back updates whose copies fit the room freed.
static Status mark_written(SaveState& s, FamilyId f) {
  std::unique_lock lock(s.src.mutex());
  release_pieces(s, s.pieces[f]);
  s.stage[f] = SaveState::Stage::kWritten;
  return capture_held(s);
}

//! A rank's save leaves its families' file and tensor entries for rank 0's manifest
//! (Note [Sharded checkpoint]) and fsyncs the directory.
static Status leave_shard_entries(SaveState& s, std::vector<json>& files_by_family,
                                  std::vector<json>& tensor_entries) {
  for (FamilyId f = 0; f < files_by_family.size(); ++f) {
    if (!s.desc.families[f].owned) continue;
    json e = std::move(files_by_family[f]);
    e["family"] = f;
    s.shard_files.push_back(std::move(e));
    for (TensorId id : s.desc.families[f].tensors)
      s.shard_tensors.push_back({{"id", id}, {"entry", std::move(tensor_entries[id])}});
  }
  return fsync_dir(s.root);
}

//! The save thread: captures and writes every family, then publishes (Note [Overlapped save]).
Status detail::run_save(SaveState& s) {
  const Description& d = s.desc;
  const std::size_t families = s.stage.size();
  std::vector<json> tensor_entries(d.tensors.size());
  std::uint64_t total = 0;
  StripeSink sink(/*start_writeback=*/s.blocking);  // its jobs keep their files open until written
  std::vector<StripedWriter> writers;               // fsynced together once all are written
  std::vector<json> files_by_family(families);
  std::vector<FamilyFile> open(families);
  std::size_t deferred = 0;  // families whose NVMe pieces wait (Note [Save I/O priority])
  ReadAhead ahead(s);        // after `sink` and `writers`: destroyed first, its reads waited for
  std::vector<fs::path> paths(families);
  for (FamilyId f = 0; f < families; ++f) {
    if (d.families[f].owned)  // another rank writes the rest (Note [Sharded checkpoint])
      paths[f] = s.root / family_file(s, f);
  }
  FileCreator creator(std::move(paths));
  for (std::size_t written = 0; written < s.owned;) {
    STRATA_RETURN_IF_ERROR(capture_ahead(s));
    STRATA_ASSIGN_OR_RETURN(const FamilyId f, next_family(s));
    const std::string name = family_file(s, f);
    const FamilyEntry& fam = d.families[f];
    FamilyFile& file = open[f];
    if (!file.w) {
      STRATA_ASSIGN_OR_RETURN(Fd fd, creator.take(f));
      file.w = StripedWriter::adopt(s.root / name, std::move(fd), sink);
      file.entries.resize(fam.tensors.size());
    }
    // An overlapped save appends host copies first, so their room is free for the
    // training thread's captures at once; NVMe pieces cost no room and wait.
    const bool host_only = !s.blocking && !s.deferred[f] && deferred < kDeferredMax;
    STRATA_ASSIGN_OR_RETURN(const bool complete, write_family(s, f, file, host_only, ahead));
    if (!complete) {
      std::unique_lock lock(s.src.mutex());
      s.deferred[f] = true;
      ++deferred;
      STRATA_RETURN_IF_ERROR(capture_held(s));
      continue;
    }
    if (s.deferred[f]) --deferred;
    STRATA_RETURN_IF_ERROR(mark_written(s, f));
    ++written;
    StripedWriter w = std::move(*file.w);
    std::vector<json> entries = std::move(file.entries);
    file = FamilyFile{};
    const std::uint64_t bytes = w.size();
    w.finish();
    total += bytes;
    files_by_family[f] = {{"name", name}, {"bytes", bytes}, {"crc32c", w.crcs()}};
    writers.push_back(std::move(w));
    if (writers.size() == kWritersOpenMax) STRATA_RETURN_IF_ERROR(publish_all(sink, writers));
    for (std::size_t i = 0; i < fam.tensors.size(); ++i) {
      json e = s.tensors_meta[fam.tensors[i]];
      e["states"] = std::move(entries[i]["states"]);
      tensor_entries[fam.tensors[i]] = std::move(e);
    }
  }
  STRATA_RETURN_IF_ERROR(publish_all(sink, writers));
  // Rank 0 publishes the manifest (Note [Sharded checkpoint]).
  if (s.sharded) return leave_shard_entries(s, files_by_family, tensor_entries);
  json files = json::array();
  for (json& f : files_by_family) files.push_back(std::move(f));
  json tensors = json::array();
  // In family order, as a blocking save wrote them (the manifest is the same whatever the capture order).
  for (const FamilyEntry& fam : d.families) {
    for (TensorId id : fam.tensors) tensors.push_back(std::move(tensor_entries[id]));
  }
  return publish_manifest(s, std::move(files), std::move(tensors), total);
}

//! A failed save's temporaries go (Note [Save file creation]): every `.tmp` it or its
//! file creator made; the published checkpoint stays as it was.
void detail::remove_temporaries(const SaveState& s) {
  std::error_code ec;
  for (FamilyId f = 0; f < s.stage.size(); ++f) {
    if (s.desc.families[f].owned) fs::remove(s.root / (family_file(s, f) + ".tmp"), ec);
  }
  if (!s.sharded || s.src.rank() == 0) fs::remove(s.root / (std::string(kManifestName) + ".tmp"), ec);
}

}  // namespace strata::checkpoint
