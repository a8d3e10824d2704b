// PinnedHostPool: the slot slab, the jemalloc arena carving the same region, budgets,
// region spans, and bad settings.

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "memory/test_util.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/memory/pinned_host_pool.hpp"

namespace strata::memory {
namespace {

PinnedHostPoolOptions small_options() {
  PinnedHostPoolOptions options;
  options.budget_bytes = 24 * kMiB;
  options.slot_bytes = 2 * kMiB;
  options.slot_count = 4;
  options.arena_bytes = 8 * kMiB;
  return options;
}

std::unique_ptr<PinnedHostPool> make_pool(const PinnedHostPoolOptions& options = small_options()) {
  auto pool = PinnedHostPool::create(options);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(pool).value();
}

Status create_status(const PinnedHostPoolOptions& options) {
  return PinnedHostPool::create(options).status();
}

void expect_invalid(const Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(needle), std::string::npos) << "missing \"" << needle << "\" in " << s;
}

TEST(PinnedHostPool, SlotsAreAlignedInsideTheRegionAndBounded) {
  PinnedHostPoolOptions options = small_options();
  options.slot_bytes = 1 * kMiB + 100;  // stride rounds up to the alignment
  options.slot_alignment_bytes = 64 * kKiB;
  auto pool = make_pool(options);
  std::vector<PinnedSlot> slots;
  for (std::size_t i = 0; i < pool->slot_count(); ++i) {
    auto slot = pool->acquire_slot();
    ASSERT_TRUE(slot.ok()) << slot.status();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slot->data()) % (64 * kKiB), 0u);
    EXPECT_TRUE(pool->contains(slot->data(), slot->size_bytes()));
    EXPECT_EQ(slot->size_bytes(), 1 * kMiB + 100);
    std::memset(slot->data(), static_cast<int>(i), slot->size_bytes());  // slots do not overlap
    slots.push_back(std::move(slot).value());
  }
  for (std::size_t i = 0; i < slots.size(); ++i) {
    EXPECT_EQ(static_cast<int>(slots[i].data()[slots[i].size_bytes() - 1]), static_cast<int>(i));
  }
  auto extra = pool->acquire_slot();
  ASSERT_FALSE(extra.ok());
  EXPECT_EQ(extra.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(extra.status().message().find("budget"), std::string::npos) << extra.status();
  EXPECT_NE(extra.status().message().find("pinned.slot_count"), std::string::npos) << extra.status();
  PoolStats stats = pool->slab_stats();
  EXPECT_EQ(stats.used_bytes, stats.budget_bytes);
  EXPECT_EQ(stats.high_water_bytes, stats.budget_bytes);
  EXPECT_EQ(stats.budget_bytes, 4 * (1 * kMiB + 100));
}

TEST(PinnedHostPool, FreedSlotIsReused) {
  auto pool = make_pool();
  auto a = pool->acquire_slot();
  auto b = pool->acquire_slot();
  ASSERT_TRUE(a.ok() && b.ok());
  std::byte* freed = b->data();
  const std::uint32_t freed_index = b->index();
  b->reset();
  EXPECT_EQ(pool->slab_stats().used_bytes, 2 * kMiB);
  auto c = pool->acquire_slot();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->data(), freed);
  EXPECT_EQ(c->index(), freed_index);
  EXPECT_EQ(pool->slab_stats().high_water_bytes, 4 * kMiB);
}

TEST(PinnedHostPool, ArenaAllocationsLieInsideTheRegion) {
  auto pool = make_pool();
  std::vector<PinnedBuffer> buffers;
  std::mt19937 rng(1);
  for (std::size_t bytes : {1ul, 8ul, 100ul, 4096ul, 5000ul, 65536ul, 1000000ul}) {
    for (std::size_t alignment : {8ul, 64ul, 4096ul}) {
      auto buffer = pool->allocate(bytes, alignment);
      ASSERT_TRUE(buffer.ok()) << buffer.status();
      EXPECT_TRUE(pool->contains(buffer->data(), buffer->size_bytes())) << bytes;
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffer->data()) % alignment, 0u);
      EXPECT_EQ(pool->region_index(buffer->data()), std::optional<std::size_t>(0));
      std::memset(buffer->data(), 0x7f, bytes);
      buffers.push_back(std::move(buffer).value());
    }
  }
  const PoolStats stats = pool->arena_stats();
  EXPECT_GT(stats.used_bytes, 0u);
  EXPECT_LE(stats.high_water_bytes, stats.budget_bytes);
  buffers.clear();
  EXPECT_EQ(pool->arena_stats().used_bytes, 0u);
  // A pointer outside the region is not in it.
  int on_stack = 0;
  EXPECT_FALSE(pool->contains(&on_stack));
  EXPECT_EQ(pool->region_index(&on_stack), std::nullopt);
}

