// runtime::GradientOrder (Note [Gradients in pieces] in strata/runtime/gradient_order.hpp):
// which gradients a caller hands now and which it keeps back.
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "strata/runtime/gradient_order.hpp"

namespace strata::runtime {
namespace {

using List = std::vector<std::uint32_t>;

// Six tensors in three families of two: {0, 1}, {2, 3}, {4, 5}.
GradientOrder three_pairs(std::size_t limit) {
  GradientOrder o;
  o.set_families({0, 0, 1, 1, 2, 2}, std::vector<bool>(6, true));
  o.begin_micro_batch(limit);
  return o;
}

List offer(GradientOrder& o, std::uint32_t t) {
  List hand;
  o.offer(t, 100, &hand);
  return hand;
}

TEST(GradientOrder, WithoutALimitEverythingIsHandedAtOnce) {
  GradientOrder o = three_pairs(0);
  for (std::uint32_t t : {1u, 3u, 5u, 0u, 2u, 4u}) EXPECT_EQ(offer(o, t), List{t});
  EXPECT_EQ(o.kept_total(), 0u);
}

TEST(GradientOrder, APieceThatWouldOpenOneFamilyTooManyWaitsForAPlace) {
  GradientOrder o = three_pairs(1);
  EXPECT_EQ(offer(o, 1), List{1});  // family 0 opens
  EXPECT_EQ(offer(o, 3), List{});   // family 1 would be a second: kept
  EXPECT_EQ(offer(o, 5), List{});   // family 2 too
  EXPECT_EQ(o.open(), 1u);
  EXPECT_EQ(o.kept_bytes_peak(), 200u);
  EXPECT_EQ(offer(o, 0), (List{0, 3}));  // family 0 completes; the oldest kept (family 1) opens
  EXPECT_EQ(offer(o, 2), (List{2, 5}));  // family 1 completes; family 2 opens
  EXPECT_EQ(offer(o, 4), List{4});
  EXPECT_EQ(o.open(), 0u);
  EXPECT_EQ(o.kept_total(), 2u);
}

TEST(GradientOrder, AKeptFamilysLastPieceHandsItWholeWithoutOpeningIt) {
  GradientOrder o = three_pairs(1);
  EXPECT_EQ(offer(o, 1), List{1});
  EXPECT_EQ(offer(o, 3), List{});
  EXPECT_EQ(offer(o, 2), (List{3, 2}));  // completes family 1 at once: never incomplete
  EXPECT_EQ(o.open(), 1u);               // family 0 only
}

TEST(GradientOrder, BackwardsEndHandsWhatIsStillKeptAndANewMicroBatchStartsClean) {
  GradientOrder o = three_pairs(1);
  offer(o, 1);
  offer(o, 3);
  offer(o, 5);
  List hand;
  o.take_kept(&hand);
  EXPECT_EQ(hand, (List{3, 5}));
  EXPECT_FALSE(o.keeps_any());
  o.begin_micro_batch(1);
  EXPECT_EQ(o.open(), 0u);
  EXPECT_EQ(offer(o, 5), List{5});
}

TEST(GradientOrder, FrozenTensorsDoNotCountAndDropForgetsTheKept) {
  GradientOrder o;
  o.set_families({0, 0, 1, 1}, {true, false, true, true});  // family 0 has one trainable tensor
  o.begin_micro_batch(1);
  EXPECT_EQ(offer(o, 0), List{0});  // completes family 0 by itself
  EXPECT_EQ(offer(o, 2), List{2});  // family 1 opens: the only open one
  o.drop();
  EXPECT_FALSE(o.keeps_any());
  EXPECT_EQ(offer(o, 3), List{3});
  EXPECT_EQ(o.open(), 0u);
}

using Handings = std::vector<std::pair<std::uint32_t, bool>>;

Handings end_backward(GradientOrder& o) {
  std::vector<GradientOrder::Handing> out;
  o.end_backward(&out);
  Handings h;
  for (const GradientOrder::Handing& x : out) h.emplace_back(x.tensor, x.gradient);
  return h;
}

TEST(GradientOrder, BackwardsEndCompletesOpenFamiliesFirstThenEachKeptOneWithItsUnusedTensors) {
  // Tensors 0, 2 and 4 are unused in this micro-batch (a branch per family).
  GradientOrder o = three_pairs(1);
  EXPECT_EQ(offer(o, 1), List{1});  // family 0 opens
  EXPECT_EQ(offer(o, 3), List{});   // kept
  EXPECT_EQ(offer(o, 5), List{});   // kept
  EXPECT_TRUE(o.pending());
  // Family 0 completes (0 declared) before the kept ones are handed, each completed in turn.
  EXPECT_EQ(end_backward(o), (Handings{{0, false}, {3, true}, {2, false}, {5, true}, {4, false}}));
  EXPECT_EQ(o.open(), 0u);
  EXPECT_FALSE(o.keeps_any());
  EXPECT_FALSE(o.pending());
}

TEST(GradientOrder, BackwardsEndDeclaresNothingForFamiliesNoGradientReached) {
  GradientOrder o = three_pairs(0);
  EXPECT_EQ(offer(o, 1), List{1});
  EXPECT_EQ(offer(o, 0), List{0});  // family 0 complete; families 1 and 2 got nothing
  EXPECT_FALSE(o.pending());
  EXPECT_EQ(end_backward(o), Handings{});
  o.begin_micro_batch(0);
  EXPECT_EQ(offer(o, 2), List{2});  // a new micro-batch: nothing seen yet
  EXPECT_EQ(end_backward(o), (Handings{{3, false}}));
}

TEST(GradientOrder, BackwardsEndNeverDeclaresAFrozenTensor) {
  GradientOrder o;
  o.set_families({0, 0, 0}, {true, false, true});
  o.begin_micro_batch(0);
  EXPECT_EQ(offer(o, 0), List{0});
  EXPECT_EQ(end_backward(o), (Handings{{2, false}}));
}

}  // namespace
}  // namespace strata::runtime
