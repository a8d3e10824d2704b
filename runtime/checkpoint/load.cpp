// Checkpoint load: load_checkpoint's check pass (manifest, shapes, every stripe's
// CRC32C, before any state changes) and its apply pass (chunk by chunk through
// host copies), Note [Checkpoint format], Note [Sharded checkpoint]. It calls the
// format side through checkpoint.hpp, and the source (finalize, waits,
// overwrite_chunk, the data-parallel agreement).

#include "load.hpp"

#include "strata/checkpoint/test_hooks.hpp"

namespace strata::checkpoint {

using namespace detail;

// Note [Load in one read]
// A load must never apply part of a checkpoint: on any failure the runtime's params,
// masters, optimizer states, step counters and groups are as before the call. A
// load with one rank:
//   1. opens every file the manifest names (each size checked; its stat kept from
//      before any read, and only these descriptors are read from then on);
//   2. checks every stripe's CRC32C on kIoThreads threads while the calling thread
//      builds each NVMe-homed optimizer state chunk's host image from the same
//      files and writes it to fresh swap slots ("shadows"; 64 MiB of host-store
//      buffers at a time), so the disk reads each byte once (the shadow's reads and
//      the check's overlap; whichever comes second finds the page cache) and the
//      NVMe writes overlap the reads. Nothing the runtime uses changes;
//   3. refuses, freeing the shadows, if a check or a shadow write failed or a file
//      was written since step 1 (its size or mtime moved);
//   4. applies params, masters and host-held states from the files (the page
//      cache) into their chunks, then checks the files again: one written during
//      this step is refused too, but the host-held values may then be partly loaded
//      (the error says so); the shadows are freed and the step counters untouched;
//   5. commits: each shadow replaces its chunk's slots (the old ones are freed).
// Data-parallel ranks (Note [Sharded checkpoint]) check every stripe first, agree,
// then apply every chunk through a host copy, NVMe ones included.

namespace {

//! Checks one tensor entry of the manifest against this runtime's registered tensor
//! and records where its kinds lie. Throws json::exception on a malformed entry.
Status check_tensor(LoadPlan& p, const json& t) {
  const std::string& mpath = p.mpath;
  const auto name = t.at("name").get<std::string>();
  const auto found = p.ids.find(name);
  if (found == p.ids.end()) {
    return failed_precondition(
        "load_checkpoint: {} holds tensor \"{}\", which this runtime has not registered: it is another "
        "model's checkpoint",
        mpath, name);
  }
  const TensorId id = found->second;
  const TensorEntry& info = p.desc.tensors[id];
  const auto shape = t.at("shape").get<std::vector<std::int64_t>>();
  if (shape != info.shape) {
    return failed_precondition("load_checkpoint: {}: tensor \"{}\" has shape [{}] there, [{}] here", mpath,
                               name, fmt::join(shape, ", "), fmt::join(info.shape, ", "));
  }
  Saved& s = p.saved[id];
  p.seen[id] = true;
  s.file = t.at("file").get<std::uint32_t>();
  if (s.file >= p.file_paths.size())
    return corrupt("load_checkpoint: {}: tensor \"{}\" names file {} of {}", mpath, name, s.file,
                   p.file_paths.size());
  s.steps = t.at("steps").get<std::int64_t>();
  s.group = t.at("group").get<std::uint32_t>();
  if (s.steps < 0 || s.group >= 65536)
    return corrupt("load_checkpoint: {}: tensor \"{}\" has a bad step counter or group", mpath, name);
  for (const auto& [kname, st] : t.at("states").items()) {
    const auto kind = kind_from_name(kname);
    if (!kind)
      return corrupt("load_checkpoint: {}: tensor \"{}\" has unknown state \"{}\"", mpath, name, kname);
    const auto k = static_cast<std::size_t>(*kind);
    // Every spelling a manifest was written with parses (Note [DType names] in common/dtype.hpp).
    Result<DType> dtype = parse_dtype(st.at("dtype").get<std::string>());
    if (!dtype.ok())
      return corrupt("load_checkpoint: {}: tensor \"{}\" {}: {}", mpath, name, kname,
                     dtype.status().message());
    s.dtype[k] = *dtype;
    s.offset[k] = st.at("offset").get<std::uint64_t>();
    s.has[k] = true;
    // (q8: codes then block scales, Note [Q8 checkpoints] in q8_states.cpp.)
    if (s.offset[k] + runtime::state_chunk_bytes(s.dtype[k], info.numel) > p.file_bytes[s.file]) {
      return corrupt("load_checkpoint: {}: tensor \"{}\" {} lies past the end of {}", mpath, name, kname,
                     p.file_paths[s.file].string());
    }
  }
  if (!s.has[static_cast<std::size_t>(StateKind::kParam)])
    return corrupt("load_checkpoint: {}: tensor \"{}\" has no param", mpath, name);
  return Status::Ok();
}

//! Every registered tensor is in the checkpoint with every state this runtime keeps
//! (the optimizer's states of trainable tensors).
Status check_complete(const LoadPlan& p) {
  for (TensorId id = 0; id < p.seen.size(); ++id) {
    if (!p.seen[id]) {
      return failed_precondition("load_checkpoint: {} lacks tensor \"{}\": it is another model's checkpoint",
                                 p.mpath, p.desc.tensors[id].name);
    }
  }
  for (FamilyId f = 0; f < p.desc.families.size(); ++f) {
    for (StateKind k : family_kinds(p.desc, f)) {
      if (k == StateKind::kParam || k == StateKind::kMaster) continue;
      for (TensorId id : p.desc.families[f].tensors) {
        if (!p.saved[id].has[static_cast<std::size_t>(k)] && !p.desc.tensors[id].frozen) {
          return failed_precondition("load_checkpoint: {}: tensor \"{}\" has no {} there", p.mpath,
                                     p.desc.tensors[id].name, state_kind_name(k));
        }
      }
    }
  }
  return Status::Ok();
}

//! Checks the manifest against this runtime and opens every file it names (their
//! stripes are checked by prepare_load); changes no state.
Status check_manifest(LoadPlan& p) {
  const std::string& mpath = p.mpath;
  const json& manifest = p.manifest;
  try {
    const auto stripe = manifest.at("stripe_bytes").get<std::uint64_t>();
    if (stripe == 0) return corrupt("load_checkpoint: {} has stripe_bytes 0", mpath);
    const auto state_count = manifest.at("state_count").get<std::uint32_t>();
    if (state_count != p.desc.state_count) {
      return failed_precondition(
          "load_checkpoint: {} holds {} optimizer state(s) per element (optimizer {}), this runtime's "
          "optimizer "
          "{} keeps {}; load it with the optimizer it was saved with",
          mpath, state_count, manifest.value("optimizer", std::string("?")), p.desc.optimizer,
          p.desc.state_count);
    }
    for (const json& f : manifest.at("files")) {
      p.file_paths.push_back(p.root / f.at("name").get<std::string>());
      p.file_bytes.push_back(f.at("bytes").get<std::uint64_t>());
    }
    const json& tensors = manifest.at("tensors");
    if (tensors.size() != p.desc.tensors.size()) {
      return failed_precondition(
          "load_checkpoint: {} holds {} tensors, this runtime has {} registered: it is another model's "
          "checkpoint",
          mpath, tensors.size(), p.desc.tensors.size());
    }
    for (const json& t : tensors) STRATA_RETURN_IF_ERROR(check_tensor(p, t));
    STRATA_RETURN_IF_ERROR(check_complete(p));
    for (const json& g : manifest.value("groups", json::array())) {
      const GroupEntry h{.group = g.at("group").get<std::uint32_t>(),
                         .lr = g.at("lr").get<float>(),
                         .weight_decay = g.at("weight_decay").get<float>()};
      if (h.group >= 65536 || !std::isfinite(h.lr) || h.lr < 0 || !std::isfinite(h.weight_decay) ||
          h.weight_decay < 0)
        return corrupt("load_checkpoint: {}: group {} has a bad id, lr or weight decay", mpath, h.group);
      p.groups.push_back(h);
    }
    p.stripe_bytes = stripe;
    STRATA_RETURN_IF_ERROR(open_files(p.root, manifest.at("files"), &p.fds, &p.verified));
  } catch (const json::exception& e) {
    return corrupt("load_checkpoint: {} is malformed: {}", mpath, e.what());
  }
  return Status::Ok();
}

//! The files read are the ones verified (their descriptors); one written since they
//! were opened (its size or modification time moved) is refused.
Status check_unchanged(const LoadPlan& p) {
  for (std::size_t i = 0; i < p.fds.size(); ++i) {
    struct stat now {};
    if (::fstat(p.fds[i].get(), &now) != 0)
      return errno_status(errno, fmt::format("load_checkpoint: stat of {}", p.file_paths[i].string()));
    if (now.st_size != p.verified[i].st_size || now.st_mtim.tv_sec != p.verified[i].st_mtim.tv_sec ||
        now.st_mtim.tv_nsec != p.verified[i].st_mtim.tv_nsec) {
      return corrupt(
          "load_checkpoint: {} was written while it was being loaded (after its CRC32C check); "
          "nothing was loaded: load it again once the writer is done",
          p.file_paths[i].string());
    }
  }
  return Status::Ok();
}

//! The check pass: everything a rank may find wrong on its own is found before the
//! ranks agree (Note [Sharded checkpoint]): no rank applies anything unless every rank can.
Status prepare_load(Checkpointer& cp, std::unique_lock<std::mutex>& lock, LoadPlan& p, const std::string& dir,
                    std::vector<Shadow>* shadows) {
  Source& src = p.src;
  STRATA_ASSIGN_OR_RETURN(p.root, checkpoint_dir(src, dir, "load_checkpoint"));
  if (src.leased()) return failed_precondition("load_checkpoint({}) while leases are held", p.root.string());
  STRATA_RETURN_IF_ERROR(src.finalize(lock));
  STRATA_RETURN_IF_ERROR(src.wait_updates(lock));
  STRATA_RETURN_IF_ERROR(cp.wait_captured(lock, /*every_family=*/true));
  // Params already gathered must not overwrite what is loaded (Note [Sharded checkpoint]).
  if (src.ranks() > 1) STRATA_RETURN_IF_ERROR(src.finish_gathers(lock));
  p.desc = src.describe();
  for (TensorId id = 0; id < p.desc.tensors.size(); ++id) p.ids.emplace(p.desc.tensors[id].name, id);
  p.saved.resize(p.desc.tensors.size());
  p.seen.assign(p.desc.tensors.size(), false);
  STRATA_ASSIGN_OR_RETURN(p.manifest, read_manifest(p.root));
  p.mpath = (p.root / kManifestName).string();
  STRATA_RETURN_IF_ERROR(check_manifest(p));
  // Every stripe is checked on threads of their own while this thread writes the
  // shadows (Note [Load in one read]); the first error, the check's first.
  Status verified = Status::Ok();
  std::thread check([&] { verified = verify_files(p.root, p.manifest.at("files"), p.stripe_bytes, p.fds); });
  Status written = shadows != nullptr ? write_shadows(lock, p, *shadows) : Status::Ok();
  check.join();
  if (verified.ok() && written.ok() && test_hooks::after_verify) test_hooks::after_verify(p.root.string());
  Status st = !verified.ok() ? verified : !written.ok() ? written : check_unchanged(p);
  if (!st.ok() && shadows != nullptr) drop_shadows(src, *shadows);
  return st;
}

//! Apply: chunk by chunk through a host copy (Source::overwrite_chunk), every
//! tensor of the chunk written (padding stays zero), so an NVMe chunk's old value is
//! not read first. Chunks loaded through shadows are skipped.
Status apply_family(std::unique_lock<std::mutex>& lock, const LoadPlan& p, FamilyId f,
                    std::vector<std::byte>& staging, bool skip_shadowed) {
  for (StateKind k : family_kinds(p.desc, f)) {
    if (skip_shadowed && shadowed(p, f, k)) continue;
    Status read = Status::Ok();
    STRATA_RETURN_IF_ERROR(p.src.overwrite_chunk(
        lock, f, k, [&](std::byte* base) { read = fill_chunk(p, f, k, base, staging); }));
    STRATA_RETURN_IF_ERROR(read);
  }
  return Status::Ok();
}

}  // namespace

Status Checkpointer::load(std::unique_lock<std::mutex>& lock, const std::string& dir) {
  // Everything is checked before any state changes (Note [Checkpoint format]).
  LoadPlan p(src_);
  // One rank loads NVMe-homed states through shadows (Note [Load in one read]).
  std::vector<Shadow> shadows;
  const bool one_rank = src_.ranks() == 1;
  if (one_rank) {
    STRATA_RETURN_IF_ERROR(prepare_load(*this, lock, p, dir, &shadows));
  } else {
    STRATA_RETURN_IF_ERROR(src_.all_ok(lock, prepare_load(*this, lock, p, dir, nullptr), "load_checkpoint"));
  }
  std::vector<std::byte> staging;
  for (FamilyId f = 0; f < p.desc.families.size(); ++f) {
    Status st = apply_family(lock, p, f, staging, one_rank);
    if (!st.ok()) drop_shadows(src_, shadows);
    STRATA_RETURN_IF_ERROR(st);
  }
  if (one_rank) {
    if (test_hooks::after_host_apply) test_hooks::after_host_apply(p.root.string());
    if (Status st = check_unchanged(p); !st.ok()) {
      drop_shadows(src_, shadows);
      return corrupt(
          "{}; it changed while host-held values were being applied, so those may be partly loaded (the "
          "NVMe-held states and the step counters were not): load it again once the writer is done",
          st.message());
    }
    commit_shadows(src_, shadows);
  }
  for (TensorId id = 0; id < p.saved.size(); ++id)
    src_.set_counters(id, p.saved[id].steps, p.saved[id].group);
  for (const GroupEntry& g : p.groups) src_.set_group(g);
  STRATA_LOG_DEBUG("load_checkpoint: {} generation {} loaded", p.root.string(),
                   p.manifest.value("generation", json()).dump());
  return Status::Ok();
}

}  // namespace strata::checkpoint
