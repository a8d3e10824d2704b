// IoEngine: every implementation (uring, posix) runs the same round trips on
// real files, O_DIRECT and buffered, with and without fixed buffers.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <functional>
#include <thread>
#include <tuple>
#include <vector>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/offload/io_engine.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::open_file;
using testing::TempDir;

struct EngineCase {
  EngineKind kind;
  bool direct;
  bool fixed_buffers;
};

std::string case_name(const ::testing::TestParamInfo<EngineCase>& info) {
  std::string name = info.param.kind == EngineKind::kUring ? "uring" : "posix";
  name += info.param.direct ? "_direct" : "_buffered";
  if (info.param.fixed_buffers) name += "_fixed";
  return name;
}

class IoEngineTest : public ::testing::TestWithParam<EngineCase> {
 protected:
  static constexpr std::size_t kFileBytes = 24 * kMiB;

  void SetUp() override {
    fd_ = open_file(dir_.path() / "data", GetParam().direct);
    ASSERT_GE(fd_, 0) << "open: " << std::strerror(errno);
    ASSERT_EQ(::fallocate(fd_, 0, 0, kFileBytes), 0) << std::strerror(errno);
  }
  void TearDown() override {
    if (fd_ >= 0) ::close(fd_);
  }

  IoEngineOptions options(std::uint32_t queue_depth = 8, std::uint32_t request_bytes = 256 * 1024) {
    IoEngineOptions o;
    o.kind = GetParam().kind;
    o.queue_depth = queue_depth;
    o.request_bytes = request_bytes;
    o.requests_in_flight_max = 16;
    if (GetParam().fixed_buffers) o.fixed_buffer_regions = {buffer_.all()};
    return o;
  }

  std::unique_ptr<IoEngine> make(IoEngineOptions o) {
    auto engine = make_io_engine(std::move(o));
    EXPECT_TRUE(engine.ok()) << engine.status().to_string();
    if (!engine.ok()) return nullptr;
    EXPECT_EQ((*engine)->name(), GetParam().kind == EngineKind::kUring ? "uring" : "posix");
    return std::move(engine).value();
  }

  TempDir dir_;
  int fd_ = -1;
  AlignedBuffer buffer_{16 * kMiB};
};

TEST_P(IoEngineTest, RoundTripsRandomDataForManySizesAndOffsets) {
  auto engine = make(options());
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok()) << file.status().to_string();

  // (size, file offset, buffer offset): single and multi-piece, piece-straddling, odd multiples of 4 KiB.
  const std::vector<std::tuple<std::size_t, std::uint64_t, std::size_t>> cases = {
      {4096, 0, 0},
      {8192, 4096, 4096},
      {12288, 1 * kMiB, 8192},
      {256 * 1024, 0, 0},
      {260 * 1024, 5 * kMiB, 0},
      {1 * kMiB, 3 * 4096, 12 * 4096},
      {3 * kMiB + 4096, 7 * kMiB, 4096},
      {5 * kMiB, 16 * kMiB, 1 * kMiB},
  };
  AlignedBuffer back(8 * kMiB);
  std::uint64_t seed = 1;
  for (auto [size, offset, buffer_offset] : cases) {
    SCOPED_TRACE(::testing::Message() << "size " << size << " offset " << offset);
    auto out = buffer_.span(buffer_offset, size);
    fill_random(out, seed++);
    ASSERT_TRUE(submit_and_wait(*engine, {IoOp::kWrite, *file, offset, out, {}}).ok());
    auto in = back.span(0, size);
    std::memset(in.data(), 0, size);
    Status read = submit_and_wait(*engine, {IoOp::kRead, *file, offset, in, {}});
    ASSERT_TRUE(read.ok()) << read.to_string();
    ASSERT_EQ(std::memcmp(in.data(), out.data(), size), 0);
  }
  IoEngineStats stats = engine->stats();
  EXPECT_GT(stats.pieces_submitted, cases.size());  // large requests were split
  if (GetParam().fixed_buffers && GetParam().kind == EngineKind::kUring) {
    EXPECT_GT(stats.fixed_buffer_pieces, 0u);  // writes came from the registered region
  } else {
    EXPECT_EQ(stats.fixed_buffer_pieces, 0u);
  }
  EXPECT_TRUE(engine->unregister_file(*file).ok());
}