TEST(PinnedHostPool, ArenaBudgetIsAHardLimit) {
  auto pool = make_pool();  // 8 MiB arena
  auto too_big = pool->allocate(9 * kMiB);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(too_big.status().message().find("pinned.arena_size = 8.00 MiB"), std::string::npos)
      << too_big.status();
  // Fill with 256 KiB buffers until refused: never past the budget, refused with OutOfBudget.
  std::vector<PinnedBuffer> buffers;
  for (int i = 0; i < 64; ++i) {
    auto b = pool->allocate(256 * kKiB);
    if (!b.ok()) {
      EXPECT_EQ(b.status().code(), StatusCode::kOutOfBudget) << b.status();
      break;
    }
    EXPECT_TRUE(pool->contains(b->data(), b->size_bytes()));
    buffers.push_back(std::move(b).value());
  }
  EXPECT_GE(buffers.size(), 8u);  // at least half the arena is usable despite metadata
  EXPECT_LT(buffers.size(), 33u);
  EXPECT_LE(pool->arena_stats().high_water_bytes, 8 * kMiB);
  // Freed buffers make room again.
  buffers.resize(buffers.size() / 2);
  EXPECT_TRUE(pool->allocate(256 * kKiB).ok());
}

// Note [Exact extents]: an arena sized to its buffers plus jemalloc's metadata holds
// them all, and freed buffers coalesce into room for larger ones. Before, jemalloc's
// geometric growth and page padding left it holding leftovers too small for a buffer
// (the 1 GiB host tier of 64 MiB chunks failed at 896 MiB in use).
TEST(PinnedHostPool, ArenaSizedToItsBuffersHoldsThemAll) {
  PinnedHostPoolOptions options;
  options.arena_bytes = 72 * kMiB;  // 16 x 4 MiB + room for jemalloc's metadata
  options.slot_bytes = 4096;
  options.slot_count = 1;
  options.budget_bytes = options.arena_bytes + options.slot_bytes;
  auto pool = make_pool(options);
  std::vector<PinnedBuffer> buffers;
  for (int i = 0; i < 16; ++i) {
    auto b = pool->allocate(4 * kMiB, 4096);
    ASSERT_TRUE(b.ok()) << "buffer " << i << ": " << b.status();
    buffers.push_back(std::move(b).value());
  }
  EXPECT_EQ(pool->arena_stats().used_bytes, 64 * kMiB);  // no padding charged
  // Every other buffer freed, then all: the ranges coalesce into 32 MiB pieces.
  for (std::size_t i = 0; i < buffers.size(); i += 2) buffers[i].reset();
  buffers.clear();
  for (int i = 0; i < 2; ++i) {
    auto b = pool->allocate(32 * kMiB, 4096);
    ASSERT_TRUE(b.ok()) << "32 MiB buffer " << i << ": " << b.status();
    buffers.push_back(std::move(b).value());
  }
}

TEST(PinnedHostPool, BadBuffersRequestsAreErrors) {
  auto pool = make_pool();
  auto zero = pool->allocate(0);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  auto odd = pool->allocate(64, 48);
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(odd.status().message().find("48"), std::string::npos) << odd.status();
}

TEST(PinnedHostPool, ConcurrentSlotsAndBuffersStayWithinBudgets) {
  auto pool = make_pool();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      std::mt19937 rng(static_cast<std::uint32_t>(t));
      std::vector<PinnedSlot> slots;
      std::vector<PinnedBuffer> buffers;
      for (int i = 0; i < 400; ++i) {
        switch (rng() % 4) {
          case 0: {
            auto s = pool->acquire_slot();
            if (s.ok()) {
              s->data()[0] = std::byte{1};
              slots.push_back(std::move(s).value());
            }
            break;
          }
          case 1:
            if (!slots.empty()) slots.pop_back();
            break;
          case 2: {
            auto b = pool->allocate(1 + rng() % 100000);
            if (b.ok()) {
              EXPECT_TRUE(pool->contains(b->data(), b->size_bytes()));
              b->data()[0] = std::byte{2};
              buffers.push_back(std::move(b).value());
            }
            break;
          }
          default:
            if (!buffers.empty()) buffers.erase(buffers.begin());
        }
        EXPECT_LE(pool->slab_stats().used_bytes, pool->slab_stats().budget_bytes);
        EXPECT_LE(pool->arena_stats().used_bytes, pool->arena_stats().budget_bytes);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(pool->slab_stats().used_bytes, 0u);
  EXPECT_EQ(pool->arena_stats().used_bytes, 0u);
  EXPECT_LE(pool->slab_stats().high_water_bytes, pool->slab_stats().budget_bytes);
  EXPECT_GT(pool->slab_stats().high_water_bytes, 0u);
}

TEST(PinnedHostPool, RegionIsExposedAsSpansOfAtMostOneGiB) {
  PinnedHostPoolOptions options;
  options.budget_bytes = 2 * kGiB + 512 * kMiB;
  options.slot_bytes = 64 * kMiB;
  options.arena_bytes = 64 * kMiB;
  options.pin = false;  // only reserve address space; nothing is touched
  options.huge_pages = false;
  auto pool = make_pool(options);
  const auto& spans = pool->regions();
  ASSERT_EQ(spans.size(), 3u);
  std::size_t total = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    EXPECT_LE(spans[i].size(), kGiB);
    if (i > 0) {
      EXPECT_EQ(spans[i].data(), spans[i - 1].data() + spans[i - 1].size());
    }
    EXPECT_EQ(pool->region_index(spans[i].data()), std::optional<std::size_t>(i));
    EXPECT_EQ(pool->region_index(spans[i].data() + spans[i].size() - 1), std::optional<std::size_t>(i));
    total += spans[i].size();
  }
  EXPECT_EQ(total, pool->slab_stats().budget_bytes + options.arena_bytes);
  EXPECT_EQ(pool->pinning(), PinningMode::kUnpinned);
  EXPECT_NE(pool->pinning_reason().find("pinned.pin=false"), std::string::npos);
}

