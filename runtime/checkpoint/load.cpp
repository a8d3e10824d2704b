// Checkpoint load: load_checkpoint's check pass (manifest, shapes, every stripe's
// CRC32C, before any state changes) and its apply pass (chunk by chunk through
// host copies), Note [Checkpoint format], Note [Sharded checkpoint]. It calls the
// format side through checkpoint.hpp, Core, and Runtime::Impl (finalize,
// wait_all, with_host_copy, the data-parallel agreement).

#include "load.hpp"

#include "test_hooks.hpp"

namespace strata::runtime {

using namespace checkpoint_detail;

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
Status check_tensor(Core& core, LoadPlan& p, const json& t) {
  const std::string& mpath = p.mpath;
  const auto name = t.at("name").get<std::string>();
  const std::optional<TensorId> id = core.tensors.find(name);
  if (!id) {
    return failed_precondition(
        "load_checkpoint: {} holds tensor \"{}\", which this runtime has not registered: it is another "
        "model's checkpoint",
        mpath, name);
  }
  const TensorInfo& info = core.tensors[*id];
  const auto shape = t.at("shape").get<std::vector<std::int64_t>>();
  if (shape != info.spec.shape) {
    return failed_precondition("load_checkpoint: {}: tensor \"{}\" has shape [{}] there, [{}] here", mpath,
                               name, fmt::join(shape, ", "), fmt::join(info.spec.shape, ", "));
  }
  Source& s = p.src[*id];
  p.seen[*id] = true;
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
    if (s.offset[k] + info.numel * dtype_bytes(s.dtype[k]) > p.file_bytes[s.file]) {
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
Status check_complete(Core& core, const LoadPlan& p) {
  for (TensorId id = 0; id < p.seen.size(); ++id) {
    if (!p.seen[id]) {
      return failed_precondition("load_checkpoint: {} lacks tensor \"{}\": it is another model's checkpoint",
                                 p.mpath, core.tensors[id].spec.name);
    }
  }
  for (FamilyId f = 0; f < core.layout().families.size(); ++f) {
    for (StateKind k : family_kinds(core, f)) {
      if (k == StateKind::kParam || k == StateKind::kMaster) continue;
      for (TensorId id : core.layout().families[f].tensors) {
        if (!p.src[id].has[static_cast<std::size_t>(k)] && !core.tensors[id].spec.frozen) {
          return failed_precondition("load_checkpoint: {}: tensor \"{}\" has no {} there", p.mpath,
                                     core.tensors[id].spec.name, state_kind_name(k));
        }
      }
    }
  }
  return Status::Ok();
}

//! Checks the manifest against this runtime and opens every file it names (their
//! stripes are checked by prepare_load); changes no state.
Status check_manifest(Core& core, LoadPlan& p) {
  const std::string& mpath = p.mpath;
  const json& manifest = p.manifest;
  try {
    const auto stripe = manifest.at("stripe_bytes").get<std::uint64_t>();
    if (stripe == 0) return corrupt("load_checkpoint: {} has stripe_bytes 0", mpath);
    const auto state_count = manifest.at("state_count").get<std::uint32_t>();
    if (state_count != core.state_count) {
      return failed_precondition(
          "load_checkpoint: {} holds {} optimizer state(s) per element (optimizer {}), this runtime's "
          "optimizer "
          "{} keeps {}; load it with the optimizer it was saved with",
          mpath, state_count, manifest.value("optimizer", std::string("?")),
          kernels::optimizer_name(core.opt.hyper.optimizer), core.state_count);
    }
    for (const json& f : manifest.at("files")) {
      p.file_paths.push_back(p.root / f.at("name").get<std::string>());
      p.file_bytes.push_back(f.at("bytes").get<std::uint64_t>());
    }
    const json& tensors = manifest.at("tensors");
    if (tensors.size() != core.tensors.size()) {
      return failed_precondition(
          "load_checkpoint: {} holds {} tensors, this runtime has {} registered: it is another model's "
          "checkpoint",
          mpath, tensors.size(), core.tensors.size());
    }
    for (const json& t : tensors) STRATA_RETURN_IF_ERROR(check_tensor(core, p, t));
    STRATA_RETURN_IF_ERROR(check_complete(core, p));
    for (const json& g : manifest.value("groups", json::array())) {
      const auto group = g.at("group").get<std::uint32_t>();
      const GroupHyper h{
          .set = true, .lr = g.at("lr").get<float>(), .weight_decay = g.at("weight_decay").get<float>()};
      if (group >= 65536 || !std::isfinite(h.lr) || h.lr < 0 || !std::isfinite(h.weight_decay) ||
          h.weight_decay < 0)
        return corrupt("load_checkpoint: {}: group {} has a bad id, lr or weight decay", mpath, group);
      p.groups.emplace_back(group, h);
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
Status prepare_load(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, LoadPlan& p, const std::string& dir,
                    std::vector<Shadow>* shadows) {
  STRATA_ASSIGN_OR_RETURN(p.root, checkpoint_dir(m.core, dir, "load_checkpoint"));
  if (m.leases_out > 0)
    return failed_precondition("load_checkpoint({}) while leases are held", p.root.string());
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  STRATA_RETURN_IF_ERROR(m.pipeline.wait_all(lock));
  STRATA_RETURN_IF_ERROR(m.checkpoint_wait_captured(lock, /*every_family=*/true));
  // Params already gathered must not overwrite what is loaded (Note [Sharded checkpoint]).
  STRATA_RETURN_IF_ERROR(m.dp.finish_all_gathers(lock));
  STRATA_ASSIGN_OR_RETURN(p.manifest, read_manifest(p.root));
  p.mpath = (p.root / kManifestName).string();
  STRATA_RETURN_IF_ERROR(check_manifest(m.core, p));
  // Every stripe is checked on threads of their own while this thread writes the
  // shadows (Note [Load in one read]); the first error, the check's first.
  Status verified = Status::Ok();
  std::thread check([&] { verified = verify_files(p.root, p.manifest.at("files"), p.stripe_bytes, p.fds); });
  Status written = shadows != nullptr ? write_shadows(m.core, lock, p, *shadows) : Status::Ok();
  check.join();
  if (verified.ok() && written.ok() && checkpoint_testing::after_verify)
    checkpoint_testing::after_verify(p.root.string());
  Status st = !verified.ok() ? verified : !written.ok() ? written : check_unchanged(p);
  if (!st.ok() && shadows != nullptr) drop_shadows(m.core, *shadows);
  return st;
}

//! Apply: chunk by chunk through a host copy (Runtime::Impl::with_host_copy), every
//! tensor of the chunk written (padding stays zero), so an NVMe chunk's old value is
//! not read first. Chunks loaded through shadows are skipped.
Status apply_family(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, const LoadPlan& p, FamilyId f,
                    std::vector<std::byte>& staging, bool skip_shadowed) {
  for (StateKind k : family_kinds(m.core, f)) {
    if (skip_shadowed && shadowed(m.core, f, k)) continue;
    Status read = Status::Ok();
    STRATA_RETURN_IF_ERROR(m.with_host_copy(
        lock, m.core.chunk(f, k), true,
        [&](std::byte* base) { read = fill_chunk(m.core, p, f, k, base, staging); },
        /*whole=*/true));
    STRATA_RETURN_IF_ERROR(read);
  }
  return Status::Ok();
}

}  // namespace

Status Runtime::load_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core.mu);
  InvariantCheck check(m, &lock);
  // Everything is checked before any state changes (Note [Checkpoint format]).
  LoadPlan p;
  p.src.resize(m.core.tensors.size());
  p.seen.assign(m.core.tensors.size(), false);
  // One rank loads NVMe-homed states through shadows (Note [Load in one read]).
  std::vector<Shadow> shadows;
  const bool one_rank = m.core.dp_ranks() == 1;
  if (one_rank) {
    STRATA_RETURN_IF_ERROR(prepare_load(m, lock, p, dir, &shadows));
  } else {
    STRATA_RETURN_IF_ERROR(m.dp.all_ok(lock, prepare_load(m, lock, p, dir, nullptr), "load_checkpoint"));
  }
  std::vector<std::byte> staging;
  for (FamilyId f = 0; f < m.core.layout().families.size(); ++f) {
    Status st = apply_family(m, lock, p, f, staging, one_rank);
    if (!st.ok()) drop_shadows(m.core, shadows);
    STRATA_RETURN_IF_ERROR(st);
  }
  if (one_rank) {
    if (checkpoint_testing::after_host_apply) checkpoint_testing::after_host_apply(p.root.string());
    if (Status st = check_unchanged(p); !st.ok()) {
      drop_shadows(m.core, shadows);
      return corrupt(
          "{}; it changed while host-held values were being applied, so those may be partly loaded (the "
          "NVMe-held states and the step counters were not): load it again once the writer is done",
          st.message());
    }
    commit_shadows(m, shadows);
  }
  for (TensorId id = 0; id < p.src.size(); ++id) {
    m.core.tensors[id].updates = p.src[id].steps;
    m.core.tensors[id].group = p.src[id].group;
  }
  for (const auto& [group, h] : p.groups) {
    m.core.set_group(group, h);
  }
  STRATA_LOG_DEBUG("load_checkpoint: {} generation {} loaded", p.root.string(),
                   p.manifest.value("generation", json()).dump());
  return Status::Ok();
}

}  // namespace strata::runtime