TEST_P(IoEngineTest, BatchOfManyRequestsWithBackPressure) {
  auto o = options(4, 64 * 1024);
  o.requests_in_flight_max = 3;  // far fewer than the batch: submit() must block and resume
  auto engine = make(std::move(o));
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  constexpr std::size_t kBlock = 128 * 1024;
  constexpr std::size_t kBlocks = 64;
  fill_random(buffer_.span(0, kBlock * kBlocks), 42);
  IoGroup group;
  std::vector<IoRequest> batch;
  for (std::size_t i = 0; i < kBlocks; ++i) {
    batch.push_back({IoOp::kWrite, *file, i * kBlock, buffer_.span(i * kBlock, kBlock), group.add()});
  }
  ASSERT_TRUE(engine->submit(batch).ok());
  ASSERT_TRUE(group.wait().ok());
  AlignedBuffer back(kBlock * kBlocks);
  batch.clear();
  for (std::size_t i = 0; i < kBlocks; ++i) {
    batch.push_back({IoOp::kRead, *file, i * kBlock, back.span(i * kBlock, kBlock), group.add()});
  }
  ASSERT_TRUE(engine->submit(batch).ok());
  ASSERT_TRUE(group.wait().ok());
  EXPECT_EQ(std::memcmp(back.data(), buffer_.data(), kBlock * kBlocks), 0);
  EXPECT_EQ(engine->stats().requests_completed, 2 * kBlocks);
}

