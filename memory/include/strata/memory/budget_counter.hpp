#pragma once
// BudgetCounter: bytes in use against a hard budget, with a high-water mark, lock-free.
// Device::allocate and the pinned arena use it. Thread-safe.

#include <atomic>
#include <cstdint>

namespace strata::memory {

class BudgetCounter {
 public:
  //! `budget_bytes` is the hard limit.
  explicit BudgetCounter(std::uint64_t budget_bytes) : budget_bytes_(budget_bytes) {}

  //! Adds `bytes` if the total stays within the budget; returns false (nothing added)
  //! otherwise. Concurrent callers never overshoot: the add is a compare-and-swap.
  bool try_add(std::uint64_t bytes) {
    std::uint64_t used = used_bytes_.load(std::memory_order_relaxed);
    do {
      if (bytes > budget_bytes_ - used) return false;
    } while (!used_bytes_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
    const std::uint64_t now = used + bytes;
    std::uint64_t high = high_water_bytes_.load(std::memory_order_relaxed);
    while (now > high && !high_water_bytes_.compare_exchange_weak(high, now, std::memory_order_relaxed)) {
    }
    return true;
  }
  //! Removes bytes added earlier.
  void sub(std::uint64_t bytes) { used_bytes_.fetch_sub(bytes, std::memory_order_relaxed); }

  std::uint64_t budget_bytes() const { return budget_bytes_; }
  std::uint64_t used_bytes() const { return used_bytes_.load(std::memory_order_relaxed); }
  std::uint64_t high_water_bytes() const { return high_water_bytes_.load(std::memory_order_relaxed); }

 private:
  const std::uint64_t budget_bytes_;
  std::atomic<std::uint64_t> used_bytes_{0};
  std::atomic<std::uint64_t> high_water_bytes_{0};
};

}  // namespace strata::memory
