// RegionArena's first-fit backend, for binaries that cannot carry jemalloc (Note
// [Arena backends] in jemalloc_arena.hpp): each buffer is carved straight from the
// region's free-range map, rounded up to 4 KiB, and given back (coalesced) on free.
// Linked only into such binaries, through the object library strata_first_fit_arena.
#include <mutex>

#include "jemalloc_arena.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::memory {
namespace {
constexpr std::size_t kGranuleBytes = 4096;
}  // namespace

RegionArena::RegionArena(std::byte* base, std::size_t bytes) : base_(base), bytes_(bytes) {
  free_.emplace(reinterpret_cast<std::uintptr_t>(base), bytes);
  reserve_spare_nodes();
}

Result<std::unique_ptr<RegionArena>> RegionArena::create(std::byte* base, std::size_t bytes) {
  STRATA_CHECK(base != nullptr);
  STRATA_CHECK(bytes > 0);
  static std::once_flag logged;
  std::call_once(logged, [] {
    STRATA_LOG_INFO(
        "pinned host arena: first-fit backend (this binary is loaded with dlopen and carries no jemalloc: "
        "Note [Arena backends])");
  });
  return std::unique_ptr<RegionArena>(new RegionArena(base, bytes));
}

RegionArena::~RegionArena() {
  std::lock_guard lock(mutex_);
  STRATA_CHECK_MSG(used_.empty(), "a buffer outlived its first-fit arena");
}

std::size_t RegionArena::size_class(std::size_t bytes, std::size_t alignment) const {
  (void)alignment;
  return bytes == 0 ? 0 : align_up(bytes, kGranuleBytes);
}

void* RegionArena::allocate(std::size_t bytes, std::size_t alignment) {
  const std::size_t carved = size_class(bytes, alignment);
  if (carved == 0) return nullptr;
  void* data = carve(nullptr, carved, std::max(alignment, kGranuleBytes));
  if (data == nullptr) return nullptr;
  std::lock_guard lock(mutex_);
  used_.emplace(reinterpret_cast<std::uintptr_t>(data), carved);
  return data;
}

void RegionArena::free(void* data) {
  std::size_t carved = 0;
  {
    std::lock_guard lock(mutex_);
    auto it = used_.find(reinterpret_cast<std::uintptr_t>(data));
    STRATA_CHECK_MSG(it != used_.end(), "free of a pointer the first-fit arena did not hand out");
    carved = it->second;
    used_.erase(it);
  }
  give_back(data, carved);
}

}  // namespace strata::memory
