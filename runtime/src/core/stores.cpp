// The runtime's host and NVMe tiers over memory::PinnedHostPool and offload::SwapStore.
#include "strata/runtime/stores.hpp"

#include <algorithm>
#include <limits>
#include <mutex>
#include <unordered_map>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/memory/pinned_host_pool.hpp"
#include "strata/offload/io_engine.hpp"
#include "strata/offload/swap_store.hpp"

namespace strata::runtime {
namespace {

// Note [Host store arena]
// Chunks of different kinds have different sizes (a bf16 param chunk is half an
// fp32 master chunk), so the runtime takes all host memory from the pinned
// pool's jemalloc arena rather than its fixed-size slab (a one-slot slab of one
// page is the smallest the pool allows). The host budget is enforced here, on
// the bytes the runtime asks for, because that is what the planner counts;
// the region is made larger than the budget by what jemalloc needs on top
// (its size classes round a large request up by at most 25%, and it keeps a
// 2 MiB block of metadata), so the budget, not fragmentation, is the limit
// (jemalloc asks for exact extents and frees them at once: Note [Exact extents]
// in memory/src/jemalloc_arena.cpp).
class PinnedHostStore final : public HostStore {
 public:
  PinnedHostStore(std::unique_ptr<memory::PinnedHostPool> pool, std::uint64_t budget_bytes)
      : pool_(std::move(pool)), budget_(budget_bytes) {}
  ~PinnedHostStore() override {
    std::lock_guard lock(mu_);
    buffers_.clear();
    spare_nodes_.clear();
  }

  Result<std::byte*> allocate(std::uint64_t bytes) override {
    std::lock_guard lock(mu_);
    if (used_ + bytes > budget_) {
      return out_of_budget("host_budget {} cannot take {} more ({} in use); raise host_budget",
                           format_bytes(budget_), format_bytes(bytes), format_bytes(used_));
    }
    auto buffer = pool_->allocate(bytes, 4096);
    if (!buffer.ok()) {
      Status s = buffer.status();
      s.with_context(fmt::format("host tier: {} for a chunk ({} of host_budget {} in use)",
                                 format_bytes(bytes), format_bytes(used_), format_bytes(budget_)));
      return s;
    }
    std::byte* data = buffer->data();
    if (spare_nodes_.empty()) {
      buffers_.emplace(data, std::move(buffer).value());
    } else {  // a node of a freed buffer: no allocation (Note [Allocation-free hot paths])
      Buffers::node_type node = std::move(spare_nodes_.back());
      spare_nodes_.pop_back();
      node.key() = data;
      node.mapped() = std::move(buffer).value();
      buffers_.insert(std::move(node));
    }
    used_ += bytes;
    high_water_ = std::max(high_water_, used_);
    return data;
  }
  void free(std::byte* data, std::uint64_t bytes) override {
    std::lock_guard lock(mu_);
    auto it = buffers_.find(data);
    if (it == buffers_.end()) return;
    Buffers::node_type node = buffers_.extract(it);
    node.mapped() = memory::PinnedBuffer{};  // frees the memory; the node is kept for reuse
    spare_nodes_.push_back(std::move(node));
    used_ -= bytes;
  }
  std::uint64_t used_bytes() const override {
    std::lock_guard lock(mu_);
    return used_;
  }
  std::uint64_t high_water_bytes() const override {
    std::lock_guard lock(mu_);
    return high_water_;
  }
  std::uint64_t budget_bytes() const override { return budget_; }
  std::vector<std::span<std::byte>> regions() const override { return pool_->regions(); }
  std::string describe() const override {
    return fmt::format("pinned host pool {} ({}: {})", format_bytes(pool_->options().budget_bytes),
                       memory::pinning_mode_name(pool_->pinning()), pool_->pinning_reason());
  }

 private:
  std::unique_ptr<memory::PinnedHostPool> pool_;
  const std::uint64_t budget_;
  mutable std::mutex mu_;
  using Buffers = std::unordered_map<std::byte*, memory::PinnedBuffer>;
  Buffers buffers_;
  std::vector<Buffers::node_type> spare_nodes_;  //!< grows only past the high water of buffers
  std::uint64_t used_ = 0;
  std::uint64_t high_water_ = 0;
};

class SwapNvmeStore final : public NvmeStore {
 public:
  SwapNvmeStore(std::unique_ptr<offload::IoEngine> engine, std::unique_ptr<offload::SwapStore> store)
      : engine_(std::move(engine)), store_(std::move(store)) {}
  ~SwapNvmeStore() override {
    engine_->shutdown(offload::ShutdownMode::kDrain);
    store_.reset();
  }
  std::uint64_t slot_bytes() const override { return store_->slot_bytes(); }
  Result<std::uint32_t> allocate_slot() override {
    auto slot = store_->allocate();
    if (!slot.ok()) {
      Status s = slot.status();
      s.with_context(
          fmt::format("NVMe tier: every one of its {} slots of {} is in use; raise the NVMe budget",
                      store_->slots(), format_bytes(store_->slot_bytes())));
      return s;
    }
    return *slot;
  }
  void free_slot(std::uint32_t slot) override { store_->release(slot); }
  Status write(std::uint32_t slot, std::span<const std::byte> data, IoDone done) override {
    return store_->write_async(slot, slot, data, std::move(done));
  }
  Status read(std::uint32_t slot, std::span<std::byte> data, IoDone done) override {
    return store_->read_async(slot, slot, data, std::move(done));
  }
  std::uint64_t used_bytes() const override {
    return std::uint64_t{store_->slots() - store_->slots_free()} * store_->slot_bytes();
  }
  std::uint64_t io_records() const override { return store_->counters().slot_op_records; }
  std::string describe() const override {
    std::string files;
    for (const auto& f : store_->files()) files += (files.empty() ? "" : ", ") + f.string();
    return fmt::format("{} slots of {} on {} ({} I/O, engine {})", store_->slots(),
                       format_bytes(store_->slot_bytes()), files,
                       store_->direct_io() ? "O_DIRECT" : "buffered", engine_->name());
  }

