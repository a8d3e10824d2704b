// RegionArena's map of the region's free ranges, shared by both backends (Note
// [Arena backends] in jemalloc_arena.hpp): jemalloc's extent hooks carve from it,
// and the first-fit backend carves buffers from it directly.
#include <iterator>

#include "jemalloc_arena.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

namespace strata::memory {

std::size_t RegionArena::extent_bytes() const {
  std::lock_guard lock(mutex_);
  return extent_bytes_;
}

namespace {
constexpr std::size_t kRangesListedMax = 8;  // an error message stays one readable line
}  // namespace

std::string RegionArena::describe_free() const {
  std::lock_guard lock(mutex_);
  std::size_t largest = 0, total = 0;
  for (const auto& [begin, bytes] : free_) {
    largest = std::max(largest, bytes);
    total += bytes;
  }
  std::string ranges;
  std::size_t listed = 0;
  for (const auto& [begin, bytes] : free_) {
    if (listed++ == kRangesListedMax) {
      ranges += ", ...";
      break;
    }
    if (!ranges.empty()) ranges += ", ";
    ranges += fmt::format("+{}:{}", format_bytes(begin - reinterpret_cast<std::uintptr_t>(base_)),
                          format_bytes(bytes));
  }
  return fmt::format("{} free in {} ranges, largest {}; the allocator holds {} [{}]", format_bytes(total),
                     free_.size(), format_bytes(largest), format_bytes(extent_bytes_), ranges);
}

void RegionArena::reserve_spare_nodes() {
  spare_nodes_.reserve(kSpareFreeRanges);
  FreeMap made;
  for (std::size_t i = 0; i < kSpareFreeRanges; ++i)
    spare_nodes_.push_back(made.extract(made.emplace(i, 0).first));
}

void RegionArena::insert_free(std::uintptr_t begin, std::size_t bytes) {
  if (spare_nodes_.empty()) {
    free_.emplace(begin, bytes);
    return;
  }
  FreeMap::node_type node = std::move(spare_nodes_.back());
  spare_nodes_.pop_back();
  node.key() = begin;
  node.mapped() = bytes;
  free_.insert(std::move(node));
}

void RegionArena::erase_free(FreeMap::iterator it) {
  spare_nodes_.push_back(free_.extract(it));
}

void* RegionArena::carve(void* wanted, std::size_t bytes, std::size_t alignment) {
  if (alignment == 0) alignment = 1;
  std::lock_guard lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const std::uintptr_t begin = it->first;
    const std::uintptr_t end = begin + it->second;
    const std::uintptr_t take =
        wanted != nullptr ? reinterpret_cast<std::uintptr_t>(wanted) : align_up(begin, alignment);
    if (take < begin || take + bytes > end || take + bytes < take) continue;
    erase_free(it);
    if (take > begin) insert_free(begin, take - begin);
    if (take + bytes < end) insert_free(take + bytes, end - take - bytes);
    extent_bytes_ += bytes;
    return reinterpret_cast<void*>(take);
  }
  return nullptr;
}

void RegionArena::give_back(void* data, std::size_t bytes) {
  std::uintptr_t begin = reinterpret_cast<std::uintptr_t>(data);
  STRATA_CHECK(begin >= reinterpret_cast<std::uintptr_t>(base_));
  STRATA_CHECK(begin + bytes <= reinterpret_cast<std::uintptr_t>(base_) + bytes_);
  std::lock_guard lock(mutex_);
  extent_bytes_ -= bytes;
  auto next = free_.lower_bound(begin);
  if (next != free_.end() && begin + bytes == next->first) {  // merge with the range after
    bytes += next->second;
    auto after = std::next(next);
    erase_free(next);
    next = after;
  }
  if (next != free_.begin()) {  // merge with the range before
    auto prev = std::prev(next);
    if (prev->first + prev->second == begin) {
      prev->second += bytes;
      return;
    }
  }
  insert_free(begin, bytes);
}

}  // namespace strata::memory
