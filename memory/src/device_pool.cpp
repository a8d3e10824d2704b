#include "strata/memory/device_pool.hpp"

#include <algorithm>

#include "settings.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::memory {

Status DevicePoolOptions::set(std::string_view key, std::string_view value) {
  const std::string setting = fmt::format("device_pool.{}", key);
  if (key == "budget") {
    STRATA_ASSIGN_OR_RETURN(budget_bytes, parse_bytes(value, setting));
  } else if (key == "slot_size") {
    STRATA_ASSIGN_OR_RETURN(slot_bytes, parse_bytes(value, setting));
  } else if (key == "slot_alignment") {
    STRATA_ASSIGN_OR_RETURN(slot_alignment_bytes, parse_bytes(value, setting));
  } else {
    return invalid_argument(
        "unknown setting device_pool.{} (= \"{}\"); known: budget, slot_size, slot_alignment", key, value);
  }
  return Status::Ok();
}

Status DevicePoolOptions::validate() const {
  if (budget_bytes == 0) {
    return invalid_argument(
        "device_pool.budget = 0: the device pool needs a budget; set e.g. device_pool.budget=4GiB");
  }
  if (slot_bytes == 0) {
    return invalid_argument(
        "device_pool.slot_size = 0: a chunk slot needs a size; set e.g. device_pool.slot_size=64MiB");
  }
  if (!is_pow2(slot_alignment_bytes)) {
    return invalid_argument("device_pool.slot_alignment = {}: not a power of two; use e.g. 256 or 4096",
                            slot_alignment_bytes);
  }
  if (align_up(slot_bytes, slot_alignment_bytes) > budget_bytes) {
    return invalid_argument(
        "device_pool.slot_size = {} is larger than the pool (device_pool.budget = {}); lower the slot size "
        "or raise "
        "the budget",
        format_bytes(slot_bytes), format_bytes(budget_bytes));
  }
  return Status::Ok();
}

DevicePool::DevicePool(Device& device, DeviceAllocation allocation)
    : device_(&device), allocation_(std::move(allocation)) {}

DevicePool::~DevicePool() {
  slab_.reset();
}  // checks every slot came back, then frees

Result<std::unique_ptr<DevicePool>> DevicePool::create(Device& device, const DevicePoolOptions& options) {
  STRATA_RETURN_IF_ERROR(options.validate());
  const std::uint64_t alignment =
      std::max<std::uint64_t>(options.slot_alignment_bytes, device.alignment_bytes());
  const std::uint64_t stride = align_up(options.slot_bytes, alignment);
  const std::uint64_t count = options.budget_bytes / stride;
  if (count == 0 || count > UINT32_MAX) {
    return invalid_argument(
        "device_pool.budget = {} holds {} slots of {} (stride {}); pick a budget of 1 to {} slots",
        format_bytes(options.budget_bytes), count, format_bytes(options.slot_bytes), format_bytes(stride),
        UINT32_MAX);
  }
  // Over-allocate when slots want more alignment than the device guarantees.
  const std::uint64_t slack = alignment > device.alignment_bytes() ? alignment : 0;
  Result<DeviceAllocation> allocation = device.allocate(count * stride + slack);
  if (!allocation.ok()) {
    Status status = allocation.status();
    return status.with_context(fmt::format("creating the device pool (device_pool.budget = {})",
                                           format_bytes(options.budget_bytes)));
  }
  std::unique_ptr<DevicePool> pool(new DevicePool(device, std::move(allocation).value()));
  auto* base = reinterpret_cast<std::byte*>(
      align_up(reinterpret_cast<std::uintptr_t>(pool->allocation_.data()), alignment));
  pool->slab_ = std::make_unique<SlotSlab>(base, options.slot_bytes, stride, count, "device pool",
                                           "raise device_pool.budget");
  STRATA_LOG_INFO("device pool: {} slots of {} on {}", count, format_bytes(options.slot_bytes),
                  device.name());
  return pool;
}

bool DevicePool::contains(const void* ptr, std::size_t bytes) const {
  const auto begin = reinterpret_cast<std::uintptr_t>(allocation_.data());
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  const std::size_t size = allocation_.size_bytes();
  return p >= begin && bytes <= size && p - begin <= size - bytes;
}

}  // namespace strata::memory
