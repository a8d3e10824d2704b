#pragma once
// DevicePool: the GPU tier's memory. One allocation from the Device at start-up, carved
// into chunk-size slots (DeviceSlot); the hot path never asks the Device for memory.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "strata/common/bytes.hpp"
#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"
#include "strata/memory/slot_slab.hpp"

namespace strata::memory {

//! Settings of a DevicePool (`device_pool.*`). Plain data.
struct DevicePoolOptions {
  //! Bytes taken from the device for slots (device_pool.budget); must fit the device budget.
  std::uint64_t budget_bytes = 1 * kGiB;
  //! Size of one chunk slot (device_pool.slot_size).
  std::uint64_t slot_bytes = 64 * kMiB;
  //! Alignment of every slot (device_pool.slot_alignment): a power of two; at least the
  //! device's own allocation alignment is used.
  std::uint64_t slot_alignment_bytes = 4096;

  //! Sets budget, slot_size or slot_alignment from text (parse_bytes); InvalidArgument
  //! naming `device_pool.<key>` and the value.
  Status set(std::string_view key, std::string_view value);
  //! Checks: budget > 0; slot size > 0 and <= budget; alignment a power of two.
  //! InvalidArgument naming the setting, the value and what to do.
  Status validate() const;
};

struct DeviceSlotTag {};
//! A chunk slot of a DevicePool (device memory). Move-only; returns the slot on destruction.
using DeviceSlot = SlabSlot<DeviceSlotTag>;

//! Thread-safe. Every slot must be released before the pool is destroyed (checked), and
//! the pool must not outlive its Device.
class DevicePool {
 public:
  //! Takes budget_bytes (rounded down to whole slots) from `device` in one allocation.
  //! Fails with the validation error, or the device's OutOfBudget / OutOfMemory (which
  //! names the device budget) when the device cannot give that much.
  static Result<std::unique_ptr<DevicePool>> create(Device& device, const DevicePoolOptions& options);
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;
  ~DevicePool();

  //! A free slot, or OutOfBudget naming the pool's budget when all are in use.
  Result<DeviceSlot> acquire_slot() { return slab_->acquire<DeviceSlotTag>(); }

  //! Budget (slots x slot size), in use, high-water.
  PoolStats stats() const { return slab_->stats(); }
  std::size_t slot_bytes() const { return slab_->slot_bytes(); }
  std::size_t slot_count() const { return slab_->slot_count(); }
  Device& device() const { return *device_; }
  //! Whether [ptr, ptr + bytes) lies inside the pool's allocation.
  bool contains(const void* ptr, std::size_t bytes = 1) const;

 private:
  DevicePool(Device& device, DeviceAllocation allocation);
  Device* device_;
  DeviceAllocation allocation_;
  std::unique_ptr<SlotSlab> slab_;
};

}  // namespace strata::memory
