// Checkpoint load: load_checkpoint's check pass (manifest, shapes, every stripe's
// CRC32C, before any state changes) and its apply pass (chunk by chunk through
// host copies), Note [Checkpoint format], Note [Sharded checkpoint]. It calls the
// format side through checkpoint.hpp, Core, and Runtime::Impl (finalize,
// wait_all, with_host_copy, the data-parallel agreement).

#include "checkpoint.hpp"

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

namespace checkpoint_testing {
std::function<void(const std::string&)> after_verify;
std::function<void(const std::string&)> after_host_apply;
}  // namespace checkpoint_testing

namespace {

//! Where a tensor's saved kinds lie: its file, each kind's offset and dtype.
struct Source {
  std::uint32_t file = 0;
  std::uint64_t offset[kStateKindCount] = {};
  DType dtype[kStateKindCount] = {};
  bool has[kStateKindCount] = {};
  std::int64_t steps = 0;
  std::uint32_t group = 0;
};

//! What the check pass finds and the apply pass reads.
struct LoadPlan {
  fs::path root;
  json manifest;
  std::string mpath;
  std::vector<Source> src;
  std::vector<bool> seen;
  std::vector<fs::path> file_paths;
  std::vector<std::uint64_t> file_bytes;
  std::vector<std::pair<std::uint32_t, GroupHyper>> groups;
  std::uint64_t stripe_bytes = 0;
  std::vector<Fd> fds;                // the verified files, read by the apply pass
  std::vector<struct stat> verified;  // as they were when opened, before any read
};

//! An NVMe-homed optimizer state chunk loaded into fresh swap slots while the files
//! are verified; it replaces the chunk's slots only once everything passed (Note
//! [Load in one read]).
struct Shadow {
  FamilyId family = 0;
  StateKind kind = StateKind::kState0;
  std::vector<std::uint32_t> slots;
};

//! Checks one tensor entry of the manifest against this runtime's registered tensor
//! and records where its kinds lie. Throws json::exception on a malformed entry.
Status check_tensor(Core& core, LoadPlan& p, const json& t) {
  const std::string& mpath = p.mpath;
  const auto name = t.at("name").get<std::string>();
  auto it = core.by_name.find(name);
  if (it == core.by_name.end()) {
    return failed_precondition(
        "load_checkpoint: {} holds tensor \"{}\", which this runtime has not registered: it is another "
        "model's checkpoint",
        mpath, name);
  }
  const TensorInfo& info = core.tensors[it->second];
  const auto shape = t.at("shape").get<std::vector<std::int64_t>>();
  if (shape != info.spec.shape) {
    return failed_precondition("load_checkpoint: {}: tensor \"{}\" has shape [{}] there, [{}] here", mpath,
                               name, fmt::join(shape, ", "), fmt::join(info.spec.shape, ", "));
  }
  Source& s = p.src[it->second];
  p.seen[it->second] = true;
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
    STRATA_ASSIGN_OR_RETURN(s.dtype[k], parse_dtype(st.at("dtype").get<std::string>()));
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
  for (FamilyId f = 0; f < core.layout.families.size(); ++f) {
    for (StateKind k : family_kinds(core, f)) {
      if (k == StateKind::kParam || k == StateKind::kMaster) continue;
      for (TensorId id : core.layout.families[f].tensors) {
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

//! Fills `base`, the host image of family f's `k` chunk, from the files: each
//! tensor's bytes (converted when the dtypes differ); a state the checkpoint lacks
//! (a frozen tensor's) is zeros. Padding is not written.
Status fill_chunk(Core& core, const LoadPlan& p, FamilyId f, StateKind k, std::byte* base,
                  std::vector<std::byte>& staging) {
  const FamilyLayout& fam = core.layout.families[f];
  const DType dtype = core.kind_dtype(k);
  const std::uint64_t esize = dtype_bytes(dtype);
  for (const TensorId id : fam.tensors) {
    const TensorSlot& ts = core.layout.slots[id];
    const Source& s = p.src[id];
    // A master the checkpoint lacks (saved with fp32 compute) is its param.
    auto sk = static_cast<std::size_t>(k);
    if (!s.has[sk] && k == StateKind::kMaster) sk = static_cast<std::size_t>(StateKind::kParam);
    // Masters and states: this rank's shard of the tensor (Note [Sharded step]).
    Core::ShardPart part{.first = 0, .count = ts.numel, .at = ts.offset_elems};
    if (is_optim_kind(k)) part = core.shard_part(id);
    if (part.count == 0) continue;
    std::byte* dst = base + part.at * esize;
    if (!s.has[sk]) {  // a frozen tensor's optimizer state
      std::memset(dst, 0, part.count * esize);
      continue;
    }
    const std::uint64_t fsize = dtype_bytes(s.dtype[sk]);
    const std::uint64_t n = part.count * fsize;
    const std::uint64_t at = s.offset[sk] + part.first * fsize;
    if (s.dtype[sk] == dtype) {
      STRATA_RETURN_IF_ERROR(read_all(p.fds[s.file].get(), dst, n, at, p.file_paths[s.file]));
    } else {
      staging.resize(n);
      STRATA_RETURN_IF_ERROR(read_all(p.fds[s.file].get(), staging.data(), n, at, p.file_paths[s.file]));
      convert(staging.data(), s.dtype[sk], dst, dtype, part.count);
    }
  }
  return Status::Ok();
}

//! True when family f's `k` chunk is loaded through a Shadow: an NVMe-homed
//! optimizer state whose value is on NVMe (or not yet written).
bool shadowed(Core& core, FamilyId f, StateKind k) {
  return is_optim_kind(k) && core.on_nvme(f) && core.chunk(f, k).value != ChunkValue::kHost;
}

//! Frees the fresh slots of shadows not committed.
void drop_shadows(Core& core, std::vector<Shadow>& shadows) {
  for (Shadow& sh : shadows) {
    for (std::uint32_t slot : sh.slots) core.nvme->free_slot(slot);
  }
  shadows.clear();
}

//! Writes NVMe chunks' shadows kShadowWindow bytes at a time (Core::mu held; unlocked
//! while the writes run): fills each chunk's host image from the files into a buffer
//! of the host store and writes it to fresh slots.
class ShadowWriter {
 public:
  ShadowWriter(Core& core, std::unique_lock<std::mutex>& lock, std::vector<Shadow>& out)
      : core_(core), lock_(lock), out_(out) {}
  ~ShadowWriter() { (void)wait(); }

  Status add(const LoadPlan& p, FamilyId f, StateKind k) {
    Chunk& c = core_.chunk(f, k);
    if (in_flight_bytes_ + c.bytes > kShadowWindow) STRATA_RETURN_IF_ERROR(wait());
    auto buf = core_.host->allocate(c.bytes);
    if (!buf.ok() && !bufs_.empty()) {  // the host budget is full: finish the writes in flight first
      STRATA_RETURN_IF_ERROR(wait());
      buf = core_.host->allocate(c.bytes);
    }
    STRATA_RETURN_IF_ERROR(buf.status());
    bufs_.emplace_back(*buf, c.bytes);
    in_flight_bytes_ += c.bytes;
    std::memset(*buf, 0, c.bytes);
    STRATA_RETURN_IF_ERROR(fill_chunk(core_, p, f, k, *buf, staging_));
    Shadow sh{.family = f, .kind = k};
    const std::uint64_t piece = core_.nvme->slot_bytes();
    for (std::uint64_t begin = 0; begin < c.bytes; begin += piece) {
      auto slot = core_.nvme->allocate_slot();
      if (!slot.ok()) {
        for (std::uint32_t s : sh.slots) core_.nvme->free_slot(s);
        return slot.status();
      }
      sh.slots.push_back(*slot);
    }
    for (std::size_t i = 0; i < sh.slots.size(); ++i) {
      const std::uint64_t begin = i * piece;
      std::span<const std::byte> part(*buf + begin, std::min<std::uint64_t>(piece, c.bytes - begin));
      {
        std::lock_guard g(mu_);
        ++pending_;
      }
      auto done = [this](Status st) {
        std::lock_guard g(mu_);
        if (!st.ok() && status_.ok()) status_ = std::move(st);
        if (--pending_ == 0) cv_.notify_all();
      };
      Status st = core_.nvme->write(sh.slots[i], part, done);
      if (!st.ok()) done(st);
    }
    out_.push_back(std::move(sh));
    return Status::Ok();
  }

  //! Waits for every write in flight and frees their buffers; the first error.
  Status wait() {
    lock_.unlock();
    {
      std::unique_lock g(mu_);
      cv_.wait(g, [&] { return pending_ == 0; });
    }
    lock_.lock();
    for (auto& [buf, bytes] : bufs_) core_.host->free(buf, bytes);
    bufs_.clear();
    in_flight_bytes_ = 0;
    std::lock_guard g(mu_);
    return status_;
  }

 private:
  //! Host bytes a load fills and writes to NVMe at once.
  static constexpr std::uint64_t kShadowWindow = 64ull << 20;
  Core& core_;
  std::unique_lock<std::mutex>& lock_;
  std::vector<Shadow>& out_;
  std::vector<std::pair<std::byte*, std::uint64_t>> bufs_;
  std::uint64_t in_flight_bytes_ = 0;
  std::vector<std::byte> staging_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t pending_ = 0;
  Status status_ = Status::Ok();
};

//! Every shadowed chunk of this runtime, written to fresh slots (Note [Load in one read]).
Status write_shadows(Core& core, std::unique_lock<std::mutex>& lock, const LoadPlan& p,
                     std::vector<Shadow>& shadows) {
  bool any = false;
  for (FamilyId f = 0; f < core.layout.families.size() && !any; ++f) any = core.on_nvme(f);
  if (!any) return Status::Ok();
  STRATA_RETURN_IF_ERROR(core.ensure_nvme_store());
  ShadowWriter w(core, lock, shadows);
  for (FamilyId f = 0; f < core.layout.families.size(); ++f) {
    for (StateKind k : family_kinds(core, f)) {
      if (shadowed(core, f, k)) STRATA_RETURN_IF_ERROR(w.add(p, f, k));
    }
  }
  return w.wait();
}

//! The shadows replace their chunks' slots (the old ones are freed).
void commit_shadows(Runtime::Impl& m, std::vector<Shadow>& shadows) {
  for (Shadow& sh : shadows) {
    Chunk& c = m.core.chunk(sh.family, sh.kind);
    m.pipeline.drop_read_ahead(sh.family);
    for (std::uint32_t old : c.nvme_slots) m.core.free_nvme_slot(old);
    c.nvme_slots = std::move(sh.slots);
    c.move_value(ChunkValue::kNvme);
  }
  shadows.clear();
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
  STRATA_RETURN_IF_ERROR(m.dp_finish_all_gathers(lock));
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
    STRATA_RETURN_IF_ERROR(m.dp_all_ok(lock, prepare_load(m, lock, p, dir, nullptr), "load_checkpoint"));
  }
  std::vector<std::byte> staging;
  for (FamilyId f = 0; f < m.core.layout.families.size(); ++f) {
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
    if (m.core.groups.size() <= group) m.core.groups.resize(group + 1);
    m.core.groups[group] = h;
  }
  STRATA_LOG_DEBUG("load_checkpoint: {} generation {} loaded", p.root.string(),
                   p.manifest.value("generation", json()).dump());
  return Status::Ok();
}

}  // namespace strata::runtime
