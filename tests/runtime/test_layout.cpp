#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "strata/runtime/layout.hpp"
#include "strata/runtime/trace.hpp"

namespace strata::runtime {
namespace {

std::vector<TensorId> iota_order(std::size_t n) {
  std::vector<TensorId> order(n);
  std::iota(order.begin(), order.end(), 0);
  return order;
}

TEST(Tensor, Numel) {
  EXPECT_EQ(*shape_numel("w", {3, 4}), 12u);
  EXPECT_EQ(*shape_numel("s", {}), 1u);
  auto zero = shape_numel("layer0.bias", {0});
  ASSERT_FALSE(zero.ok());
  EXPECT_NE(zero.status().message().find("layer0.bias"), std::string::npos);
  EXPECT_FALSE(shape_numel("big", {1LL << 40, 1LL << 40}).ok());
  EXPECT_FALSE(parse_dtype("int8").ok());
  EXPECT_EQ(*parse_dtype("bfloat16"), DType::kBF16);
}

TEST(Layout, FixedSizePacksInOrderWithAlignedOffsets) {
  std::vector<std::uint64_t> numels = {100, 3000, 5000, 10};
  LayoutOptions o{.chunk_elems = 8192};
  auto layout = build_layout(numels, iota_order(4), o);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_EQ(layout->families.size(), 2u);
  EXPECT_EQ(layout->slots[0].offset_elems, 0u);
  EXPECT_EQ(layout->slots[1].offset_elems, 128u);  // 100 aligned up to 64
  EXPECT_EQ(layout->slots[2].family, 0u);          // 3136 + 5000 = 8136 <= 8192
  EXPECT_EQ(layout->slots[2].offset_elems, 3136u);
  EXPECT_EQ(layout->slots[3].family, 1u);  // align_up(8136) = 8192: no room for 10 more
  EXPECT_EQ(layout->slots[3].offset_elems, 0u);
  EXPECT_EQ(layout->families[0].used_elems, 8136u);
  for (const auto& slot : layout->slots) EXPECT_EQ(slot.offset_elems % 64, 0u);
}

TEST(Layout, OversizedTensorGetsItsOwnFamily) {
  std::vector<std::uint64_t> numels = {10, 20000, 10};
  auto layout = build_layout(numels, iota_order(3), LayoutOptions{.chunk_elems = 8192});
  ASSERT_TRUE(layout.ok());
  ASSERT_EQ(layout->families.size(), 3u);
  EXPECT_TRUE(layout->families[1].oversized);
  EXPECT_EQ(layout->families[1].capacity_elems, 20480u);
  EXPECT_EQ(layout->slots[2].family, 2u);
}

TEST(Layout, SearchFindsZeroPaddingForUniformTensors) {
  // 48 tensors of 3 MiB elements: a chunk of exactly 3 Mi (or a multiple) has no padding.
  std::vector<std::uint64_t> numels(48, 3u << 20);
  auto layout = build_layout(numels, iota_order(48),
                             LayoutOptions{.chunk_elems_min = 1u << 20, .chunk_elems_max = 1u << 24});
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(layout->capacity_total_elems, layout->numel_total);
  EXPECT_EQ(layout->padding_fraction(), 0.0);
}

TEST(Layout, SearchNeverWorseThanAnyCandidate) {
  std::mt19937_64 rng(1234);
  std::vector<std::uint64_t> numels(200);
  for (auto& n : numels) n = 1 + rng() % (3u << 20);
  auto order = iota_order(numels.size());
  LayoutOptions o{.chunk_elems_min = 1u << 20, .chunk_elems_max = 1u << 23, .search_candidates_max = 64};
  auto layout = build_layout(numels, order, o);
  ASSERT_TRUE(layout.ok());
  std::uint64_t best = layout->capacity_total_elems - layout->numel_total;
  EXPECT_EQ(best, layout_padding(numels, order, layout->chunk_elems, 64, 4096));
  for (std::uint64_t c = 3u << 20; c <= (1u << 23); c += 1u << 20) {
    std::uint64_t padding = layout_padding(numels, order, c, 64, 4096);
    EXPECT_LE(best, padding + (1u << 20)) << c;  // coarse grid: within one step of any probe
  }
  EXPECT_LT(layout->padding_fraction(), 0.25);
}

TEST(Layout, RejectsBadOptions) {
  std::vector<std::uint64_t> numels = {10};
  EXPECT_FALSE(build_layout(numels, iota_order(1), {.chunk_elems = 1000}).ok());  // not 4096-aligned
  EXPECT_FALSE(build_layout(numels, iota_order(1), {.offset_align_elems = 48}).ok());
  EXPECT_FALSE(
      build_layout(numels, iota_order(1), {.chunk_elems_min = 1u << 24, .chunk_elems_max = 1u << 20}).ok());
  std::vector<std::uint64_t> zero = {0};
  EXPECT_FALSE(build_layout(zero, iota_order(1), {}).ok());
}

TEST(NextUse, CyclicDistances) {
  // Sequence: 0 1 2 | 2 1 0  (forward then backward)
  std::vector<FamilyUse> uses;
  for (FamilyId f : {0u, 1u, 2u}) uses.push_back({.family = f, .phase = Phase::kForward});
  for (FamilyId f : {2u, 1u, 0u}) uses.push_back({.family = f, .phase = Phase::kBackward});
  NextUse next(uses, 4);
  EXPECT_EQ(next.distance(0, 0), 5u);  // pos 0 -> pos 5
  EXPECT_EQ(next.distance(2, 2), 1u);
  EXPECT_EQ(next.distance(1, 4), 3u);  // wraps: 4 -> 6+1 = 7
  EXPECT_EQ(next.distance(0, 5), 1u);  // wraps to pos 0 of the next step
  EXPECT_EQ(next.distance(3, 0), NextUse::kNever);
}

TEST(Tracer, MergesConsecutiveUses) {
  Tracer tracer;
  tracer.record(0, Phase::kForward, false);
  tracer.record(1, Phase::kForward, false);
  tracer.record(1, Phase::kBackward, true);
  const StepTrace& t = tracer.trace();
  ASSERT_EQ(t.uses.size(), 3u);
  EXPECT_TRUE(t.uses[2].writes_grad);
}

TEST(Tracer, LastBackwardUse) {
  StepTrace t;
  t.uses = {{0, Phase::kForward},        {1, Phase::kForward},        {1, Phase::kBackward, true},
            {0, Phase::kBackward, true}, {0, Phase::kBackward, true}, {7, Phase::kBackward, true}};
  const std::vector<long> last = last_backward_use(t, 3);
  EXPECT_EQ(last, (std::vector<long>{4, 2, -1}));  // family 7 is out of range, 2 has no backward use
}

}  // namespace
}  // namespace strata::runtime
