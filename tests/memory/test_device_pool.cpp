// DevicePool: one device allocation carved into slots; budgets, alignment, reuse, threads.

#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "memory/test_util.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/memory/device_pool.hpp"

namespace strata::memory {
namespace {

std::unique_ptr<Device> make_sim(std::uint64_t budget_bytes) {
  DeviceOptions options;
  options.kind = DeviceChoice::kSim;
  options.budget_bytes = budget_bytes;
  auto device = make_device(options);
  EXPECT_TRUE(device.ok()) << device.status();
  return std::move(device).value();
}

DevicePoolOptions pool_options(std::uint64_t budget_bytes, std::uint64_t slot_bytes) {
  DevicePoolOptions options;
  options.budget_bytes = budget_bytes;
  options.slot_bytes = slot_bytes;
  return options;
}

TEST(DevicePool, TakesOneAllocationAndCarvesAlignedSlots) {
  auto device = make_sim(64 * kMiB);
  DevicePoolOptions options = pool_options(10 * kMiB, 3 * kMiB + 1);
  options.slot_alignment_bytes = 64 * kKiB;
  auto pool = DevicePool::create(*device, options);
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_EQ((*pool)->slot_count(), 3u);  // 10 MiB / (3 MiB + 64 KiB)
  EXPECT_GE(device->memory_info().used_bytes, 3 * (3 * kMiB + 64 * kKiB));
  std::vector<DeviceSlot> slots;
  for (int i = 0; i < 3; ++i) {
    auto slot = (*pool)->acquire_slot();
    ASSERT_TRUE(slot.ok()) << slot.status();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slot->data()) % (64 * kKiB), 0u);
    EXPECT_TRUE((*pool)->contains(slot->data(), slot->size_bytes()));
    slots.push_back(std::move(slot).value());
  }
  auto extra = (*pool)->acquire_slot();
  ASSERT_FALSE(extra.ok());
  EXPECT_EQ(extra.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(extra.status().message().find("device_pool.budget"), std::string::npos) << extra.status();
  PoolStats stats = (*pool)->stats();
  EXPECT_EQ(stats.high_water_bytes, stats.budget_bytes);
  EXPECT_EQ(stats.used_bytes, 3 * (3 * kMiB + 1));
}

TEST(DevicePool, SlotsWorkAsCopyTargets) {
  auto device = make_sim(16 * kMiB);
  auto pool = DevicePool::create(*device, pool_options(8 * kMiB, 1 * kMiB));
  auto stream = device->create_stream();
  ASSERT_TRUE(pool.ok() && stream.ok());
  auto slot = (*pool)->acquire_slot();
  ASSERT_TRUE(slot.ok());
  std::vector<std::uint8_t> src(kMiB, 0x3c), back(kMiB, 0);
  ASSERT_TRUE(device->copy_async(*stream, slot->data(), src.data(), kMiB, CopyKind::kHostToDevice).ok());
  ASSERT_TRUE(device->copy_async(*stream, back.data(), slot->data(), kMiB, CopyKind::kDeviceToHost).ok());
  ASSERT_TRUE(device->synchronize(*stream).ok());
  EXPECT_EQ(back, src);
}

TEST(DevicePool, FreedSlotIsReused) {
  auto device = make_sim(16 * kMiB);
  auto pool = DevicePool::create(*device, pool_options(4 * kMiB, 1 * kMiB));
  ASSERT_TRUE(pool.ok());
  auto a = (*pool)->acquire_slot();
  ASSERT_TRUE(a.ok());
  std::byte* first = a->data();
  *a = DeviceSlot();
  EXPECT_EQ((*pool)->stats().used_bytes, 0u);
  auto b = (*pool)->acquire_slot();
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data(), first);
}

TEST(DevicePool, PoolLargerThanTheDeviceBudgetNamesBothBudgets) {
  auto device = make_sim(8 * kMiB);
  auto pool = DevicePool::create(*device, pool_options(16 * kMiB, 1 * kMiB));
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(pool.status().message().find("device_pool.budget = 16.00 MiB"), std::string::npos)
      << pool.status();
  EXPECT_NE(pool.status().message().find("device budget of 8.00 MiB"), std::string::npos) << pool.status();
}

TEST(DevicePool, BadOptionsNameTheSetting) {
  auto device = make_sim(8 * kMiB);
  auto expect_invalid = [&](const DevicePoolOptions& options, const std::string& needle) {
    auto pool = DevicePool::create(*device, options);
    ASSERT_FALSE(pool.ok());
    EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(pool.status().message().find(needle), std::string::npos) << pool.status();
  };
  expect_invalid(pool_options(0, kMiB), "device_pool.budget = 0");
  expect_invalid(pool_options(4 * kMiB, 0), "device_pool.slot_size = 0");
  expect_invalid(pool_options(4 * kMiB, 8 * kMiB),
                 "device_pool.slot_size = 8.00 MiB is larger than the pool");
  DevicePoolOptions odd = pool_options(4 * kMiB, kMiB);
  odd.slot_alignment_bytes = 1000;
  expect_invalid(odd, "device_pool.slot_alignment = 1000");
  DevicePoolOptions options;
  EXPECT_EQ(options.set("budget", "12XB").code(), StatusCode::kInvalidArgument);
  EXPECT_NE(options.set("budget", "12XB").message().find("device_pool.budget"), std::string::npos);
  EXPECT_TRUE(options.set("slot_size", "2MiB").ok());
  EXPECT_EQ(options.slot_bytes, 2 * kMiB);
}

TEST(DevicePool, ConcurrentAcquireReleaseStaysWithinBudget) {
  auto device = make_sim(16 * kMiB);
  auto pool = DevicePool::create(*device, pool_options(8 * kMiB, 1 * kMiB));
  ASSERT_TRUE(pool.ok());
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<std::uint32_t>(t));
      std::vector<DeviceSlot> held;
      for (int i = 0; i < 1000; ++i) {
        if (held.size() < 4 && rng() % 2 == 0) {
          auto s = (*pool)->acquire_slot();
          if (s.ok()) {
            held.push_back(std::move(s).value());
          } else {
            refused.fetch_add(1);
          }
        } else if (!held.empty()) {
          held.pop_back();
        }
        EXPECT_LE((*pool)->stats().used_bytes, 8 * kMiB);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ((*pool)->stats().used_bytes, 0u);
  EXPECT_LE((*pool)->stats().high_water_bytes, 8 * kMiB);
  EXPECT_GT((*pool)->stats().high_water_bytes, 0u);
}

}  // namespace
}  // namespace strata::memory
