// Checkpoint save, before the save thread starts: the checks a rank can fail alone
// (the directory, the generation, a probe file) and the save's description as of
// the call (Note [Overlapped save], Note [Sharded checkpoint]).

#include <fcntl.h>

#include "checkpoint.hpp"

namespace strata::checkpoint::detail {

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
//! after this, only collectives and the save thread. The lock held (the previous
//! save finished).
Status prepare_save(std::unique_lock<std::mutex>& lock, SaveState& s, const std::string& dir,
                    bool wait_write_backs) {
  Source& src = s.src;
  STRATA_ASSIGN_OR_RETURN(s.root, checkpoint_dir(src, dir, "save_checkpoint"));
  const fs::path& root = s.root;
  if (src.leased()) return failed_precondition("save_checkpoint({}) while leases are held", root.string());
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) {
    return errno_status(
        ec.value(), fmt::format("save_checkpoint: creating {} (choose a writable directory)", root.string()));
  }
  STRATA_RETURN_IF_ERROR(src.finalize(lock));
  // An overlapped save captures a family still writing back once it is done (Note
  // [Overlapped save]); no update runs between steps.
  if (wait_write_backs) STRATA_RETURN_IF_ERROR(src.wait_updates(lock));
  STRATA_RETURN_IF_ERROR(src.background_error());
  s.generation = next_generation(root);
  // A file that cannot be created fails here, at once (a read-only directory).
  const fs::path probe = root / fmt::format("family-{}.g{}.bin.tmp", src.rank(), s.generation);
  return offload::open_file(probe, O_WRONLY | O_CREAT | O_TRUNC, 0644, "save_checkpoint: creating",
                            kWritableHint)
      .status();
}

//! Takes the save's metadata as of the call (step counters, groups, the step index)
//! and sets up its per-family progress: another rank's families are done already.
void describe_save(SaveState& s) {
  s.desc = s.src.describe();
  const Description& d = s.desc;
  const std::size_t families = d.families.size();
  s.nvme = s.src.nvme_store();
  s.stage.assign(families, SaveState::Stage::kPending);
  s.held.assign(families, false);
  s.deferred.assign(families, false);
  s.pieces.resize(families);
  for (FamilyId f = 0; f < families; ++f) {
    if (d.families[f].owned) {
      ++s.owned;
    } else {  // another rank's (Note [Sharded checkpoint]): nothing to capture or write here
      s.stage[f] = SaveState::Stage::kWritten;
    }
  }
  s.uncaptured = s.owned;
  for (FamilyId f = 0; f < families; ++f) s.kinds.push_back(family_kinds(d, f));
  s.tensors_meta = json::array();
  for (const TensorEntry& t : d.tensors) {
    s.tensors_meta.push_back({{"name", t.name},
                              {"shape", t.shape},
                              {"frozen", t.frozen},
                              {"steps", t.steps},
                              {"group", t.group},
                              {"file", t.family}});
  }
  for (const GroupEntry& g : d.groups)
    s.groups.push_back({{"group", g.group}, {"lr", g.lr}, {"weight_decay", g.weight_decay}});
  s.step_index = d.step_index;
  s.room = d.host_budget_bytes / kSaveRoomDivisor;
}

}  // namespace strata::checkpoint::detail
