// Checkpoint load: a chunk's host image filled from the checkpoint's files, and the
// NVMe shadows that let a load read each byte once (Note [Load in one read], in
// load.cpp).

#include "load.hpp"

namespace strata::checkpoint::detail {

namespace {

//! Writes NVMe chunks' shadows kShadowWindow bytes at a time (the lock held; unlocked
//! while the writes run): fills each chunk's host image from the files into a buffer
//! of the host store and writes it to fresh slots.
class ShadowWriter {
 public:
  ShadowWriter(const LoadPlan& p, std::unique_lock<std::mutex>& lock, std::vector<Shadow>& out)
      : p_(p), host_(p.src.host_store()), nvme_(*p.src.nvme_store()), lock_(lock), out_(out) {}
  ~ShadowWriter() { (void)wait(); }

  Status add(FamilyId f, StateKind k) {
    const std::uint64_t bytes = p_.desc.families[f].chunk_bytes[static_cast<std::size_t>(k)];
    if (in_flight_bytes_ + bytes > kShadowWindow) STRATA_RETURN_IF_ERROR(wait());
    // Within the plan's host bytes (Note [Host room] in planner.cpp counts one chunk's
    // temporary copy): finish the writes in flight first when a buffer more would pass them.
    if (!bufs_.empty() && host_.used_bytes() + bytes > p_.desc.planned_host_bytes)
      STRATA_RETURN_IF_ERROR(wait());
    auto buf = host_.allocate(bytes);
    if (!buf.ok() && !bufs_.empty()) {  // the host budget is full: finish the writes in flight first
      STRATA_RETURN_IF_ERROR(wait());
      buf = host_.allocate(bytes);
    }
    STRATA_RETURN_IF_ERROR(buf.status());
    bufs_.emplace_back(*buf, bytes);
    in_flight_bytes_ += bytes;
    std::memset(*buf, 0, bytes);
    STRATA_RETURN_IF_ERROR(fill_chunk(p_, f, k, *buf, staging_));
    Shadow sh{.family = f, .kind = k};
    const std::uint64_t piece = nvme_.slot_bytes();
    for (std::uint64_t begin = 0; begin < bytes; begin += piece) {
      auto slot = nvme_.allocate_slot();
      if (!slot.ok()) {
        for (std::uint32_t s : sh.slots) nvme_.free_slot(s);
        return slot.status();
      }
      sh.slots.push_back(*slot);
    }
    for (std::size_t i = 0; i < sh.slots.size(); ++i) {
      const std::uint64_t begin = i * piece;
      std::span<const std::byte> part(*buf + begin, std::min<std::uint64_t>(piece, bytes - begin));
      {
        std::lock_guard g(mu_);
        ++pending_;
      }
      auto done = [this](Status st) {
        std::lock_guard g(mu_);
        if (!st.ok() && status_.ok()) status_ = std::move(st);
        if (--pending_ == 0) cv_.notify_all();
      };
      Status st = nvme_.write(sh.slots[i], part, done);
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
    for (auto& [buf, bytes] : bufs_) host_.free(buf, bytes);
    bufs_.clear();
    in_flight_bytes_ = 0;
    std::lock_guard g(mu_);
    return status_;
  }

 private:
  //! Host bytes a load fills and writes to NVMe at once.
  static constexpr std::uint64_t kShadowWindow = 64ull << 20;
  const LoadPlan& p_;
  HostStore& host_;
  NvmeStore& nvme_;
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

}  // namespace

//! Fills `base`, the host image of family f's `k` chunk, from the files: each
//! tensor's bytes (converted when the dtypes differ); a state the checkpoint lacks
//! (a frozen tensor's) is zeros. Padding is not written.
Status fill_chunk(const LoadPlan& p, FamilyId f, StateKind k, std::byte* base,
                  std::vector<std::byte>& staging) {
  const FamilyEntry& fam = p.desc.families[f];
  const DType dtype = p.desc.kind_dtype[static_cast<std::size_t>(k)];
  const std::uint64_t esize = dtype_bytes(dtype);
  for (const TensorId id : fam.tensors) {
    const TensorEntry& ts = p.desc.tensors[id];
    const Saved& s = p.saved[id];
    // A master the checkpoint lacks (saved with fp32 compute) is its param.
    auto sk = static_cast<std::size_t>(k);
    if (!s.has[sk] && k == StateKind::kMaster) sk = static_cast<std::size_t>(StateKind::kParam);
    // Masters and states: this rank's shard of the tensor (Note [Sharded step]).
    ShardPart part{.first = 0, .count = ts.numel, .at = ts.offset_elems};
    if (is_optim_kind(k)) part = ts.shard;
    if (part.count == 0) continue;
    std::byte* dst = base + part.at * esize;
    if (!s.has[sk]) {  // a frozen tensor's optimizer state (q8: its codes; its blocks' scales are never read)
      std::memset(dst, 0, part.count * esize);
      continue;
    }
    if (dtype == DType::kQ8 || s.dtype[sk] == DType::kQ8) {
      STRATA_RETURN_IF_ERROR(fill_q8_tensor(p, f, k, id, base, staging));
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
bool shadowed(const LoadPlan& p, FamilyId f, StateKind k) {
  return is_optim_kind(k) && p.desc.families[f].optim_on_nvme &&
         p.src.place(f, k).where != ChunkPlace::Where::kHost;
}

//! Frees the fresh slots of shadows not committed.
void drop_shadows(Source& src, std::vector<Shadow>& shadows) {
  for (Shadow& sh : shadows) {
    for (std::uint32_t slot : sh.slots) src.nvme_store()->free_slot(slot);
  }
  shadows.clear();
}

//! Every shadowed chunk, written to fresh slots (Note [Load in one read]).
Status write_shadows(std::unique_lock<std::mutex>& lock, const LoadPlan& p, std::vector<Shadow>& shadows) {
  const std::vector<FamilyEntry>& families = p.desc.families;
  const bool any =
      std::any_of(families.begin(), families.end(), [](const FamilyEntry& f) { return f.optim_on_nvme; });
  if (!any) return Status::Ok();
  STRATA_RETURN_IF_ERROR(p.src.open_nvme_store());
  ShadowWriter w(p, lock, shadows);
  for (FamilyId f = 0; f < families.size(); ++f) {
    for (StateKind k : family_kinds(p.desc, f)) {
      if (shadowed(p, f, k)) STRATA_RETURN_IF_ERROR(w.add(f, k));
    }
  }
  return w.wait();
}

//! The shadows replace their chunks' slots (the old ones are freed).
void commit_shadows(Source& src, std::vector<Shadow>& shadows) {
  for (Shadow& sh : shadows) src.replace_slots(sh.family, sh.kind, std::move(sh.slots));
  shadows.clear();
}

}  // namespace strata::checkpoint::detail
