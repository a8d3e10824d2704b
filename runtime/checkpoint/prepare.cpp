// Checkpoint save, before the save thread starts: the checks a rank can fail alone
// (the directory, the generation, a probe file) and the save's description as of
// the call (Note [Overlapped save], Note [Sharded checkpoint]).

#include <fcntl.h>

#include "checkpoint.hpp"

namespace strata::runtime::checkpoint_detail {

namespace {

//! The generation a new save's files carry (Note [Checkpoint publish]): one past the
//! published manifest's, so its files are never written, and past every generation in
//! the directory too: a manifest this build cannot read (a newer format) still has its
//! files kept.
std::int64_t next_generation(const fs::path& root) {
  std::int64_t generation = 1;
  if (auto prev = read_manifest(root); prev.ok()) generation = prev->value("generation", std::int64_t{0}) + 1;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string fname = entry.path().filename().string();
    const auto g = fname.find(".g");
    // Temporaries are never named by a manifest (and another rank's probe may be one).
    if (!fname.starts_with("family-") || fname.ends_with(".tmp") || g == std::string::npos) continue;
    generation = std::max<std::int64_t>(generation, std::atoll(fname.c_str() + g + 2) + 1);
  }
  return generation;
}

}  // namespace

//! Everything of a save that can fail on one rank alone (Note [Sharded checkpoint]):
//! after this, only collectives and the save thread. Core::mu held.
Status prepare_save(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, CheckpointSave& s,
                    const std::string& dir, bool wait_write_backs) {
  STRATA_RETURN_IF_ERROR(m.checkpoint_finish(lock));
  STRATA_ASSIGN_OR_RETURN(s.root, checkpoint_dir(m.core, dir, "save_checkpoint"));
  const fs::path& root = s.root;
  if (m.leases_out > 0)
    return failed_precondition("save_checkpoint({}) while leases are held", root.string());
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) {
    return errno_status(
        ec.value(), fmt::format("save_checkpoint: creating {} (choose a writable directory)", root.string()));
  }
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  // An overlapped save captures a family still writing back once it is done (Note
  // [Overlapped save]); no update runs between steps.
  if (wait_write_backs) STRATA_RETURN_IF_ERROR(m.pipeline.wait_all(lock));
  STRATA_RETURN_IF_ERROR(m.core.errors.background());
  s.generation = next_generation(root);
  // A file that cannot be created fails here, at once (a read-only directory).
  const fs::path probe = root / fmt::format("family-{}.g{}.bin.tmp", m.core.dp_rank(), s.generation);
  return offload::open_file(probe, O_WRONLY | O_CREAT | O_TRUNC, 0644, "save_checkpoint: creating",
                            kWritableHint)
      .status();
}

//! Takes the save's metadata as of the call (step counters, groups, the step index)
//! and sets up its per-family progress: another rank's families are done already.
void describe_save(Runtime::Impl& m, CheckpointSave& s) {
  const std::size_t families = m.core.layout().families.size();
  s.nvme = m.core.nvme.shared();
  s.stage.assign(families, CheckpointSave::Stage::kPending);
  s.held.assign(families, false);
  s.deferred.assign(families, false);
  s.pieces.resize(families);
  for (FamilyId f = 0; f < families; ++f) {
    if (m.core.owns(f)) {
      ++s.owned;
    } else {  // another rank's (Note [Sharded checkpoint]): nothing to capture or write here
      s.stage[f] = CheckpointSave::Stage::kWritten;
    }
  }
  s.uncaptured = s.owned;
  for (FamilyId f = 0; f < families; ++f) s.kinds.push_back(family_kinds(m.core, f));
  s.tensors_meta = json::array();
  std::vector<FamilyId> family_of(m.core.tensors.size(), 0);
  for (FamilyId f = 0; f < families; ++f) {
    for (TensorId id : m.core.layout().families[f].tensors) family_of[id] = f;
  }
  for (TensorId id = 0; id < m.core.tensors.size(); ++id) {
    const TensorInfo& info = m.core.tensors[id];
    s.tensors_meta.push_back({{"name", info.spec.name},
                              {"shape", info.spec.shape},
                              {"frozen", info.spec.frozen},
                              {"steps", info.updates},
                              {"group", info.group},
                              {"file", family_of[id]}});
  }
  for (std::size_t g = 0; g < m.core.groups().size(); ++g) {
    if (m.core.groups()[g].set) {
      s.groups.push_back(
          {{"group", g}, {"lr", m.core.groups()[g].lr}, {"weight_decay", m.core.groups()[g].weight_decay}});
    }
  }
  s.step_index = static_cast<std::int64_t>(m.tracker.step_index());
  s.room = m.core.host->budget_bytes() / kSaveRoomDivisor;
}

}  // namespace strata::runtime::checkpoint_detail
