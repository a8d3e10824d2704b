// FaultInjectingEngine over both real engines: short transfers and EINTR are
// completed by the engines' retries, EIO surfaces as a Status, delays and
// reordering change nothing, and under random faults the swap store never
// returns wrong bytes. Every failure message carries the seed
// (STRATA_FAULT_SEED=<n> reruns with it).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <map>

#include "strata/common/bytes.hpp"
#include "strata/offload/fault_injecting_engine.hpp"
#include "strata/offload/swap_store.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::TempDir;

std::uint64_t test_seed(std::uint64_t fallback) {
  const char* env = std::getenv("STRATA_FAULT_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : fallback;
}

class FaultTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  std::unique_ptr<FaultInjectingEngine> make(FaultOptions faults) {
    IoEngineOptions inner{
        .kind = GetParam(), .queue_depth = 8, .request_bytes = 64 * 1024, .requests_in_flight_max = 32};
    auto engine = FaultInjectingEngine::create(std::move(inner), faults);
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    return engine.ok() ? std::move(engine).value() : nullptr;
  }
  std::unique_ptr<SwapStore> store(IoEngine& engine, std::uint32_t slots) {
    auto s =
        SwapStore::create(engine, {.dirs = {a_.path(), b_.path()}, .slot_bytes = kSlotBytes, .slots = slots});
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  static constexpr std::uint64_t kSlotBytes = 512 * 1024;
  TempDir a_, b_;
};

TEST_P(FaultTest, ShortTransfersAndEintrAreCompletedByRetry) {
  std::uint64_t seed = test_seed(101);
  SCOPED_TRACE(::testing::Message() << "fault seed " << seed);
  auto engine = make({.seed = seed, .short_probability = 0.5, .eintr_probability = 0.3});
  ASSERT_TRUE(engine);
  auto swap = store(*engine, 4);
  ASSERT_TRUE(swap);
  AlignedBuffer out(kSlotBytes), back(kSlotBytes);
  for (ChunkId chunk = 0; chunk < 4; ++chunk) {
    SlotId slot = *swap->allocate();
    fill_random(out.all(), seed + chunk);
    Status wrote = swap->write(slot, chunk, out.all());
    ASSERT_TRUE(wrote.ok()) << wrote.to_string();
    Status read = swap->read(slot, chunk, back.all());
    ASSERT_TRUE(read.ok()) << read.to_string();
    ASSERT_EQ(std::memcmp(out.data(), back.data(), kSlotBytes), 0);
  }
  FaultStats faults = engine->fault_stats();
  IoEngineStats stats = engine->stats();
  EXPECT_GT(faults.short_transfers, 0u);
  EXPECT_GT(faults.eintr, 0u);
  EXPECT_EQ(stats.short_transfers_retried, faults.short_transfers);
  EXPECT_EQ(stats.eagain_eintr_retried, faults.eintr);
}

TEST_P(FaultTest, EioSurfacesAsAStatusAndNeverAsData) {
  std::uint64_t seed = test_seed(202);
  SCOPED_TRACE(::testing::Message() << "fault seed " << seed);
  auto engine = make({.seed = seed, .eio_probability = 0.05});
  ASSERT_TRUE(engine);
  auto swap = store(*engine, 16);
  ASSERT_TRUE(swap);
  AlignedBuffer out(kSlotBytes), back(kSlotBytes);
  int write_errors = 0, read_errors = 0, good_reads = 0;
  for (ChunkId chunk = 0; chunk < 16; ++chunk) {
    SlotId slot = *swap->allocate();
    fill_random(out.all(), seed + chunk);
    Status wrote = swap->write(slot, chunk, out.all());
    if (!wrote.ok()) {
      ++write_errors;
      EXPECT_EQ(wrote.code(), StatusCode::kIoError) << wrote.to_string();
      EXPECT_NE(wrote.message().find("Input/output error"), std::string::npos) << wrote.to_string();
      // A slot whose write failed must not read back as valid.
      EXPECT_EQ(swap->read(slot, chunk, back.all()).code(), StatusCode::kFailedPrecondition);
      continue;
    }
    Status read = swap->read(slot, chunk, back.all());
    if (!read.ok()) {
      ++read_errors;
      EXPECT_EQ(read.code(), StatusCode::kIoError) << read.to_string();
      continue;
    }
    ++good_reads;
    ASSERT_EQ(std::memcmp(out.data(), back.data(), kSlotBytes), 0);
  }
  EXPECT_GT(engine->fault_stats().eio, 0u);
  EXPECT_GT(write_errors + read_errors, 0);
  EXPECT_GT(good_reads, 0);
}

TEST_P(FaultTest, DelaysAndReorderingKeepEveryCompletion) {
  std::uint64_t seed = test_seed(303);
  SCOPED_TRACE(::testing::Message() << "fault seed " << seed);
  auto engine = make({.seed = seed, .delay_probability = 0.5, .delay_us_max = 500, .reorder = true});
  ASSERT_TRUE(engine);
  EXPECT_EQ(engine->name(), GetParam() == EngineKind::kUring ? "faulty(uring)" : "faulty(posix)");
  auto swap = store(*engine, 24);
  ASSERT_TRUE(swap);
  constexpr int kChunks = 24;
  AlignedBuffer out(kSlotBytes * kChunks), back(kSlotBytes * kChunks);
  fill_random(out.all(), seed);
  IoGroup writes;
  for (int c = 0; c < kChunks; ++c) {
    ASSERT_TRUE(
        swap->write_async(*swap->allocate(), c, out.span(c * kSlotBytes, kSlotBytes), writes.add()).ok());
  }
  ASSERT_TRUE(writes.wait().ok());
  IoGroup reads;
  for (int c = 0; c < kChunks; ++c) {
    ASSERT_TRUE(
        swap->read_async(static_cast<SlotId>(c), c, back.span(c * kSlotBytes, kSlotBytes), reads.add()).ok());
  }
  ASSERT_TRUE(reads.wait().ok());
  EXPECT_EQ(std::memcmp(out.data(), back.data(), out.size()), 0);
  FaultStats faults = engine->fault_stats();
  EXPECT_GT(faults.delays, 0u);
  EXPECT_GT(faults.reordered, 0u);
}

// Random operations under every fault at once: a read either fails with a
// Status or returns exactly what was last written to that slot.
TEST_P(FaultTest, RandomFaultsNeverReturnWrongBytes) {
  std::uint64_t seed =
      test_seed(static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()));
  SCOPED_TRACE(::testing::Message() << "fault seed " << seed << " (rerun with STRATA_FAULT_SEED=" << seed
                                    << ")");
  auto engine = make({.seed = seed,
                      .eio_probability = 0.02,
                      .short_probability = 0.2,
                      .eintr_probability = 0.1,
                      .delay_probability = 0.2,
                      .delay_us_max = 300,
                      .reorder = true});
  ASSERT_TRUE(engine);
  constexpr std::uint32_t kSlots = 6;
  auto swap = store(*engine, kSlots);
  ASSERT_TRUE(swap);
  std::mt19937_64 rng(seed);
  AlignedBuffer out(kSlotBytes), back(kSlotBytes);
  std::map<SlotId, std::uint64_t> written;  // slot -> fill seed of its last successful write
  for (SlotId s = 0; s < kSlots; ++s) ASSERT_EQ(*swap->allocate(), s);
  for (int step = 0; step < 60; ++step) {
    SlotId slot = static_cast<SlotId>(rng() % kSlots);
    if (rng() % 2 == 0) {
      std::uint64_t fill = rng();
      fill_random(out.all(), fill);
      if (swap->write(slot, slot, out.all()).ok()) {
        written[slot] = fill;
      } else {
        written.erase(slot);
      }
    } else {
      Status read = swap->read(slot, slot, back.all());
      if (!written.contains(slot)) {
        ASSERT_FALSE(read.ok()) << "slot " << slot << " was never written successfully, yet read back";
        continue;
      }
      if (!read.ok()) continue;  // an injected EIO: fine, as long as it is a Status
      fill_random(out.all(), written[slot]);
      ASSERT_EQ(std::memcmp(out.data(), back.data(), kSlotBytes), 0) << "wrong bytes from slot " << slot;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, FaultTest, ::testing::Values(EngineKind::kUring, EngineKind::kPosix),
                         [](const auto& p) { return p.param == EngineKind::kUring ? "uring" : "posix"; });

}  // namespace
}  // namespace strata::offload
