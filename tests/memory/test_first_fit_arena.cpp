// The pinned pool's first-fit arena backend (Note [Arena backends]): the one the
// torch extension links. Buffers stay inside the region, never overlap, are
// 4 KiB-rounded in the budget, coalesce when freed, and exhaustion is an error.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/memory/pinned_host_pool.hpp"

namespace strata::memory {
namespace {

std::unique_ptr<PinnedHostPool> make_pool() {
  PinnedHostPoolOptions o;
  o.budget_bytes = 8 * kMiB;
  o.arena_bytes = 4 * kMiB;
  o.slot_count = 1;
  o.slot_bytes = 4096;
  o.pin = false;
  auto pool = PinnedHostPool::create(o);
  EXPECT_TRUE(pool.ok()) << pool.status();
  return std::move(pool).value();
}

TEST(FirstFitArena, BuffersAreDisjointInsideTheRegionAndCoalesce) {
  auto pool = make_pool();
  std::vector<PinnedBuffer> buffers;
  for (std::size_t bytes : {1u, 4096u, 5000u, 65536u, 100u}) {
    auto b = pool->allocate(bytes, 64);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_TRUE(pool->contains(b->data(), bytes));
    buffers.push_back(std::move(b).value());
  }
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    for (std::size_t j = i + 1; j < buffers.size(); ++j) {
      const auto* a = buffers[i].data();
      const auto* b = buffers[j].data();
      EXPECT_TRUE(a + buffers[i].size_bytes() <= b || b + buffers[j].size_bytes() <= a)
          << i << " overlaps " << j;
    }
  }
  // 4 KiB granules: 4096 + 4096 + 8192 + 65536 + 4096.
  EXPECT_EQ(pool->arena_stats().used_bytes, 86016u);
  buffers.clear();
  EXPECT_EQ(pool->arena_stats().used_bytes, 0u);
  // Everything coalesced: the whole arena is one free range again.
  auto whole = pool->allocate(4 * kMiB, 4096);
  EXPECT_TRUE(whole.ok()) << whole.status();
}

TEST(FirstFitArena, ExhaustionIsAnErrorNotACrash) {
  auto pool = make_pool();
  auto a = pool->allocate(3 * kMiB);
  ASSERT_TRUE(a.ok());
  auto b = pool->allocate(2 * kMiB);
  EXPECT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfBudget);
}

}  // namespace
}  // namespace strata::memory
