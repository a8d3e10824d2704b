#pragma once
// PinnedHostPool: the host tier's memory. One region reserved at start (mmap, huge pages
// when available), pinned (cudaHostRegister with the cuda device, else mlock when
// RLIMIT_MEMLOCK allows, else plain; the log says which and why), carved into
//   - a slab of fixed-size slots for chunks (PinnedSlot), and
//   - a jemalloc arena for variable-size buffers (PinnedBuffer), whose extent hooks hand
//     out only pieces of the same region (Note [Extent hooks carve the region]).
// Layout: [ arena: arena_bytes | slab: slot_count x slot stride ]. Both parts are hard
// budgets; the region is exposed as spans of <= 1 GiB for io_uring fixed buffers.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/common/status.hpp"
#include "strata/memory/budget_counter.hpp"
#include "strata/memory/device.hpp"
#include "strata/memory/slot_slab.hpp"

namespace strata::memory {

//! How the region is kept resident.
enum class PinningMode : std::uint8_t { kCudaRegistered, kMlocked, kUnpinned };
//! "cudaHostRegister", "mlock" or "unpinned".
std::string_view pinning_mode_name(PinningMode mode);

//! Which pages back the region.
enum class HugePageMode : std::uint8_t { kHugeTlb, kTransparent, kNone };
//! "hugetlb 2 MiB", "transparent huge pages (madvise)" or "4 KiB pages".
std::string_view huge_page_mode_name(HugePageMode mode);

//! Settings of a PinnedHostPool (`pinned.*`). Plain data; validate() checks them.
struct PinnedHostPoolOptions {
  //! Size of the whole region: slab + arena (pinned.budget). <= the machine's RAM.
  std::uint64_t budget_bytes = 1 * kGiB;
  //! Size of one chunk slot (pinned.slot_size).
  std::uint64_t slot_bytes = 64 * kMiB;
  //! Number of slots (pinned.slot_count); 0 = as many as fit beside the arena.
  std::size_t slot_count = 0;
  //! Alignment of every slot (pinned.slot_alignment): a power of two >= 4096 (O_DIRECT).
  std::uint64_t slot_alignment_bytes = 4096;
  //! Part of the region for variable-size buffers (pinned.arena_size): 0 (no arena) or
  //! at least kArenaMinBytes, a multiple of 2 MiB.
  std::uint64_t arena_bytes = 64 * kMiB;
  //! Try MAP_HUGETLB, then transparent huge pages (pinned.huge_pages).
  bool huge_pages = true;
  //! Pin the region (pinned.pin); false leaves it plain (for tests and comparisons).
  bool pin = true;
  //! Called on the mapped region before any page is touched, e.g. Topology's
  //! memory binder (hwloc_set_area_membind). May be empty. Not a text setting.
  std::function<void(void*, std::size_t)> bind_memory;

  //! jemalloc takes a 2 MiB-aligned block of the arena for its own metadata, so a smaller
  //! arena would hold almost nothing.
  static constexpr std::uint64_t kArenaMinBytes = 4 * kMiB;

  //! Sets one option from text: budget, slot_size, slot_count, slot_alignment,
  //! arena_size (sizes parsed with parse_bytes), huge_pages, pin (true/false).
  //! InvalidArgument naming `pinned.<key>`, the value and the accepted forms.
  Status set(std::string_view key, std::string_view value);
  //! Checks: budget in (0, RAM]; slot size > 0 and <= budget; slot alignment a power of
  //! two >= 4096; arena 0 or a 2 MiB multiple >= 4 MiB; slab offset + slots x stride <= budget;
  //! at least one slot. InvalidArgument naming the setting, the value and what to do.
  Status validate() const;
  //! Slots the options yield (slot_count, or as many as fit when it is 0).
  std::size_t effective_slot_count() const;
  //! Distance between slot starts: slot size rounded up to the slot alignment.
  std::uint64_t slot_stride_bytes() const;
  //! Where the slab starts in the region: the arena size rounded up to the slot alignment.
  std::uint64_t slab_offset_bytes() const;
};

struct PinnedSlotTag {};
//! A chunk slot of a PinnedHostPool. Move-only; returns the slot on destruction.
using PinnedSlot = SlabSlot<PinnedSlotTag>;

class PinnedHostPool;

//! A variable-size buffer from a PinnedHostPool's arena. Move-only; frees on destruction.
//! Must not outlive its pool.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  bool valid() const { return pool_ != nullptr; }
  std::byte* data() const { return data_; }
  //! Bytes asked for (the budget counts jemalloc's size class, which may be larger).
  std::size_t size_bytes() const { return size_bytes_; }
  //! Frees now; the handle becomes empty.
  void reset();

