// Checkpoint save: the Checkpointer's save, begin and finish, and the save thread
// that writes each family's file (Note [Overlapped save], Note [Sharded
// checkpoint]). It calls the capture side and the format side through
// checkpoint.hpp, and the source (finalize, waits, the data-parallel agreements).

#include "checkpoint.hpp"

namespace strata::checkpoint {

using namespace detail;

// Note [Save I/O priority]
// An overlapped save must not hold training up, yet an update waits until its
// family is captured, a capture waits for room in the save's buffers (Note
// [Overlapped save]), and the NVMe tier shares the disk with the save. So:
//   - the save thread appends each family's host copies (a param, host-held states)
//     first and frees each as soon as it is appended; a family's pinned NVMe pieces
//     cost no room and wait until no host copy is left to write (at most
//     kDeferredMax files wait so, each holding its descriptor and one part-filled
//     1 MiB stripe). A file is still written front to back, so it is the same file;
//   - an overlapped save's stripes go to the page cache without starting their
//     writeback, and its threads do I/O at class idle (ioprio_set; the writer and
//     fsync threads it starts inherit it), so the fsyncs that write the files out
//     yield the disk to training's NVMe reads and write-backs (mq-deadline and bfq
//     dispatch idle requests after best-effort ones). The dirty pages are the
//     kernel's, not the host budget's: the kernel's dirty limits (vm.dirty_ratio)
//     bound them and throttle the save's writer, not training, when reached;
//   - the save's threads run at the process's CPU priority: at nice 10, on a busy
//     machine, the writer fell behind and updates waited for its room.
// A blocking save keeps its priorities and starts each stripe's
// writeback at once: nothing runs beside it.

Checkpointer::Checkpointer(Source& source) : src_(source), stale_(std::make_unique<FileRemover>()) {}

Checkpointer::~Checkpointer() {
  if (save_ != nullptr && save_->thread.joinable()) save_->thread.join();
}

//! Starts a save (Note [Overlapped save]); `background`: its threads do I/O at idle
//! priority (begin: training runs beside it), not for save(), which waits.
Status Checkpointer::start(std::unique_lock<std::mutex>& lock, const std::string& dir, bool background) {
  const bool sharded = src_.ranks() > 1;
  if (sharded && background) {
    // The same answer on every rank, so no rank waits in a collective for it.
    return failed_precondition(
        "begin_checkpoint({}): this runtime is rank {} of {} (data parallelism); an overlapped save is not "
        "implemented for data-parallel ranks (its agreement would interleave with the step's collectives); "
        "call save_checkpoint on every rank instead (Note [Sharded checkpoint])",
        dir, src_.rank(), src_.ranks());
  }
  auto s = std::make_shared<SaveState>(src_);
  s->stale = stale_.get();
  auto prepare = [&] {
    Status previous = finish(lock);
    if (!previous.ok()) return previous;
    return prepare_save(lock, *s, dir, /*wait_write_backs=*/!background);
  };
  if (!sharded) {
    STRATA_RETURN_IF_ERROR(prepare());
  } else {
    STRATA_RETURN_IF_ERROR(src_.all_ok(lock, prepare(), "save_checkpoint"));
    // Params are written by their owner: they must be rank 0's initial values if
    // no step has run yet (Note [Sharded step]).
    STRATA_RETURN_IF_ERROR(src_.broadcast_initial(lock));
    // One generation for every rank's files: the largest any rank found.
    STRATA_ASSIGN_OR_RETURN(s->generation, src_.max(lock, s->generation));
  }
  s->t0 = std::chrono::steady_clock::now();
  s->sharded = sharded;
  describe_save(*s);
  s->blocking = !background;
  if (sharded) {
    Status assembled = assemble_shards(lock, *s);
    if (!assembled.ok()) {
      for (auto& pieces : s->pieces) release_pieces(*s, pieces);
      return assembled;
    }
  }
  save_ = s;
  s->thread = std::thread([s = s.get(), background] {
    // Its disk writes (the fsyncs that write its page cache out) go after training's
    // (Note [Save I/O priority]); its writer and fsync threads inherit this.
    if (background) {
      Status idle = offload::set_thread_io_priority_idle();
      if (!idle.ok())
        STRATA_LOG_DEBUG("checkpoint: the save thread keeps its I/O priority: {}", idle.to_string());
    }
    Status st = run_save(*s);
    if (!st.ok()) remove_temporaries(*s);
    std::lock_guard guard(s->src.mutex());
    if (!st.ok()) {
      STRATA_LOG_WARN("checkpoint: the save into {} failed (the published checkpoint is untouched): {}",
                      s->root.string(), st.to_string());
      release_all_holds(*s);
    }
    for (auto& pieces : s->pieces) release_pieces(*s, pieces);
    s->status = std::move(st);
    s->done = true;
    s->src.changed().notify_all();
  });
  return Status::Ok();
}

Status Checkpointer::begin(std::unique_lock<std::mutex>& lock, const std::string& dir) {
  return start(lock, dir, /*background=*/true);
}

Result<bool> Checkpointer::in_flight() const {
  if (save_ == nullptr) return false;
  if (!save_->done) return true;
  STRATA_RETURN_IF_ERROR(save_->status);
  return false;
}

void Checkpointer::wait_stale_removed() {
  stale_->wait();
}

Status Checkpointer::save(std::unique_lock<std::mutex>& lock, const std::string& dir) {
  STRATA_RETURN_IF_ERROR(start(lock, dir, /*background=*/false));
  if (src_.ranks() == 1) return finish(lock);
  return publish_shards(lock);
}

//! Note [Sharded checkpoint]: every rank's files are written, fsynced and renamed;
//! the ranks agree, rank 0 publishes the manifest, and a last agreement returns
//! rank 0's outcome on every rank once the manifest is durable.
Status Checkpointer::publish_shards(std::unique_lock<std::mutex>& lock) {
  std::shared_ptr<SaveState> s = save_;
  Status written = finish(lock);
  STRATA_RETURN_IF_ERROR(src_.all_ok(lock, std::move(written), "save_checkpoint (writing the files)"));
  const json mine = {{"files", std::move(s->shard_files)}, {"tensors", std::move(s->shard_tensors)}};
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> all, src_.exchange_text(lock, mine.dump()));
  Status published = Status::Ok();
  if (src_.rank() == 0) {
    const std::size_t families = s->desc.families.size();
    json files = json::array();
    std::vector<json> by_family(families);
    std::vector<json> tensor_entries(s->desc.tensors.size());
    std::uint64_t total = 0;
    try {
      for (const std::string& text : all) {
        const json part = json::parse(text);
        for (const json& f : part.at("files")) {
          const auto family = f.at("family").get<std::size_t>();
          STRATA_CHECK(family < families);
          total += f.at("bytes").get<std::uint64_t>();
          by_family[family] = {{"name", f.at("name")}, {"bytes", f.at("bytes")}, {"crc32c", f.at("crc32c")}};
        }
        for (const json& t : part.at("tensors"))
          tensor_entries.at(t.at("id").get<std::size_t>()) = t.at("entry");
      }
    } catch (const json::exception& e) {
      published = internal_error("save_checkpoint: a rank's file list is malformed: {}", e.what());
    }
    for (FamilyId f = 0; f < families && published.ok(); ++f) {
      if (by_family[f].is_null()) {
        published = internal_error("save_checkpoint: no rank wrote family {} (its owner is rank {})", f,
                                   f % static_cast<FamilyId>(src_.ranks()));
        break;
      }
      files.push_back(std::move(by_family[f]));
    }
    json tensors = json::array();
    for (const FamilyEntry& fam : s->desc.families) {
      for (TensorId id : fam.tensors) tensors.push_back(std::move(tensor_entries[id]));
    }
    if (published.ok()) published = publish_manifest(*s, std::move(files), std::move(tensors), total);
  }
  return src_.all_ok(lock, std::move(published), "save_checkpoint (publishing the manifest on rank 0)");
}

}  // namespace strata::checkpoint
