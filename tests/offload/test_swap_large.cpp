// Disk-heavy (label nvme): 256 MiB of chunks through a two-directory swap store
// with each engine, many chunks in flight at once, every byte checked.
#include <gtest/gtest.h>

#include "strata/common/bytes.hpp"
#include "strata/offload/swap_store.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::TempDir;

class SwapLarge : public ::testing::TestWithParam<EngineKind> {};

TEST_P(SwapLarge, QuarterGibibyteOfChunksRoundTrips) {
  constexpr std::uint64_t kSlot = 4 * kMiB;
  constexpr std::uint32_t kSlots = 64;  // 256 MiB
  constexpr std::uint32_t kInFlight = 16;
  TempDir a, b;
  AlignedBuffer staging(kSlot * kInFlight), back(kSlot * kInFlight);
  auto engine = make_io_engine({.kind = GetParam(), .fixed_buffer_regions = {staging.all(), back.all()}});
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto store =
      SwapStore::create(**engine, {.dirs = {a.path(), b.path()}, .slot_bytes = kSlot, .slots = kSlots});
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  for (std::uint32_t wave = 0; wave < kSlots / kInFlight; ++wave) {
    IoGroup writes;
    for (std::uint32_t i = 0; i < kInFlight; ++i) {
      SlotId slot = wave * kInFlight + i;
      ASSERT_EQ(*(*store)->allocate(), slot);
      fill_random(staging.span(i * kSlot, kSlot), slot);
      ASSERT_TRUE((*store)->write_async(slot, slot, staging.span(i * kSlot, kSlot), writes.add()).ok());
    }
    ASSERT_TRUE(writes.wait().ok());
  }
  for (std::uint32_t wave = 0; wave < kSlots / kInFlight; ++wave) {
    IoGroup reads;
    for (std::uint32_t i = 0; i < kInFlight; ++i) {
      SlotId slot = wave * kInFlight + i;
      ASSERT_TRUE((*store)->read_async(slot, slot, back.span(i * kSlot, kSlot), reads.add()).ok());
    }
    Status read = reads.wait();
    ASSERT_TRUE(read.ok()) << read.to_string();
    for (std::uint32_t i = 0; i < kInFlight; ++i) {
      fill_random(staging.span(0, kSlot), wave * kInFlight + i);
      ASSERT_EQ(std::memcmp(staging.data(), back.data() + i * kSlot, kSlot), 0)
          << "slot " << wave * kInFlight + i;
    }
  }
  if (GetParam() == EngineKind::kUring) {
    EXPECT_GT((*engine)->stats().fixed_buffer_pieces, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapLarge, ::testing::Values(EngineKind::kUring, EngineKind::kPosix),
                         [](const auto& p) { return p.param == EngineKind::kUring ? "uring" : "posix"; });

}  // namespace
}  // namespace strata::offload
