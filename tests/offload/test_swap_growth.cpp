// SwapStore files that grow and that no death leaves behind: growth from
// initial_slots up to the cap (Note [Growing swap files]), a full tmpfs while
// growing (NoSpace, nothing lost), and processes killed by SIGKILL, SIGTERM and
// SIGINT with a live store leaving nothing in the directory (Note [Unlinked swap
// files]), with both engines.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/offload/swap_store.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::SmallTmpfs;
using testing::TempDir;

constexpr std::uint64_t kSlotBytes = 256 * kKiB;

std::uint64_t size_of(const std::filesystem::path& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? static_cast<std::uint64_t>(st.st_size) : 0;
}

std::unique_ptr<IoEngine> engine_of(EngineKind kind) {
  auto engine = make_io_engine({.kind = kind, .queue_depth = 8, .request_bytes = 64 * kKiB});
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// A store in `dir` with a cap of `slots` and `initial` preallocated.
std::unique_ptr<SwapStore> grown_store(IoEngine& engine, const std::filesystem::path& dir,
                                       std::uint64_t slot_bytes, std::uint32_t slots, std::uint32_t initial) {
  auto store = SwapStore::create(
      engine, {.dirs = {dir}, .slot_bytes = slot_bytes, .slots = slots, .initial_slots = initial});
  EXPECT_TRUE(store.ok()) << store.status().to_string();
  return store.ok() ? std::move(store).value() : nullptr;
}

TEST(SwapGrowth, FilesStartAtTheInitialSlotsAndGrowByAStepUpToTheCap) {
  TempDir dir;
  auto engine = engine_of(EngineKind::kUring);
  ASSERT_TRUE(engine);
  // A cap of 1024 slots (256 MiB): nothing of it is preallocated.
  auto store = grown_store(*engine, dir.path(), kSlotBytes, 1024, 0);
  ASSERT_TRUE(store);
  SwapStore& s = *store;
  const auto file = s.reopen_paths().at(0);
  EXPECT_EQ(s.slots_allocated_on_disk(), 0u);
  EXPECT_EQ(size_of(file), 4096u) << "the header only";
  SlotId a = *s.allocate(), b = *s.allocate(), c = *s.allocate();
  EXPECT_EQ(a, 0u);
  EXPECT_EQ(b, 1u);
  EXPECT_EQ(c, 2u);
  // One growth step of 64 MiB (256 slots), not one fallocate per slot.
  EXPECT_EQ(s.slots_allocated_on_disk(), 256u);
  EXPECT_EQ(size_of(file), 4096 + 256 * kSlotBytes);
  s.release(b);
  EXPECT_EQ(*s.allocate(), 1u) << "the lowest free slot first, so the file grows only when needed";
  AlignedBuffer out(kSlotBytes), back(kSlotBytes);
  fill_random(out.all(), 21);
  ASSERT_TRUE(s.write(c, 7, out.all()).ok());
  ASSERT_TRUE(s.read(c, 7, back.all()).ok());
  EXPECT_EQ(std::memcmp(out.data(), back.data(), kSlotBytes), 0);

  // The cap is the most slots, and the files never grow past it (a step would go further).
  auto capped = grown_store(*engine, dir.path(), kSlotBytes, 5, 2);
  ASSERT_TRUE(capped);
  EXPECT_EQ(size_of(capped->reopen_paths()[0]), 4096 + 2 * kSlotBytes);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(capped->allocate().ok()) << i;
  auto full = capped->allocate();
  EXPECT_EQ(full.status().code(), StatusCode::kOutOfBudget) << full.status().to_string();
  EXPECT_EQ(capped->slots_allocated_on_disk(), 5u);
  EXPECT_EQ(size_of(capped->reopen_paths()[0]), 4096 + 5 * kSlotBytes);
}

// A 6 MiB tmpfs under a store whose cap is 1 GiB: the store is created (its
// initial slots fit), grows slot by slot until the file system is full, then
// fails that allocation with NoSpace naming the file and the free space; every
// slot written before reads back intact and a released slot is usable again.
TEST(SwapGrowth, AFullDiskWhileGrowingIsNoSpaceAndLosesNothing) {
  for (EngineKind kind : {EngineKind::kUring, EngineKind::kPosix}) {
    SmallTmpfs disk(6 * kMiB);
    if (!disk.skip_reason().empty()) GTEST_SKIP() << disk.skip_reason();
    auto engine = engine_of(kind);
    ASSERT_TRUE(engine);
    constexpr std::uint64_t kSlot = 1 * kMiB;
    auto store = grown_store(*engine, disk.path(), kSlot, 1024, 2);
    ASSERT_TRUE(store);
    SwapStore& s = *store;
    AlignedBuffer out(kSlot), back(kSlot);
    std::vector<SlotId> written;
    Status failed;
    for (int i = 0; i < 16 && failed.ok(); ++i) {
      auto slot = s.allocate();
      if (!slot.ok()) {
        failed = slot.status();
        break;
      }
      fill_random(out.all(), 100 + *slot);
      ASSERT_TRUE(s.write(*slot, *slot, out.all()).ok());
      written.push_back(*slot);
    }
    ASSERT_FALSE(failed.ok()) << "a 6 MiB tmpfs cannot hold 16 slots of 1 MiB";
    EXPECT_EQ(failed.code(), StatusCode::kNoSpace) << failed.to_string();
    EXPECT_NE(failed.message().find(s.files()[0].string()), std::string::npos) << failed.to_string();
    EXPECT_NE(failed.message().find("free"), std::string::npos) << failed.to_string();
    EXPECT_GE(written.size(), 3u) << "grew past the initial 2 slots first";
    for (SlotId slot : written) {
      fill_random(out.all(), 100 + slot);
      ASSERT_TRUE(s.read(slot, slot, back.all()).ok()) << slot;
      EXPECT_EQ(std::memcmp(out.data(), back.data(), kSlot), 0) << "slot " << slot << " lost";
    }
    s.release(written[1]);
    EXPECT_EQ(*s.allocate(), written[1]) << "a freed slot below the end needs no growth";
    store.reset();
    EXPECT_TRUE(std::filesystem::is_empty(disk.path()));
  }
}

// Note [Unlinked swap files]: a process killed while its store is live (io
// registered, a slot written) leaves nothing, whatever the signal.
TEST(SwapUnlinked, AProcessKilledWithALiveStoreLeavesNoFiles) {
  for (int sig : {SIGKILL, SIGTERM, SIGINT}) {
    for (EngineKind kind : {EngineKind::kUring, EngineKind::kPosix}) {
      TempDir dir;
      int ready[2];
      ASSERT_EQ(::pipe(ready), 0);
      const pid_t pid = ::fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        ::close(ready[0]);
        auto engine = make_io_engine({.kind = kind});
        if (!engine.ok()) ::_exit(1);
        auto store =
            SwapStore::create(**engine, {.dirs = {dir.path()}, .slot_bytes = kSlotBytes, .slots = 4});
        if (!store.ok()) ::_exit(2);
        AlignedBuffer out(kSlotBytes);
        fill_random(out.all(), 5);
        if (!(*store)->write(*(*store)->allocate(), 1, out.all()).ok()) ::_exit(3);
        const char c = 'r';
        if (::write(ready[1], &c, 1) != 1) ::_exit(4);
        for (;;) ::pause();
      }
      ::close(ready[1]);
      char c = 0;
      ASSERT_EQ(::read(ready[0], &c, 1), 1) << "the child failed before its store was ready";
      ::close(ready[0]);
      EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "nothing named even while it lives";
      ASSERT_EQ(::kill(pid, sig), 0);
      int wstatus = 0;
      ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
      EXPECT_TRUE(WIFSIGNALED(wstatus) && WTERMSIG(wstatus) == sig) << wstatus;
      EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "signal " << sig;
    }
  }
}

}  // namespace
}  // namespace strata::offload
