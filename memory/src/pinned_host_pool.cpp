#include "strata/memory/pinned_host_pool.hpp"

#include <utility>

#include "host_region.hpp"
#include "jemalloc_arena.hpp"
#include "settings.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::memory {
namespace {

constexpr std::uint64_t kRegionSpanMaxBytes = 1 * kGiB;  // io_uring fixed buffers are <= 1 GiB

}  // namespace

// ---- options ---------------------------------------------------------------------------

Status PinnedHostPoolOptions::set(std::string_view key, std::string_view value) {
  const std::string setting = fmt::format("pinned.{}", key);
  if (key == "budget") {
    STRATA_ASSIGN_OR_RETURN(budget_bytes, parse_bytes(value, setting));
  } else if (key == "slot_size") {
    STRATA_ASSIGN_OR_RETURN(slot_bytes, parse_bytes(value, setting));
  } else if (key == "slot_count") {
    STRATA_ASSIGN_OR_RETURN(std::uint64_t count, detail::parse_count(setting, value));
    slot_count = static_cast<std::size_t>(count);
  } else if (key == "slot_alignment") {
    STRATA_ASSIGN_OR_RETURN(slot_alignment_bytes, parse_bytes(value, setting));
  } else if (key == "arena_size") {
    STRATA_ASSIGN_OR_RETURN(arena_bytes, parse_bytes(value, setting));
  } else if (key == "huge_pages") {
    STRATA_ASSIGN_OR_RETURN(huge_pages, detail::parse_bool(setting, value));
  } else if (key == "pin") {
    STRATA_ASSIGN_OR_RETURN(pin, detail::parse_bool(setting, value));
  } else {
    return invalid_argument(
        "unknown setting pinned.{} (= \"{}\"); known: budget, slot_size, slot_count, slot_alignment, "
        "arena_size, huge_pages, pin",
        key, value);
  }
  return Status::Ok();
}

std::uint64_t PinnedHostPoolOptions::slot_stride_bytes() const {
  if (!is_pow2(slot_alignment_bytes)) return slot_bytes;
  return align_up(slot_bytes, slot_alignment_bytes);
}

std::uint64_t PinnedHostPoolOptions::slab_offset_bytes() const {
  if (!is_pow2(slot_alignment_bytes)) return arena_bytes;
  return align_up(arena_bytes, slot_alignment_bytes);
}

std::size_t PinnedHostPoolOptions::effective_slot_count() const {
  if (slot_count != 0) return slot_count;
  const std::uint64_t stride = slot_stride_bytes();
  if (stride == 0 || slab_offset_bytes() >= budget_bytes) return 0;
  return static_cast<std::size_t>((budget_bytes - slab_offset_bytes()) / stride);
}

