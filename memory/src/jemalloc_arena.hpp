#pragma once
// RegionArena: a jemalloc arena whose memory comes only from one caller-owned range.
// Internal to memory/; PinnedHostPool uses it for variable-size pinned buffers.

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "strata/common/status.hpp"

namespace strata::memory {

//! Thread-safe (jemalloc's arena locks; the extent map has its own mutex).
class RegionArena {
 public:
  //! Creates the arena over [base, base + bytes); `base` and `bytes` are 2 MiB multiples
  //! and the range outlives the arena. Fails (Internal) when jemalloc refuses.
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

 private:
  struct Hooks;
  RegionArena(std::byte* base, std::size_t bytes);
  void* carve(void* wanted, std::size_t bytes, std::size_t alignment);
  void give_back(void* data, std::size_t bytes);

  std::unique_ptr<Hooks> hooks_;  // jemalloc holds a pointer to it until the arena dies
  std::byte* const base_;
  const std::size_t bytes_;
  unsigned index_ = 0;
  bool created_ = false;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> free_;  // begin -> bytes, coalesced
  std::size_t extent_bytes_ = 0;
};

}  // namespace strata::memory
