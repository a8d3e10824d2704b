// Checkpoint load: a chunk's host image filled from the checkpoint's files, and the
// NVMe shadows that let a load read each byte once (Note [Load in one read], in
// load.cpp).

#include "load.hpp"

namespace strata::runtime::checkpoint_detail {

namespace {

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
    // Within the plan's host bytes (Note [Host room] in planner.cpp counts one chunk's
    // temporary copy): finish the writes in flight first when a buffer more would pass them.
    if (!bufs_.empty() && core_.host->used_bytes() + c.bytes > core_.plan().host_bytes)
      STRATA_RETURN_IF_ERROR(wait());
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
    const std::uint64_t piece = core_.nvme.store().slot_bytes();
    for (std::uint64_t begin = 0; begin < c.bytes; begin += piece) {
      auto slot = core_.nvme.store().allocate_slot();
      if (!slot.ok()) {
        for (std::uint32_t s : sh.slots) core_.nvme.store().free_slot(s);
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
      Status st = core_.nvme.store().write(sh.slots[i], part, done);
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

}  // namespace

//! Fills `base`, the host image of family f's `k` chunk, from the files: each
//! tensor's bytes (converted when the dtypes differ); a state the checkpoint lacks
//! (a frozen tensor's) is zeros. Padding is not written.
Status fill_chunk(Core& core, const LoadPlan& p, FamilyId f, StateKind k, std::byte* base,
                  std::vector<std::byte>& staging) {
  const FamilyLayout& fam = core.layout().families[f];
  const DType dtype = core.kind_dtype(k);
  const std::uint64_t esize = dtype_bytes(dtype);
  for (const TensorId id : fam.tensors) {
    const TensorSlot& ts = core.layout().slots[id];
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
    for (std::uint32_t slot : sh.slots) core.nvme.store().free_slot(slot);
  }
  shadows.clear();
}

//! Every shadowed chunk of this runtime, written to fresh slots (Note [Load in one read]).
Status write_shadows(Core& core, std::unique_lock<std::mutex>& lock, const LoadPlan& p,
                     std::vector<Shadow>& shadows) {
  bool any = false;
  for (FamilyId f = 0; f < core.layout().families.size() && !any; ++f) any = core.on_nvme(f);
  if (!any) return Status::Ok();
  STRATA_RETURN_IF_ERROR(core.ensure_nvme_store());
  ShadowWriter w(core, lock, shadows);
  for (FamilyId f = 0; f < core.layout().families.size(); ++f) {
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
    for (std::uint32_t old : c.nvme_slots) m.core.nvme.free_slot(old);
    c.nvme_slots = std::move(sh.slots);
    c.move_value(ChunkValue::kNvme);
  }
  shadows.clear();
}

}  // namespace strata::runtime::checkpoint_detail
