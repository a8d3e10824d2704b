#pragma once
// SlotSlab: fixed-size slots carved from one reserved block, with move-only slot handles.
// PinnedHostPool (host slots for chunks) and DevicePool (device slots) both build on it.

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "strata/common/status.hpp"

namespace strata::memory {

//! Budget, use and high-water of one pool, in bytes.
struct PoolStats {
  std::uint64_t budget_bytes = 0;      //!< hard limit
  std::uint64_t used_bytes = 0;        //!< in use now
  std::uint64_t high_water_bytes = 0;  //!< most ever in use at once
};

class SlotSlab;

//! A slot of a SlotSlab. Move-only; returns the slot to its slab on destruction. `Tag`
//! keeps host slots and device slots apart in the type system. Must not outlive its pool.
template <typename Tag>
class SlabSlot {
 public:
  SlabSlot() = default;
  SlabSlot(SlabSlot&& other) noexcept
      : slab_(std::exchange(other.slab_, nullptr)),
        data_(std::exchange(other.data_, nullptr)),
        index_(other.index_) {}
  SlabSlot& operator=(SlabSlot&& other) noexcept {
    if (this != &other) {
      reset();
      slab_ = std::exchange(other.slab_, nullptr);
      data_ = std::exchange(other.data_, nullptr);
      index_ = other.index_;
    }
    return *this;
  }
  SlabSlot(const SlabSlot&) = delete;
  SlabSlot& operator=(const SlabSlot&) = delete;
  ~SlabSlot() { reset(); }

  bool valid() const { return slab_ != nullptr; }
  //! Start of the slot (host memory for pinned slots, device memory for device slots).
  std::byte* data() const { return data_; }
  //! Usable bytes: the pool's slot size.
  std::size_t size_bytes() const;
  //! Position of the slot in its slab, in [0, slot count).
  std::uint32_t index() const { return index_; }
  //! Returns the slot now; the handle becomes empty.
  void reset();

 private:
  friend class SlotSlab;
  SlabSlot(SlotSlab* slab, std::byte* data, std::uint32_t index) : slab_(slab), data_(data), index_(index) {}
  SlotSlab* slab_ = nullptr;
  std::byte* data_ = nullptr;
  std::uint32_t index_ = 0;
};

//! `count` slots of `slot_bytes`, `stride_bytes` apart, from a block the owner keeps
//! alive. Thread-safe (one mutex; acquire and release are O(1)). A freed slot is the
//! next one handed out (LIFO), so a hot slot stays in cache and in the TLB.
class SlotSlab {
 public:
  //! `what` names the slab in messages ("pinned host slab"); `raise_hint` says how to
  //! get more ("raise pinned.slot_count or pinned.budget").
  SlotSlab(std::byte* base, std::size_t slot_bytes, std::size_t stride_bytes, std::size_t count,
           std::string what, std::string raise_hint);
  SlotSlab(const SlotSlab&) = delete;
  SlotSlab& operator=(const SlotSlab&) = delete;
  //! Checks (always) that every slot was returned.
  ~SlotSlab();

  //! A free slot, or OutOfBudget naming the slab's budget when all are in use. Never blocks
  //! on anything but the slab's mutex.
  template <typename Tag>
  Result<SlabSlot<Tag>> acquire() {
    STRATA_ASSIGN_OR_RETURN(std::uint32_t index, acquire_index());
    return SlabSlot<Tag>(this, slot_data(index), index);
  }

  std::size_t slot_bytes() const { return slot_bytes_; }
  std::size_t stride_bytes() const { return stride_bytes_; }
  std::size_t slot_count() const { return count_; }
  //! Slots not in use now.
  std::size_t free_count() const;
  //! Budget = slot count x slot size; used and high-water in whole slots x slot size.
  PoolStats stats() const;
  //! Start of slot `index` (< slot_count()).
  std::byte* slot_data(std::uint32_t index) const { return base_ + std::size_t{index} * stride_bytes_; }

 private:
  template <typename Tag>
  friend class SlabSlot;
  Result<std::uint32_t> acquire_index();
  void release(std::uint32_t index);

  std::byte* const base_;
  const std::size_t slot_bytes_;
  const std::size_t stride_bytes_;
  const std::size_t count_;
  const std::string what_;
  const std::string raise_hint_;
  mutable std::mutex mutex_;
  std::vector<std::uint32_t> free_;  // stack of free indices; capacity = count_
  std::vector<bool> in_use_;         // catches double release (checked builds)
  std::size_t high_water_slots_ = 0;
};

template <typename Tag>
std::size_t SlabSlot<Tag>::size_bytes() const {
  return slab_ == nullptr ? 0 : slab_->slot_bytes();
}

template <typename Tag>
void SlabSlot<Tag>::reset() {
  if (slab_ == nullptr) return;
  slab_->release(index_);
  slab_ = nullptr;
  data_ = nullptr;
}

}  // namespace strata::memory