TEST(PinnedHostPool, LogsPagesAndPinning) {
  testing::LogCapture log;
  auto pool = make_pool();
  const std::string text = log.text();
  EXPECT_NE(text.find("pinned host: 16.00 MiB region"), std::string::npos) << text;
  // The page kind is logged with its reason, whichever it is.
  EXPECT_TRUE(text.find("hugetlb") != std::string::npos || text.find("huge pages") != std::string::npos ||
              text.find("transparent") != std::string::npos)
      << text;
  EXPECT_NE(text.find(std::string(pinning_mode_name(pool->pinning()))), std::string::npos) << text;
  if (pool->pinning() == PinningMode::kUnpinned) {
    EXPECT_NE(text.find("RLIMIT_MEMLOCK"), std::string::npos) << text;
  }
}

TEST(PinnedHostPool, SimDeviceNeedsNoRegistrationSoMlockIsTried) {
  DeviceOptions device_options;
  device_options.kind = DeviceChoice::kSim;
  device_options.budget_bytes = 16 * kMiB;
  auto device = make_device(device_options);
  ASSERT_TRUE(device.ok());
  auto pool = PinnedHostPool::create(small_options(), device->get());
  ASSERT_TRUE(pool.ok()) << pool.status();
  EXPECT_NE((*pool)->pinning(), PinningMode::kCudaRegistered);
  EXPECT_NE((*pool)->pinning_reason().find("sim needs no registration"), std::string::npos)
      << (*pool)->pinning_reason();
}

TEST(PinnedHostPoolOptions, BadSettingsNameSettingValueAndRemedy) {
  PinnedHostPoolOptions options = small_options();
  options.budget_bytes = 0;
  expect_invalid(create_status(options), "pinned.budget = 0");

  options = small_options();
  options.budget_bytes = 64 * kTiB;
  expect_invalid(create_status(options), "larger than this machine's RAM");

  options = small_options();
  Status s = options.set("budget", "12XB");
  expect_invalid(s, "pinned.budget");
  EXPECT_NE(s.message().find("12XB"), std::string::npos);

  options = small_options();
  options.slot_alignment_bytes = 3 * 4096;
  expect_invalid(create_status(options), "pinned.slot_alignment = 12288");
  options.slot_alignment_bytes = 1024;
  expect_invalid(create_status(options), "at least 4096");

  options = small_options();
  options.slot_bytes = 32 * kMiB;  // region is 24 MiB
  expect_invalid(create_status(options), "pinned.slot_size = 32.00 MiB is larger than the region");

  options = small_options();
  options.slot_count = 100;
  expect_invalid(create_status(options), "pinned.slot_count = 100");

  options = small_options();
  options.arena_bytes = 1 * kMiB;
  expect_invalid(create_status(options), "pinned.arena_size = 1.00 MiB");

  options = small_options();
  expect_invalid(options.set("pin", "maybe"), "pinned.pin");
  expect_invalid(options.set("slot_count", "4K"), "pinned.slot_count");
  expect_invalid(options.set("colour", "red"), "pinned.colour");
}

TEST(PinnedHostPoolOptions, SetParsesEverySetting) {
  PinnedHostPoolOptions options;
  ASSERT_TRUE(options.set("budget", "48MiB").ok());
  ASSERT_TRUE(options.set("slot_size", "4MiB").ok());
  ASSERT_TRUE(options.set("slot_count", "0").ok());
  ASSERT_TRUE(options.set("slot_alignment", "2MiB").ok());
  ASSERT_TRUE(options.set("arena_size", "16MiB").ok());
  ASSERT_TRUE(options.set("huge_pages", "false").ok());
  ASSERT_TRUE(options.set("pin", "off").ok());
  EXPECT_TRUE(options.validate().ok());
  EXPECT_EQ(options.effective_slot_count(), 8u);  // (48 - 16) / 4
  EXPECT_FALSE(options.huge_pages);
  EXPECT_FALSE(options.pin);
}

}  // namespace
}  // namespace strata::memory