 private:
  friend class PinnedHostPool;
  PinnedBuffer(PinnedHostPool* pool, std::byte* data, std::size_t size_bytes, std::size_t charged_bytes)
      : pool_(pool), data_(data), size_bytes_(size_bytes), charged_bytes_(charged_bytes) {}
  PinnedHostPool* pool_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t size_bytes_ = 0;
  std::size_t charged_bytes_ = 0;
};

class HostRegion;
class RegionArena;

//! The pinned host tier. Create once at start-up; thread-safe (acquire_slot, allocate
//! and the handles' destructors may run on any thread). Every slot and buffer must be
//! released before the pool is destroyed (checked).
class PinnedHostPool {
 public:
  //! Maps and pins the region and sets up the slab and the arena. `device` (may be null)
  //! is asked to register the region (cudaHostRegister); else mlock is tried. Logs the
  //! page kind and the pinning mode with reasons. Fails with the validation error
  //! (InvalidArgument), OutOfMemory when mmap is refused, Internal when jemalloc refuses
  //! to create the arena.
  static Result<std::unique_ptr<PinnedHostPool>> create(const PinnedHostPoolOptions& options,
                                                        Device* device = nullptr);
  ~PinnedHostPool();
  PinnedHostPool(const PinnedHostPool&) = delete;
  PinnedHostPool& operator=(const PinnedHostPool&) = delete;

  //! A free chunk slot (aligned to slot_alignment), or OutOfBudget naming the slab's
  //! budget when all are in use. Never blocks for long.
  Result<PinnedSlot> acquire_slot();
  //! A buffer of `bytes` (> 0) aligned to `alignment_bytes` (a power of two), from the
  //! arena. OutOfBudget naming the arena budget when it would exceed it (or the arena's
  //! range is exhausted by fragmentation); InvalidArgument for 0 bytes or a bad alignment.
  Result<PinnedBuffer> allocate(std::size_t bytes, std::size_t alignment_bytes = 64);

  //! Slab budget (slots x slot size), in use, high-water.
  PoolStats slab_stats() const;
  //! Arena budget (arena_bytes), in use (jemalloc size classes), high-water.
  PoolStats arena_stats() const;

  const PinnedHostPoolOptions& options() const { return options_; }
  std::size_t slot_bytes() const;
  std::size_t slot_count() const;
  PinningMode pinning() const;
  const std::string& pinning_reason() const;
  HugePageMode huge_pages() const;
  const std::string& huge_pages_reason() const;

  //! The whole region as consecutive spans of at most 1 GiB (io_uring fixed buffers).
  const std::vector<std::span<std::byte>>& regions() const { return regions_; }
  //! Whether [ptr, ptr + bytes) lies inside the region.
  bool contains(const void* ptr, std::size_t bytes = 1) const;
  //! Index into regions() of the span holding ptr; nullopt when outside the region.
  std::optional<std::size_t> region_index(const void* ptr) const;

 private:
  friend class PinnedBuffer;
  explicit PinnedHostPool(const PinnedHostPoolOptions& options);
  void free_buffer(std::byte* data, std::size_t charged_bytes);

  PinnedHostPoolOptions options_;
  std::unique_ptr<HostRegion> region_;
  std::unique_ptr<SlotSlab> slab_;
  std::unique_ptr<RegionArena> arena_;
  std::vector<std::span<std::byte>> regions_;
  BudgetCounter arena_budget_;
};

}  // namespace strata::memory