Status PinnedHostPoolOptions::validate() const {
  if (budget_bytes == 0) {
    return invalid_argument(
        "pinned.budget = 0: the pinned host pool needs a budget; set e.g. pinned.budget=1GiB");
  }
  const std::uint64_t ram = physical_memory_bytes();
  if (ram != 0 && budget_bytes > ram) {
    return invalid_argument(
        "pinned.budget = {}: larger than this machine's RAM ({}); set pinned.budget to at most {}",
        format_bytes(budget_bytes), format_bytes(ram), format_bytes(ram));
  }
  if (!is_pow2(slot_alignment_bytes) || slot_alignment_bytes < 4096) {
    return invalid_argument(
        "pinned.slot_alignment = {}: must be a power of two of at least 4096 (O_DIRECT); use e.g. 4096 or "
        "2MiB",
        slot_alignment_bytes);
  }
  if (slot_bytes == 0) {
    return invalid_argument(
        "pinned.slot_size = 0: a chunk slot needs a size; set e.g. pinned.slot_size=64MiB");
  }
  if (slot_bytes > budget_bytes) {
    return invalid_argument(
        "pinned.slot_size = {} is larger than the region (pinned.budget = {}); lower pinned.slot_size or "
        "raise "
        "pinned.budget",
        format_bytes(slot_bytes), format_bytes(budget_bytes));
  }
  if (arena_bytes != 0 && (arena_bytes < kArenaMinBytes || arena_bytes % (2 * kMiB) != 0)) {
    return invalid_argument(
        "pinned.arena_size = {}: must be 0 (no arena) or a multiple of 2 MiB of at least {}; use e.g. 64MiB",
        format_bytes(arena_bytes), format_bytes(kArenaMinBytes));
  }
  if (arena_bytes > budget_bytes) {
    return invalid_argument("pinned.arena_size = {} is larger than pinned.budget = {}; lower the arena size",
                            format_bytes(arena_bytes), format_bytes(budget_bytes));
  }
  const std::size_t count = effective_slot_count();
  if (count == 0) {
    return invalid_argument(
        "pinned.budget = {} leaves no room for a {} slot beside the {} arena; raise pinned.budget or lower "
        "pinned.slot_size / pinned.arena_size",
        format_bytes(budget_bytes), format_bytes(slot_bytes), format_bytes(arena_bytes));
  }
  const std::uint64_t stride = slot_stride_bytes();
  if (slab_offset_bytes() > budget_bytes || count > (budget_bytes - slab_offset_bytes()) / stride) {
    return invalid_argument(
        "pinned.slot_count = {} slots of {} (stride {}) plus pinned.arena_size = {} exceed pinned.budget = "
        "{}; "
        "lower pinned.slot_count or raise pinned.budget",
        count, format_bytes(slot_bytes), format_bytes(stride), format_bytes(arena_bytes),
        format_bytes(budget_bytes));
  }
  if (count > UINT32_MAX)
    return invalid_argument("pinned.slot_count = {}: at most {} slots", count, UINT32_MAX);
  return Status::Ok();
}

