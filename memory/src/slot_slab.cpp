#include "strata/memory/slot_slab.hpp"

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

namespace strata::memory {

SlotSlab::SlotSlab(std::byte* base, std::size_t slot_bytes, std::size_t stride_bytes, std::size_t count,
                   std::string what, std::string raise_hint)
    : base_(base),
      slot_bytes_(slot_bytes),
      stride_bytes_(stride_bytes),
      count_(count),
      what_(std::move(what)),
      raise_hint_(std::move(raise_hint)),
      in_use_(count, false) {
  STRATA_CHECK(slot_bytes > 0);
  STRATA_CHECK(stride_bytes >= slot_bytes);
  STRATA_CHECK(count <= UINT32_MAX);
  STRATA_CHECK(count == 0 || base != nullptr);
  free_.reserve(count);
  // Highest index at the bottom, so the first acquire hands out slot 0.
  for (std::size_t i = count; i > 0; --i) free_.push_back(static_cast<std::uint32_t>(i - 1));
}

SlotSlab::~SlotSlab() {
  std::lock_guard lock(mutex_);
  STRATA_CHECK_MSG(free_.size() == count_, "a slot outlived its pool");
}

std::size_t SlotSlab::free_count() const {
  std::lock_guard lock(mutex_);
  return free_.size();
}

PoolStats SlotSlab::stats() const {
  std::lock_guard lock(mutex_);
  PoolStats stats;
  stats.budget_bytes = std::uint64_t{count_} * slot_bytes_;
  stats.used_bytes = std::uint64_t{count_ - free_.size()} * slot_bytes_;
  stats.high_water_bytes = std::uint64_t{high_water_slots_} * slot_bytes_;
  return stats;
}

Result<std::uint32_t> SlotSlab::acquire_index() {
  std::lock_guard lock(mutex_);
  if (free_.empty()) {
    return out_of_budget("{}: all {} slots of {} are in use (budget {}); release a slot or {}", what_, count_,
                         format_bytes(slot_bytes_), format_bytes(std::uint64_t{count_} * slot_bytes_),
                         raise_hint_);
  }
  const std::uint32_t index = free_.back();
  free_.pop_back();
  STRATA_ASSERT(!in_use_[index]);
  in_use_[index] = true;
  const std::size_t used = count_ - free_.size();
  if (used > high_water_slots_) high_water_slots_ = used;
  return index;
}

void SlotSlab::release(std::uint32_t index) {
  std::lock_guard lock(mutex_);
  STRATA_CHECK(index < count_);
  STRATA_CHECK_MSG(in_use_[index], "slot released twice");
  in_use_[index] = false;
  free_.push_back(index);
}

}  // namespace strata::memory