TEST_P(IoEngineTest, ManyConcurrentReadersAndWriters) {
  auto engine = make(options(8, 64 * 1024));
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  constexpr int kThreads = 6;
  constexpr std::size_t kRegion = 2 * kMiB;  // per thread, in the file and in buffer_
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      AlignedBuffer back(kRegion);
      auto out = buffer_.span(t * kRegion, kRegion);
      for (int round = 0; round < 4; ++round) {
        fill_random(out, 1000 * t + round);
        std::uint64_t offset = t * kRegion;
        if (!submit_and_wait(*engine, {IoOp::kWrite, *file, offset, out, {}}).ok()) ++failures;
        auto read = submit_future(*engine, {IoOp::kRead, *file, offset, back.all(), {}});
        if (!read.get().ok()) ++failures;
        if (std::memcmp(back.data(), out.data(), kRegion) != 0) ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_P(IoEngineTest, ACallbackMaySubmitTheNextRequestWithoutBlocking) {
  auto o = options(4, 64 * 1024);
  o.requests_in_flight_max =
      1;  // full while the one request is out: only the freed slot lets the chain go on
  auto engine = make(std::move(o));
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  constexpr int kSteps = 32;
  fill_random(buffer_.span(0, kSteps * 128 * 1024), 77);
  IoGroup group;
  std::function<void(int)> step = [&](int i) {
    IoCallback done = group.add();
    Status submitted = engine->submit_one({IoOp::kWrite, *file, i * 128 * 1024ull,
                                           buffer_.span(i * 128 * 1024, 128 * 1024), [&, i, done](Status s) {
                                             if (s.ok() && i + 1 < kSteps) step(i + 1);
                                             done(std::move(s));
                                           }});
    if (!submitted.ok()) group.cancel_one();
  };
  step(0);
  ASSERT_TRUE(group.wait().ok());
  EXPECT_EQ(engine->stats().requests_completed, static_cast<std::uint64_t>(kSteps));
  AlignedBuffer back(kSteps * 128 * 1024);
  ASSERT_TRUE(submit_and_wait(*engine, {IoOp::kRead, *file, 0, back.all(), {}}).ok());
  EXPECT_EQ(std::memcmp(back.data(), buffer_.data(), back.size()), 0);
}

TEST_P(IoEngineTest, ReadPastEndOfFileIsAnIoError) {
  auto engine = make(options());
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data-file");
  ASSERT_TRUE(file.ok());
  Status status = submit_and_wait(*engine, {IoOp::kRead, *file, kFileBytes, buffer_.span(0, 8192), {}});
  EXPECT_EQ(status.code(), StatusCode::kIoError) << status.to_string();
  EXPECT_NE(status.message().find("data-file"), std::string::npos) << status.to_string();
  EXPECT_NE(status.message().find("end of file"), std::string::npos) << status.to_string();
}

TEST_P(IoEngineTest, BadRequestsAreRefusedWithoutCallbacks) {
  auto engine = make(options());
  ASSERT_TRUE(engine);
  bool called = false;
  Status unregistered =
      engine->submit_one({IoOp::kRead, 7, 0, buffer_.span(0, 4096), [&](Status) { called = true; }});
  EXPECT_EQ(unregistered.code(), StatusCode::kInvalidArgument);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  Status empty = engine->submit_one({IoOp::kRead, *file, 0, {}, [&](Status) { called = true; }});
  EXPECT_EQ(empty.code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(called);
}

TEST_P(IoEngineTest, MisalignedRequestAssertsInCheckedBuildsAndFailsOtherwise) {
  auto engine = make(options());
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  IoRequest misaligned{IoOp::kWrite, *file, 512, buffer_.span(0, 4096), {}};
  if (STRATA_CHECKED_BUILD) {
    ::testing::FLAGS_gtest_death_test_style = "threadsafe";
    EXPECT_DEATH((void)engine->submit_one(misaligned), "offset_bytes % alignment == 0");
  } else {
    Status status = engine->submit_one(misaligned);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(status.message().find("alignment_bytes=4096"), std::string::npos) << status.to_string();
  }
}

TEST_P(IoEngineTest, ShutdownCancelCompletesEveryRequestOnce) {
  auto o = options(2, 4096);
  o.requests_in_flight_max = 64;
  auto engine = make(std::move(o));
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  constexpr int kRequests = 64;
  std::atomic<int> ok{0}, cancelled{0}, other{0};
  std::vector<IoRequest> batch;
  for (int i = 0; i < kRequests; ++i) {
    batch.push_back({IoOp::kWrite, *file, i * 256 * 1024ull, buffer_.span(0, 256 * 1024), [&](Status s) {
                       if (s.ok())
                         ++ok;
                       else if (s.code() == StatusCode::kCancelled)
                         ++cancelled;
                       else
                         ++other;
                     }});
  }
  ASSERT_TRUE(engine->submit(batch).ok());
  engine->shutdown(ShutdownMode::kCancel);
  EXPECT_EQ(ok + cancelled, kRequests);
  EXPECT_EQ(other.load(), 0);
  EXPECT_GT(cancelled.load(), 0);  // 64 x 64 pieces at depth 2 cannot all be done yet
  Status after = engine->submit_one({IoOp::kRead, *file, 0, buffer_.span(0, 4096), {}});
  EXPECT_EQ(after.code(), StatusCode::kFailedPrecondition);
  engine->shutdown(ShutdownMode::kDrain);  // idempotent
}

TEST_P(IoEngineTest, ShutdownDrainFinishesEverything) {
  auto engine = make(options(2, 64 * 1024));
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  std::atomic<int> ok{0};
  std::vector<IoRequest> batch;
  for (int i = 0; i < 16; ++i) {
    batch.push_back({IoOp::kWrite, *file, i * kMiB, buffer_.span(0, kMiB), [&](Status s) { ok += s.ok(); }});
  }
  ASSERT_TRUE(engine->submit(batch).ok());
  engine->shutdown(ShutdownMode::kDrain);
  EXPECT_EQ(ok.load(), 16);
}

TEST_P(IoEngineTest, ShortTransfersAndEintrAreRetriedForTheRemainder) {
  auto o = options(4, 64 * 1024);
  std::atomic<int> calls{0};
  o.result_filter = [&](const IoSite&, std::int64_t result) -> std::int64_t {
    int n = calls++;
    if (n % 3 == 0) return -EINTR;
    if (n % 3 == 1 && result > 4096) return 4096;  // short: one block only
    return result;
  };
  auto engine = make(std::move(o));
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data");
  ASSERT_TRUE(file.ok());
  auto out = buffer_.span(0, kMiB);
  fill_random(out, 9);
  ASSERT_TRUE(submit_and_wait(*engine, {IoOp::kWrite, *file, 0, out, {}}).ok());
  AlignedBuffer back(kMiB);
  ASSERT_TRUE(submit_and_wait(*engine, {IoOp::kRead, *file, 0, back.all(), {}}).ok());
  EXPECT_EQ(std::memcmp(back.data(), out.data(), kMiB), 0);
  IoEngineStats stats = engine->stats();
  EXPECT_GT(stats.short_transfers_retried, 0u);
  EXPECT_GT(stats.eagain_eintr_retried, 0u);
}

TEST_P(IoEngineTest, EioSurfacesAsIoErrorNamingFileAndOffset) {
  auto o = options();
  o.result_filter = [](const IoSite& site, std::int64_t result) -> std::int64_t {
    return site.offset_bytes == 2 * kMiB ? -EIO : result;
  };
  auto engine = make(std::move(o));
  ASSERT_TRUE(engine);
  auto file = engine->register_file(fd_, "data-eio");
  ASSERT_TRUE(file.ok());
  Status status = submit_and_wait(*engine, {IoOp::kRead, *file, 2 * kMiB, buffer_.span(0, 4096), {}});
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find("data-eio"), std::string::npos) << status.to_string();
  EXPECT_NE(status.message().find("2097152"), std::string::npos) << status.to_string();
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineTest,
                         ::testing::Values(EngineCase{EngineKind::kUring, true, true},
                                           EngineCase{EngineKind::kUring, true, false},
                                           EngineCase{EngineKind::kUring, false, false},
                                           EngineCase{EngineKind::kPosix, true, false},
                                           EngineCase{EngineKind::kPosix, false, false}),
                         case_name);

// Buffered files accept any alignment when the engine is told so.
TEST(IoEngineBuffered, ByteGranularRoundTrips) {
  TempDir dir;
  int fd = open_file(dir.path() / "bytes", false);
  ASSERT_GE(fd, 0);
  for (EngineKind kind : {EngineKind::kUring, EngineKind::kPosix}) {
    auto engine =
        make_io_engine({.kind = kind, .queue_depth = 3, .request_bytes = 1000, .alignment_bytes = 1});
    ASSERT_TRUE(engine.ok()) << engine.status().to_string();
    auto file = (*engine)->register_file(fd, "bytes");
    ASSERT_TRUE(file.ok());
    std::vector<std::byte> out(12400), back(12400);
    for (std::size_t size : {1, 7, 999, 1001, 12344}) {  // odd sizes, odd offsets, odd buffer addresses
      fill_random({out.data() + 1, size}, size);
      std::uint64_t offset = 3 * size + 1;
      ASSERT_TRUE(submit_and_wait(**engine, {IoOp::kWrite, *file, offset, {out.data() + 1, size}, {}}).ok());
      ASSERT_TRUE(submit_and_wait(**engine, {IoOp::kRead, *file, offset, {back.data() + 3, size}, {}}).ok());
      EXPECT_EQ(std::memcmp(back.data() + 3, out.data() + 1, size), 0) << "size " << size;
    }
  }
  ::close(fd);
}

TEST(IoEngineOptions, BadSettingsNameTheSetting) {
  auto zero_depth = make_io_engine({.queue_depth = 0});
  ASSERT_FALSE(zero_depth.ok());
  EXPECT_NE(zero_depth.status().message().find("queue_depth"), std::string::npos);
  auto odd_request = make_io_engine({.request_bytes = 5000});
  ASSERT_FALSE(odd_request.ok());
  EXPECT_NE(odd_request.status().message().find("request_bytes=5000"), std::string::npos);
}

}  // namespace
}  // namespace strata::offload