// ---- buffers ---------------------------------------------------------------------------

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : pool_(std::exchange(other.pool_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      charged_bytes_(std::exchange(other.charged_bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    charged_bytes_ = std::exchange(other.charged_bytes_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  reset();
}

void PinnedBuffer::reset() {
  if (pool_ == nullptr) return;
  pool_->free_buffer(data_, charged_bytes_);
  pool_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
  charged_bytes_ = 0;
}

// ---- pool ------------------------------------------------------------------------------

PinnedHostPool::PinnedHostPool(const PinnedHostPoolOptions& options)
    : options_(options), arena_budget_(options.arena_bytes) {}

PinnedHostPool::~PinnedHostPool() {
  STRATA_CHECK_MSG(arena_budget_.used_bytes() == 0, "a PinnedBuffer outlived its PinnedHostPool");
  arena_.reset();  // destroys the jemalloc arena before the region goes
  slab_.reset();   // checks that every slot came back
  region_.reset();
}

Result<std::unique_ptr<PinnedHostPool>> PinnedHostPool::create(const PinnedHostPoolOptions& options,
                                                               Device* device) {
  STRATA_RETURN_IF_ERROR(options.validate());
  std::unique_ptr<PinnedHostPool> pool(new PinnedHostPool(options));
  const std::size_t count = options.effective_slot_count();
  const std::uint64_t stride = options.slot_stride_bytes();
  // Layout [arena | slab]: the region is mapped 2 MiB-aligned (and slot-aligned), so the
  // arena starts on a 2 MiB page, which jemalloc's first (metadata) extent asks for.
  const std::uint64_t slab_offset = options.slab_offset_bytes();
  const std::uint64_t region_bytes = slab_offset + count * stride;
  const std::size_t alignment = std::max<std::uint64_t>(options.slot_alignment_bytes, 2 * kMiB);
  STRATA_ASSIGN_OR_RETURN(HostRegion region, HostRegion::map(region_bytes, alignment, options.huge_pages,
                                                             options.pin, device, options.bind_memory));
  pool->region_ = std::make_unique<HostRegion>(std::move(region));
  std::byte* base = pool->region_->data();
  pool->slab_ = std::make_unique<SlotSlab>(base + slab_offset, options.slot_bytes, stride, count,
                                           "pinned host slab", "raise pinned.slot_count or pinned.budget");
  if (options.arena_bytes != 0) {
    STRATA_ASSIGN_OR_RETURN(pool->arena_, RegionArena::create(base, options.arena_bytes));
  }
  for (std::uint64_t offset = 0; offset < region_bytes; offset += kRegionSpanMaxBytes) {
    pool->regions_.emplace_back(base + offset, std::min(kRegionSpanMaxBytes, region_bytes - offset));
  }
  STRATA_LOG_INFO("pinned host pool: {} arena + {} slots of {}, {}", format_bytes(options.arena_bytes), count,
                  format_bytes(options.slot_bytes), pinning_mode_name(pool->pinning()));
  return pool;
}

Result<PinnedSlot> PinnedHostPool::acquire_slot() {
  return slab_->acquire<PinnedSlotTag>();
}

Result<PinnedBuffer> PinnedHostPool::allocate(std::size_t bytes, std::size_t alignment_bytes) {
  if (bytes == 0)
    return invalid_argument("pinned host arena: allocation of 0 bytes; ask for at least 1 byte");
  if (!is_pow2(alignment_bytes)) {
    return invalid_argument("pinned host arena: alignment {} is not a power of two; use e.g. 64 or 4096",
                            alignment_bytes);
  }
  if (arena_ == nullptr) {
    return out_of_budget(
        "pinned host arena: pinned.arena_size = 0, so there is no arena for a {} buffer; set "
        "pinned.arena_size (e.g. 64MiB)",
        format_bytes(bytes));
  }
  const std::size_t charged = arena_->size_class(bytes, alignment_bytes);
  if (charged == 0 || !arena_budget_.try_add(charged)) {
    return out_of_budget(
        "pinned host arena: a {} buffer would exceed the arena budget pinned.arena_size = {} ({} in use); "
        "free "
        "buffers or raise pinned.arena_size",
        format_bytes(bytes), format_bytes(arena_budget_.budget_bytes()),
        format_bytes(arena_budget_.used_bytes()));
  }
  void* data = arena_->allocate(bytes, alignment_bytes);
  if (data == nullptr) {
    arena_budget_.sub(charged);
    return out_of_budget(
        "pinned host arena: no free range of the arena's {} fits a {} buffer ({} in use; jemalloc keeps part "
        "for its metadata and fragmentation leaves gaps: {}); free buffers or raise pinned.arena_size",
        format_bytes(arena_budget_.budget_bytes()), format_bytes(bytes),
        format_bytes(arena_budget_.used_bytes()), arena_->describe_free());
  }
  STRATA_CHECK(contains(data, bytes));
  return PinnedBuffer(this, static_cast<std::byte*>(data), bytes, charged);
}

void PinnedHostPool::free_buffer(std::byte* data, std::size_t charged_bytes) {
  arena_->free(data);
  arena_budget_.sub(charged_bytes);
}

PoolStats PinnedHostPool::slab_stats() const {
  return slab_->stats();
}

PoolStats PinnedHostPool::arena_stats() const {
  PoolStats stats;
  stats.budget_bytes = arena_budget_.budget_bytes();
  stats.used_bytes = arena_budget_.used_bytes();
  stats.high_water_bytes = arena_budget_.high_water_bytes();
  return stats;
}

std::size_t PinnedHostPool::slot_bytes() const {
  return slab_->slot_bytes();
}
std::size_t PinnedHostPool::slot_count() const {
  return slab_->slot_count();
}
PinningMode PinnedHostPool::pinning() const {
  return region_->pinning();
}
const std::string& PinnedHostPool::pinning_reason() const {
  return region_->pinning_reason();
}
HugePageMode PinnedHostPool::huge_pages() const {
  return region_->huge_pages();
}
const std::string& PinnedHostPool::huge_pages_reason() const {
  return region_->huge_pages_reason();
}

bool PinnedHostPool::contains(const void* ptr, std::size_t bytes) const {
  const auto begin = reinterpret_cast<std::uintptr_t>(region_->data());
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  const std::size_t size = region_->size_bytes();
  return p >= begin && bytes <= size && p - begin <= size - bytes;
}

std::optional<std::size_t> PinnedHostPool::region_index(const void* ptr) const {
  if (!contains(ptr)) return std::nullopt;
  const auto offset =
      reinterpret_cast<std::uintptr_t>(ptr) - reinterpret_cast<std::uintptr_t>(region_->data());
  return static_cast<std::size_t>(offset / kRegionSpanMaxBytes);
}

}  // namespace strata::memory