 private:
  std::unique_ptr<offload::IoEngine> engine_;
  std::unique_ptr<offload::SwapStore> store_;
};

}  // namespace

namespace {
constexpr std::uint64_t kHostStoreSlotBytes = 4096;  // the smallest slab the pool allows; unused

// Note [Host store arena]: room for jemalloc's rounding and metadata.
std::uint64_t host_store_arena_bytes(std::uint64_t budget_bytes) {
  return align_up(budget_bytes + budget_bytes / 4 + 8 * kMiB, 2 * kMiB);
}
}  // namespace

std::uint64_t host_store_region_bytes(std::uint64_t budget_bytes) {
  return host_store_arena_bytes(budget_bytes) + kHostStoreSlotBytes;
}

std::uint64_t largest_host_budget(std::uint64_t ram_bytes) {
  // region(b) is about 5/4 b + 8 MiB, rounded up to 2 MiB: start near the inverse, step to the
  // largest whole MiB that fits.
  const std::uint64_t fixed = 10 * kMiB + kHostStoreSlotBytes;
  if (ram_bytes <= fixed) return 0;
  std::uint64_t b = (ram_bytes - fixed) / 5 * 4 / kMiB * kMiB;
  while (host_store_region_bytes(b + kMiB) <= ram_bytes) b += kMiB;
  while (b > 0 && host_store_region_bytes(b) > ram_bytes) b -= kMiB;
  return b;
}

Result<std::unique_ptr<HostStore>> make_host_store(std::uint64_t budget_bytes, memory::Device* device) {
  // Said in the user's terms (budgets.host), not the pool's (pinned.budget): the region is
  // larger than the budget (Note [Host store arena]), so the limit is below the RAM.
  const std::uint64_t ram = memory::physical_memory_bytes();
  if (ram != 0 && host_store_region_bytes(budget_bytes) > ram) {
    return invalid_argument(
        "budgets.host = {}: the host tier's pinned region would be {} (the budget, a quarter more for the "
        "allocator's rounding and 8 MiB; Note [Host store arena]), larger than this machine's RAM ({}); set "
        "budgets.host to at most {}",
        format_bytes(budget_bytes), format_bytes(host_store_region_bytes(budget_bytes)), format_bytes(ram),
        format_bytes(largest_host_budget(ram)));
  }
  memory::PinnedHostPoolOptions o;
  o.arena_bytes = host_store_arena_bytes(budget_bytes);
  o.slot_bytes = kHostStoreSlotBytes;
  o.slot_count = 1;
  o.budget_bytes = host_store_region_bytes(budget_bytes);
  auto pool = memory::PinnedHostPool::create(o, device);
  if (!pool.ok()) {
    Status s = pool.status();
    s.with_context(fmt::format("creating the host tier ({})", format_bytes(budget_bytes)));
    return s;
  }
  return std::unique_ptr<HostStore>(new PinnedHostStore(std::move(pool).value(), budget_bytes));
}

Result<std::unique_ptr<NvmeStore>> make_nvme_store(const NvmeStoreOptions& options) {
  if (options.dirs.empty()) return invalid_argument("NVMe tier: no directories (set nvme_dirs)");
  if (options.slot_bytes == 0 || options.slot_bytes % 4096 != 0) {
    return invalid_argument("NVMe tier: slot size {} must be a positive multiple of 4096",
                            options.slot_bytes);
  }
  offload::IoEngineOptions eo;
  eo.kind = options.engine == "posix"   ? offload::EngineKind::kPosix
            : options.engine == "uring" ? offload::EngineKind::kUring
                                        : offload::EngineKind::kAuto;
  eo.fixed_buffer_regions = options.fixed_buffers;
  if (options.io_result_filter) {
    eo.result_filter = [filter = options.io_result_filter](const offload::IoSite& site, std::int64_t result) {
      return filter(site.op == offload::IoOp::kWrite, site.offset_bytes, result);
    };
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::IoEngine> engine, offload::make_io_engine(std::move(eo)));
  offload::SwapStoreOptions so;
  for (const auto& d : options.dirs) so.dirs.emplace_back(d);
  so.slot_bytes = options.slot_bytes;
  // The budget is a cap (Note [Growing swap files]): clamped to what a slot id holds, never allocated up
  // front.
  so.slots = static_cast<std::uint32_t>(std::clamp<std::uint64_t>(
      options.capacity_bytes / options.slot_bytes, 1, std::numeric_limits<std::uint32_t>::max()));
  so.initial_slots = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(so.slots, div_ceil(options.initial_bytes, options.slot_bytes)));
  auto store = offload::SwapStore::create(*engine, so);
  if (!store.ok()) {
    Status s = store.status();
    s.with_context("creating the NVMe tier");
    return s;
  }
  return std::unique_ptr<NvmeStore>(new SwapNvmeStore(std::move(engine), std::move(store).value()));
}

}  // namespace strata::runtime
