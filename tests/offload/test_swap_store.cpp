// SwapStore on real files in a temporary directory: round trips (one and two
// directories, O_DIRECT and buffered, both engines), the slot allocator, CRC
// checks against files altered behind its back (through /proc/self/fd: the files
// are unlinked, Note [Unlinked swap files]), stale named files of a crashed run,
// bad directories, and out-of-space without privileges. Growth, kills and a full
// tmpfs: test_swap_growth.cpp.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <thread>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/offload/swap_store.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::TempDir;

constexpr std::uint64_t kSlotBytes = 256 * 1024;

// Captures what strata logs while it lives.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64)) {
    logger().sinks().push_back(sink_);
  }
  ~LogCapture() { logger().sinks().pop_back(); }
  bool contains(std::string_view text) const {
    for (const auto& line : sink_->last_formatted()) {
      if (line.find(text) != std::string::npos) return true;
    }
    return false;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink_;
};

std::unique_ptr<IoEngine> engine_of(EngineKind kind) {
  auto engine = make_io_engine({.kind = kind, .queue_depth = 8, .request_bytes = 64 * 1024});
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::unique_ptr<SwapStore> store_of(IoEngine& engine, std::vector<std::filesystem::path> dirs,
                                    std::uint32_t slots = 8, bool refuse_direct = false) {
  auto store = SwapStore::create(engine, {.dirs = std::move(dirs),
                                          .slot_bytes = kSlotBytes,
                                          .slots = slots,
                                          .simulate_direct_io_refused = refuse_direct});
  EXPECT_TRUE(store.ok()) << store.status().to_string();
  return store.ok() ? std::move(store).value() : nullptr;
}

struct StoreCase {
  EngineKind kind;
  int dirs;
  bool direct;
};

class SwapRoundTrip : public ::testing::TestWithParam<StoreCase> {};

TEST_P(SwapRoundTrip, RandomDataOfManySizesComesBackIntact) {
  TempDir a, b;
  std::vector<std::filesystem::path> dirs{a.path()};
  if (GetParam().dirs == 2) dirs.push_back(b.path());
  auto engine = engine_of(GetParam().kind);
  ASSERT_TRUE(engine);
  LogCapture log;
  auto store = store_of(*engine, dirs, 8, !GetParam().direct);
  ASSERT_TRUE(store);
  EXPECT_EQ(store->direct_io(), GetParam().direct);
  if (!GetParam().direct) {
    EXPECT_TRUE(log.contains("refuses O_DIRECT"));
  }
  EXPECT_EQ(store->files().size(), dirs.size());
  EXPECT_EQ(store->stripe_bytes(), kSlotBytes / dirs.size());

  AlignedBuffer out(kSlotBytes), back(kSlotBytes);
  std::vector<std::uint64_t> sizes = {
      4096,      8192, kSlotBytes / 2 - 4096, kSlotBytes / 2, kSlotBytes / 2 + 4096, kSlotBytes - 4096,
      kSlotBytes};
  for (std::uint64_t size : sizes) {
    SCOPED_TRACE(::testing::Message() << "size " << size);
    auto slot = store->allocate();
    ASSERT_TRUE(slot.ok());
    fill_random(out.span(0, size), size);
    ASSERT_TRUE(store->write(*slot, 100 + size, out.span(0, size)).ok());
    std::memset(back.data(), 0, size);
    Status read = store->read(*slot, 100 + size, back.span(0, size));
    ASSERT_TRUE(read.ok()) << read.to_string();
    ASSERT_EQ(std::memcmp(back.data(), out.data(), size), 0);
    if (size > kSlotBytes / 2 && dirs.size() == 2) {
      EXPECT_EQ(store->locate(*slot, size).size(), 2u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Stores, SwapRoundTrip,
                         ::testing::Values(StoreCase{EngineKind::kUring, 1, true},
                                           StoreCase{EngineKind::kUring, 2, true},
                                           StoreCase{EngineKind::kUring, 2, false},
                                           StoreCase{EngineKind::kPosix, 1, true},
                                           StoreCase{EngineKind::kPosix, 2, false}),
                         [](const auto& p) {
                           return std::string(p.param.kind == EngineKind::kUring ? "uring" : "posix") + "_" +
                                  std::to_string(p.param.dirs) + "dirs_" +
                                  (p.param.direct ? "direct" : "buffered");
                         });

class SwapStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = engine_of(EngineKind::kUring);
    ASSERT_TRUE(engine_);
  }
  TempDir a_, b_;
  std::unique_ptr<IoEngine> engine_;
  AlignedBuffer out_{kSlotBytes}, back_{kSlotBytes};
};

TEST_F(SwapStoreTest, ManyConcurrentReadersAndWriters) {
  auto store = store_of(*engine_, {a_.path(), b_.path()}, 16);
  ASSERT_TRUE(store);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      AlignedBuffer out(kSlotBytes), back(kSlotBytes);
      for (int round = 0; round < 6; ++round) {
        auto slot = store->allocate();
        if (!slot.ok()) {
          ++failures;
          return;
        }
        fill_random(out.all(), t * 100 + round);
        ChunkId chunk = t * 1000 + round;
        if (!store->write(*slot, chunk, out.all()).ok()) ++failures;
        // Two overlapping reads of the same written slot.
        IoGroup group;
        AlignedBuffer back2(kSlotBytes);
        if (!store->read_async(*slot, chunk, back.all(), group.add()).ok()) ++failures;
        if (!store->read_async(*slot, chunk, back2.all(), group.add()).ok()) ++failures;
        if (!group.wait().ok()) ++failures;
        if (std::memcmp(back.data(), out.data(), kSlotBytes) != 0) ++failures;
        if (std::memcmp(back2.data(), out.data(), kSlotBytes) != 0) ++failures;
        store->release(*slot);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(store->slots_free(), 16u);
}

TEST_F(SwapStoreTest, SlotAllocatorRunsOutAndRecycles) {
  auto store = store_of(*engine_, {a_.path()}, 3);
  ASSERT_TRUE(store);
  std::vector<SlotId> slots;
  for (int i = 0; i < 3; ++i) slots.push_back(*store->allocate());
  auto full = store->allocate();
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(full.status().message().find("all 3 slots"), std::string::npos);
  fill_random(out_.all(), 1);
  ASSERT_TRUE(store->write(slots[1], 7, out_.all()).ok());
  store->release(slots[1]);
  auto again = store->allocate();
  ASSERT_TRUE(again.ok());
  // A recycled slot forgets what it held: reading it is an error, not stale bytes.
  Status read = store->read(*again, 7, back_.all());
  EXPECT_EQ(read.code(), StatusCode::kFailedPrecondition) << read.to_string();
}

TEST_F(SwapStoreTest, UnwrittenSlotWrongChunkAndWrongLengthAreErrors) {
  auto store = store_of(*engine_, {a_.path()});
  ASSERT_TRUE(store);
  SlotId slot = *store->allocate();
  Status never = store->read(slot, 1, back_.all());
  EXPECT_EQ(never.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(never.message().find("never written"), std::string::npos) << never.to_string();
  fill_random(out_.all(), 2);
  ASSERT_TRUE(store->write(slot, 1, out_.all()).ok());
  EXPECT_EQ(store->read(slot, 2, back_.all()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(store->read(slot, 1, back_.span(0, 4096)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(store->write(slot + 1, 1, out_.all()).code(), StatusCode::kFailedPrecondition);  // not allocated
}

TEST_F(SwapStoreTest, FlippedByteInTheFileIsCaughtByTheChecksum) {
  auto store = store_of(*engine_, {a_.path(), b_.path()});
  ASSERT_TRUE(store);
  SlotId slot = *store->allocate();
  fill_random(out_.all(), 3);
  ASSERT_TRUE(store->write(slot, 42, out_.all()).ok());
  ASSERT_TRUE(store->read(slot, 42, back_.all()).ok());
  SlotStripe second = store->locate(slot, kSlotBytes).at(1);
  {
    int fd = ::open(store->reopen_paths().at(1).c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    std::uint8_t byte = 0;
    off_t at = static_cast<off_t>(second.offset_bytes + 777);
    ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
    byte ^= 0x01;
    ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
    ::fsync(fd);
    ::close(fd);
  }
  Status read = store->read(slot, 42, back_.all());
  EXPECT_EQ(read.code(), StatusCode::kCorrupt) << read.to_string();
  EXPECT_NE(read.message().find("chunk 42 slot " + std::to_string(slot)), std::string::npos)
      << read.to_string();
  EXPECT_NE(read.message().find(second.file.string()), std::string::npos) << read.to_string();
  EXPECT_NE(read.message().find(std::to_string(second.offset_bytes)), std::string::npos) << read.to_string();
}

TEST_F(SwapStoreTest, TruncatedSwapFileFailsTheReadInsteadOfReturningZeros) {
  auto store = store_of(*engine_, {a_.path()});
  ASSERT_TRUE(store);
  SlotId slot = *store->allocate();
  slot = *store->allocate();  // the second slot lies past the truncation point
  fill_random(out_.all(), 4);
  ASSERT_TRUE(store->write(slot, 5, out_.all()).ok());
  ASSERT_EQ(::truncate(store->reopen_paths()[0].c_str(), 4096 + kSlotBytes), 0);
  Status read = store->read(slot, 5, back_.all());
  EXPECT_EQ(read.code(), StatusCode::kIoError) << read.to_string();
  EXPECT_NE(read.message().find("end of file"), std::string::npos) << read.to_string();
}

// Note [Unlinked swap files]: the directories show nothing while the store lives
// (the bytes are reachable through its descriptors only) and nothing after.
TEST_F(SwapStoreTest, FilesHaveNoNameWhileInUseAndNothingStaysAfter) {
  auto store = store_of(*engine_, {a_.path(), b_.path()});
  ASSERT_TRUE(store);
  for (const auto& file : store->files()) EXPECT_FALSE(std::filesystem::exists(file)) << file;
  EXPECT_TRUE(std::filesystem::is_empty(a_.path()));
  EXPECT_TRUE(std::filesystem::is_empty(b_.path()));
  for (const auto& fd : store->reopen_paths()) {
    struct stat st {};
    ASSERT_EQ(::stat(fd.c_str(), &st), 0) << fd;
    EXPECT_EQ(st.st_nlink, 0u) << "unlinked";
    EXPECT_GE(static_cast<std::uint64_t>(st.st_size), 4096 + 8 * kSlotBytes / 2) << "preallocated";
  }
  SlotId slot = *store->allocate();
  fill_random(out_.all(), 13);
  ASSERT_TRUE(store->write(slot, 1, out_.all()).ok());
  ASSERT_TRUE(store->read(slot, 1, back_.all()).ok());
  EXPECT_EQ(std::memcmp(out_.data(), back_.data(), kSlotBytes), 0);
  store.reset();
  EXPECT_TRUE(std::filesystem::is_empty(a_.path()));
  EXPECT_TRUE(std::filesystem::is_empty(b_.path()));
}

// The one swap file in `dir` (named: the keep_file_names hook), or an empty path.
std::filesystem::path only_swap_file(const std::filesystem::path& dir) {
  std::filesystem::path found;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().filename().string().rfind("strata-swap-", 0) == 0) found = e.path();
  }
  return found;
}

// The fork tests are not in SwapStoreTest: its engine's thread would make the
// parent multi-threaded at fork(), which ThreadSanitizer (rightly) refuses.
// A store's files have no name from creation (Note [Unlinked swap files]); the
// keep_file_names hook makes the named files a run killed between creating and
// unlinking them (or an older strata) leaves, which the reclaim still removes.
TEST(SwapStoreFork, StaleFilesOfACrashedRunAreReportedAndReclaimed) {
  TempDir a_;
  AlignedBuffer out_{kSlotBytes}, back_{kSlotBytes};
  // A child process writes a slot and dies without cleaning up.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto engine = make_io_engine({.kind = EngineKind::kPosix});
    if (!engine.ok()) ::_exit(1);
    auto store = SwapStore::create(
        **engine, {.dirs = {a_.path()}, .slot_bytes = kSlotBytes, .slots = 8, .keep_file_names = true});
    if (!store.ok()) ::_exit(2);
    SlotId slot = *(*store)->allocate();
    fill_random(out_.all(), 6);
    if (!(*store)->write(slot, 9, out_.all()).ok()) ::_exit(3);
    ::_exit(0);  // "crash": no destructors run, the file stays
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;
  auto stale = only_swap_file(a_.path());
  ASSERT_TRUE(std::filesystem::exists(stale));
  { std::ofstream(a_.path() / "strata-swap-3.swp") << "not a swap file"; }  // a foreign/garbled one

  LogCapture log;
  auto engine = engine_of(EngineKind::kUring);
  ASSERT_TRUE(engine);
  auto store = store_of(*engine, {a_.path()});
  ASSERT_TRUE(store);
  EXPECT_TRUE(log.contains("stale swap file " + stale.string())) << "the crashed run's file is reported";
  EXPECT_TRUE(log.contains("left by run")) << "with its header's run id";
  EXPECT_TRUE(log.contains("no strata swap header"));
  EXPECT_FALSE(std::filesystem::exists(a_.path() / "strata-swap-3.swp"));
  EXPECT_FALSE(std::filesystem::exists(stale));
  EXPECT_TRUE(std::filesystem::is_empty(a_.path()));
  // The old run's data is never read back: the same slot number holds nothing now.
  SlotId slot = *store->allocate();
  EXPECT_EQ(store->read(slot, 9, back_.all()).code(), StatusCode::kFailedPrecondition);
}

// Note [Lock of a killed run]: a swap file whose lock outlives the process named in
// its header (as an io_uring torn down after SIGKILL keeps it) is waited for and
// reclaimed, not taken for a live store's. Here a grandchild that inherited the
// child's descriptor holds the lock after the child is gone, until the parent
// closes a pipe 300 ms into its wait.
TEST(SwapStoreFork, ALockThatOutlivesItsExitedProcessIsWaitedFor) {
  TempDir a_;
  int release[2];
  ASSERT_EQ(::pipe(release), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(release[1]);
    auto engine = make_io_engine({.kind = EngineKind::kPosix});
    if (!engine.ok()) ::_exit(1);
    auto store = SwapStore::create(
        **engine, {.dirs = {a_.path()}, .slot_bytes = kSlotBytes, .slots = 2, .keep_file_names = true});
    if (!store.ok()) ::_exit(2);
    if (::fork() == 0) {  // the grandchild keeps the file (and its lock) open until the pipe closes
      char c;
      while (::read(release[0], &c, 1) > 0) {
      }
      ::_exit(0);
    }
    ::_exit(0);  // no destructors: the file and its lock stay
  }
  ::close(release[0]);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << wstatus;

  LogCapture log;
  auto engine = make_io_engine({.kind = EngineKind::kPosix});
  ASSERT_TRUE(engine.ok());
  std::thread releaser([&] {  // no fork() after this point
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    ::close(release[1]);
  });
  auto store = SwapStore::create(**engine, {.dirs = {a_.path()}, .slot_bytes = kSlotBytes, .slots = 2});
  releaser.join();
  ASSERT_TRUE(store.ok()) << store.status().to_string();
  EXPECT_TRUE(log.contains(fmt::format("still locked by pid {}, which has exited", pid)));
  EXPECT_TRUE(log.contains("stale swap file")) << "then reclaimed as a crashed run's";
}

// Two live stores share a directory (their files never meet), and a named file a
// live store holds (keep_file_names) is not reclaimed by the second.
TEST_F(SwapStoreTest, TwoLiveStoresShareADirectory) {
  auto first = SwapStore::create(
      *engine_, {.dirs = {a_.path()}, .slot_bytes = kSlotBytes, .slots = 2, .keep_file_names = true});
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  const auto named = only_swap_file(a_.path());
  ASSERT_FALSE(named.empty());
  auto second = SwapStore::create(*engine_, {.dirs = {a_.path()}, .slot_bytes = kSlotBytes, .slots = 2});
  ASSERT_TRUE(second.ok()) << second.status().to_string();
  EXPECT_TRUE(std::filesystem::exists(named)) << "a live store's file is kept";
  SlotId one = *(*first)->allocate(), two = *(*second)->allocate();
  fill_random(out_.all(), 8);
  ASSERT_TRUE((*first)->write(one, 1, out_.all()).ok());
  fill_random(back_.all(), 9);
  ASSERT_TRUE((*second)->write(two, 1, back_.all()).ok());
  AlignedBuffer check(kSlotBytes);
  ASSERT_TRUE((*first)->read(one, 1, check.all()).ok());
  EXPECT_EQ(std::memcmp(check.data(), out_.data(), kSlotBytes), 0);
  first.value().reset();
  EXPECT_FALSE(std::filesystem::exists(named)) << "removed by its store at destruction";
}

TEST_F(SwapStoreTest, BadDirectoriesGiveClearErrors) {
  auto missing =
      SwapStore::create(*engine_, {.dirs = {a_.path() / "nope"}, .slot_bytes = kSlotBytes, .slots = 1});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("does not exist"), std::string::npos);
  { std::ofstream(a_.path() / "plain") << "x"; }
  auto file =
      SwapStore::create(*engine_, {.dirs = {a_.path() / "plain"}, .slot_bytes = kSlotBytes, .slots = 1});
  EXPECT_EQ(file.status().code(), StatusCode::kInvalidArgument);
  auto twice =
      SwapStore::create(*engine_, {.dirs = {a_.path(), a_.path()}, .slot_bytes = kSlotBytes, .slots = 1});
  EXPECT_EQ(twice.status().code(), StatusCode::kInvalidArgument);
  auto odd = SwapStore::create(*engine_, {.dirs = {a_.path()}, .slot_bytes = 5000, .slots = 1});
  EXPECT_EQ(odd.status().code(), StatusCode::kInvalidArgument);
}

TEST(SwapStoreFork, UnwritableDirectoryIsPermissionDenied) {
  TempDir a_;
  auto locked = a_.path() / "locked";
  ASSERT_EQ(::mkdir(locked.c_str(), 0555), 0);
  ASSERT_EQ(::chmod(a_.path().c_str(), 0711), 0);
  // Root may write anywhere, so a root run checks from a child that drops to "nobody".
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) ::_exit(10);
    auto engine = make_io_engine({.kind = EngineKind::kPosix});
    if (!engine.ok()) ::_exit(11);
    auto store = SwapStore::create(**engine, {.dirs = {locked}, .slot_bytes = kSlotBytes, .slots = 1});
    if (store.ok()) ::_exit(12);
    if (store.status().code() != StatusCode::kPermissionDenied) ::_exit(13);
    ::_exit(store.status().message().find("not writable") == std::string::npos ? 14 : 0);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus)) << wstatus;
  if (WEXITSTATUS(wstatus) == 10)
    GTEST_SKIP() << "cannot drop root privileges to test an unwritable directory";
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "11 engine, 12 no error, 13 wrong code, 14 message";
}

TEST_F(SwapStoreTest, NotEnoughSpaceIsAnErrorUpFrontWithTheSizes) {
  auto store = SwapStore::create(*engine_, {.dirs = {a_.path()}, .slot_bytes = kTiB, .slots = 4096});
  ASSERT_FALSE(store.ok());
  EXPECT_EQ(store.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(store.status().message().find("swap needs 4.00 PiB"), std::string::npos)
      << store.status().to_string();
  EXPECT_NE(store.status().message().find("available"), std::string::npos);
  EXPECT_TRUE(std::filesystem::is_empty(a_.path())) << "nothing is created when the space check fails";
}

TEST(SwapStoreFork, FileSizeLimitMakesPreallocationFailWithNoSpace) {
  TempDir a_;
  // RLIMIT_FSIZE in a child stands in for a full disk without privileges: with
  // SIGXFSZ ignored, fallocate past the limit fails with EFBIG.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{1 * kMiB, 1 * kMiB};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(10);
    auto engine = make_io_engine({.kind = EngineKind::kPosix});
    if (!engine.ok()) ::_exit(11);
    auto store = SwapStore::create(**engine, {.dirs = {a_.path()}, .slot_bytes = kSlotBytes, .slots = 16});
    if (store.ok()) ::_exit(12);
    if (store.status().code() != StatusCode::kNoSpace) ::_exit(13);
    if (store.status().message().find("preallocating 4.00 MiB") == std::string::npos) ::_exit(14);
    ::_exit(std::filesystem::is_empty(a_.path()) ? 0 : 15);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus)) << wstatus;
  EXPECT_EQ(WEXITSTATUS(wstatus), 0)
      << "10 setrlimit, 11 engine, 12 no error, 13 wrong code, 14 message, 15 leftovers";
}

TEST_F(SwapStoreTest, MisalignedBufferAssertsInCheckedBuildsAndFailsOtherwise) {
  auto store = store_of(*engine_, {a_.path()});
  ASSERT_TRUE(store);
  SlotId slot = *store->allocate();
  auto misaligned = std::span<const std::byte>(out_.data() + 512, 4096);
  if (STRATA_CHECKED_BUILD) {
    ::testing::FLAGS_gtest_death_test_style = "threadsafe";
    EXPECT_DEATH((void)store->write(slot, 1, misaligned), "kSwapAlignmentBytes == 0");
  } else {
    EXPECT_EQ(store->write(slot, 1, misaligned).code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(store->write(slot, 1, out_.span(0, 100)).code(), StatusCode::kInvalidArgument);
  }
}

TEST(SwapStoreTmpfs, DevShmWorksWithDirectOrBufferedIo) {
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm here";
  TempDir dir("/dev/shm");
  auto engine = engine_of(EngineKind::kUring);
  ASSERT_TRUE(engine);
  LogCapture log;
  auto store = store_of(*engine, {dir.path()}, 2);
  ASSERT_TRUE(store);
  // Linux >= 6.6 accepts O_DIRECT on tmpfs; older kernels refuse it and the store
  // falls back to buffered I/O with a warning. Either way the data must round-trip.
  if (!store->direct_io()) {
    EXPECT_TRUE(log.contains("refuses O_DIRECT"));
  }
  AlignedBuffer out(kSlotBytes), back(kSlotBytes);
  fill_random(out.all(), 12);
  SlotId slot = *store->allocate();
  ASSERT_TRUE(store->write(slot, 3, out.all()).ok());
  ASSERT_TRUE(store->read(slot, 3, back.all()).ok());
  EXPECT_EQ(std::memcmp(out.data(), back.data(), kSlotBytes), 0);
}

}  // namespace
}  // namespace strata::offload
