#pragma once
// RegionArena: a jemalloc arena whose memory comes only from one caller-owned range.
// Internal to memory/; PinnedHostPool uses it for variable-size pinned buffers.
//
// Note [Arena backends]
// The default backend (jemalloc_arena.cpp) is a private jemalloc arena whose extent
// hooks carve the region (Note [Private jemalloc]). jemalloc keeps its thread state in
// initial-exec TLS, which a library loaded with dlopen() cannot have (the loader
// refuses: "cannot allocate memory in static TLS block"), so a binary that is
// dlopen()ed — the torch extension strata.torch._C — links the first-fit backend
// (first_fit_arena.cpp, target strata_first_fit_arena) instead: the same class over
// the same free-range map (region_arena.cpp), each buffer carved directly, rounded
// to 4 KiB. Its object files define every backend symbol, so the linker never pulls
// jemalloc_arena.o (or jemalloc) into that binary. The log says which backend runs.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strata/common/status.hpp"

namespace strata::memory {

//! Thread-safe (jemalloc's arena locks; the extent map has its own mutex).
class RegionArena {
 public:
  //! Creates the arena over [base, base + bytes); `base` and `bytes` are 2 MiB multiples
  //! and the range outlives the arena. Fails (Internal) when jemalloc refuses. Logs
  //! the backend once per process.
  static Result<std::unique_ptr<RegionArena>> create(std::byte* base, std::size_t bytes);
  //! Destroys the arena; every allocation must have been freed (checked).
  ~RegionArena();
  RegionArena(const RegionArena&) = delete;
  RegionArena& operator=(const RegionArena&) = delete;

  //! The size jemalloc will really use for (bytes, alignment): what the budget counts.
  std::size_t size_class(std::size_t bytes, std::size_t alignment) const;
  //! mallocx from this arena only (no thread cache); nullptr when the range is exhausted.
  void* allocate(std::size_t bytes, std::size_t alignment);
  //! dallocx of a pointer from allocate().
  void free(void* data);
  //! The arena's jemalloc index.
  unsigned index() const { return index_; }
  //! Bytes of the range jemalloc holds now (extents, including its metadata).
  std::size_t extent_bytes() const;
  //! One line for errors: the region's free ranges (count, largest, total) and the
  //! bytes the backend holds, so a refusal says whether fragmentation or holding caused it.
  std::string describe_free() const;

 private:
  struct Hooks;
  RegionArena(std::byte* base, std::size_t bytes);
  void* carve(void* wanted, std::size_t bytes, std::size_t alignment);
  void give_back(void* data, std::size_t bytes);

  Hooks* hooks_ = nullptr;  // jemalloc backend: owned; jemalloc holds a pointer to it until the arena dies
  std::byte* const base_;
  const std::size_t bytes_;
  unsigned index_ = 0;
  bool created_ = false;
  mutable std::mutex mutex_;
  using FreeMap = std::map<std::uintptr_t, std::size_t>;
  FreeMap free_;  // begin -> bytes, coalesced
  // Nodes of free_ kept for reuse: a steady carve/give_back cycle allocates
  // nothing (Note [Allocation-free hot paths] in runtime/src/leases.cpp). The
  // constructor makes kSpareFreeRanges of them, so that only a region split
  // into more free ranges than that ever allocates one (the count of ranges
  // varies with the order of frees, so a high water reached by warm-up steps
  // is not one a steady step never passes).
  static constexpr std::size_t kSpareFreeRanges = 64;
  std::vector<FreeMap::node_type> spare_nodes_;
  void reserve_spare_nodes();  // constructors

  void insert_free(std::uintptr_t begin, std::size_t bytes);  // mutex_ held
  void erase_free(FreeMap::iterator it);                      // mutex_ held
  std::size_t extent_bytes_ = 0;
  std::map<std::uintptr_t, std::size_t> used_;  // first-fit backend: buffer begin -> bytes carved
};

}  // namespace strata::memory
