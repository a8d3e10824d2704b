// The local backend: every collective on W threads (W = 1, 2, 3, 4), checked
// bit for bit against rank-ordered sums; peer failure (a rank that never
// arrives, one that leaves, an abort), mismatched collectives, bad arguments.
// Runs under TSan (label unit).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "comm/collective_checks.hpp"
#include "strata/comm/local.hpp"

namespace strata::comm {
namespace {

using Group = std::vector<std::unique_ptr<Communicator>>;

Group make_group(int w, CommOptions o = {}) {
  auto g = make_local_group(w, o);
  EXPECT_TRUE(g.ok()) << g.status();
  return std::move(g).value();
}

//! Runs fn(rank's communicator) on one thread per rank.
template <typename Fn>
void on_every_rank(Group& g, Fn fn) {
  std::vector<std::thread> threads;
  for (auto& c : g) threads.emplace_back([&fn, &c] { fn(*c); });
  for (auto& t : threads) t.join();
}

class LocalCollectives : public ::testing::TestWithParam<int> {};

TEST_P(LocalCollectives, EveryCollectiveMatchesTheRankOrderedReference) {
  Group g = make_group(GetParam());
  on_every_rank(g, [](Communicator& c) { testing::check_all_collectives(c); });
}

TEST_P(LocalCollectives, CountsTheBytesEachRankSends) {
  const int w = GetParam();
  Group g = make_group(w);
  on_every_rank(g, [w](Communicator& c) {
    std::vector<float> send(static_cast<std::size_t>(w) * 256), recv(256),
        full(static_cast<std::size_t>(w) * 256);
    ASSERT_TRUE(c.reduce_scatter(send.data(), recv.data(), 256, DType::kF32)->wait().ok());
    ASSERT_TRUE(c.all_gather(recv.data(), full.data(), 256, DType::kF32)->wait().ok());
    const CommStats s = c.stats();
    // A slice of 1 KiB goes to each of the W - 1 others, in each direction.
    EXPECT_EQ(1024u * static_cast<std::uint64_t>(w - 1), s.reduce_scatter_bytes);
    EXPECT_EQ(1024u * static_cast<std::uint64_t>(w - 1), s.all_gather_bytes);
    EXPECT_EQ(2u, s.collectives);
  });
}

// #14: reduce_scatter in place (recv = send + rank * count, NCCL's form, which
// the runtime's device-buffer path uses) gives the same bits as out of place.
TEST_P(LocalCollectives, ReduceScatterInPlaceMatchesOutOfPlace) {
  const int w = GetParam();
  Group g = make_group(w);
  on_every_rank(g, [w](Communicator& c) {
    constexpr std::size_t n = 300;
    std::vector<float> send(static_cast<std::size_t>(w) * n), recv(n);
    for (std::size_t i = 0; i < send.size(); ++i)
      send[i] = 1.0f / static_cast<float>(i + 1) + 0.37f * static_cast<float>(c.rank() + 1);
    std::vector<float> in_place = send;
    float* mine = in_place.data() + static_cast<std::size_t>(c.rank()) * n;
    ASSERT_TRUE(c.reduce_scatter(send.data(), recv.data(), n, DType::kF32)->wait().ok());
    ASSERT_TRUE(c.reduce_scatter(in_place.data(), mine, n, DType::kF32)->wait().ok());
    EXPECT_EQ(0, std::memcmp(recv.data(), mine, n * 4)) << "rank " << c.rank();
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, LocalCollectives, ::testing::Values(1, 2, 3, 4));

TEST(LocalComm, ARankThatNeverArrivesFailsTheOthersWithinTheTimeout) {
  Group g = make_group(3, {.timeout = std::chrono::milliseconds(200)});
  std::vector<Status> got(3);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {  // rank 2 hangs: it never issues the collective
    threads.emplace_back([&, r] {
      std::vector<double> v{1.0};
      auto h = g[static_cast<std::size_t>(r)]->all_reduce(v, ReduceOp::kSum);
      got[static_cast<std::size_t>(r)] = h.ok() ? h->wait() : h.status();
    });
  }
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 5.0);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[static_cast<std::size_t>(r)], StatusCode::kUnavailable);
    // (On a loaded machine the other arriving rank may be late too: "rank(s) 1, 2".)
    EXPECT_NE(got[static_cast<std::size_t>(r)].message().find("2 did not join it within 200 ms"),
              std::string::npos)
        << got[static_cast<std::size_t>(r)];
  }
  // The group is failed: the late rank's call fails at once, with the first error.
  std::vector<double> v{1.0};
  EXPECT_EQ(g[2]->all_reduce(v, ReduceOp::kSum).status(), StatusCode::kUnavailable);
}

TEST(LocalComm, ARankThatLeavesMidStepFailsTheOthersAtOnce) {
  Group g = make_group(2, {.timeout = std::chrono::milliseconds(60000)});
  Status got;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread waiter([&] {
    std::vector<float> send(8), recv(4);
    auto h = g[0]->reduce_scatter(send.data(), recv.data(), 4, DType::kF32);
    got = h.ok() ? h->wait() : h.status();
  });
  std::thread dies([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    g[1].reset();  // rank 1 "dies" mid-step: its communicator goes away
  });
  waiter.join();
  dies.join();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  EXPECT_EQ(got, StatusCode::kUnavailable);
  EXPECT_NE(got.message().find("rank(s) 1 left the group"), std::string::npos) << got;
}

TEST(LocalComm, AbortFailsEveryWaiter) {
  Group g = make_group(2);
  Status got;
  std::thread waiter([&] {
    std::vector<double> v{1.0};
    auto h = g[0]->all_reduce(v, ReduceOp::kMax);
    got = h.ok() ? h->wait() : h.status();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  g[1]->abort("rank 1 found a NaN in its loss");
  waiter.join();
  EXPECT_EQ(got, StatusCode::kUnavailable);
  EXPECT_NE(got.message().find("found a NaN"), std::string::npos) << got;
}

TEST(LocalComm, MismatchedCollectivesAreRefusedNamingBoth) {
  Group g = make_group(2, {.timeout = std::chrono::milliseconds(2000)});
  std::vector<Status> got(2);
  on_every_rank(g, [&](Communicator& c) {
    std::vector<float> send(16), recv(8);
    const std::size_t n = c.rank() == 0 ? 8 : 4;  // rank 1 disagrees on the count
    auto h = c.reduce_scatter(send.data(), recv.data(), n, DType::kF32);
    got[static_cast<std::size_t>(c.rank())] = h.ok() ? h->wait() : h.status();
  });
  bool named = false;
  for (const Status& s : got) {
    EXPECT_FALSE(s.ok());
    named = named || s.message().find("differs between ranks") != std::string::npos;
  }
  EXPECT_TRUE(named) << got[0] << " / " << got[1];
}

TEST(LocalComm, BadArgumentsAreRefusedBeforeAnythingMoves) {
  Group g = make_group(1);
  Communicator& c = *g[0];
  std::vector<float> buf(8);
  EXPECT_EQ(c.reduce_scatter(nullptr, buf.data(), 4, DType::kF32).status(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.reduce_scatter(buf.data(), buf.data() + 1, 4, DType::kF32).status(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(c.all_gather(buf.data() + 1, buf.data(), 4, DType::kF32).status(), StatusCode::kInvalidArgument);
  EXPECT_EQ(c.broadcast(buf.data(), 4, 1).status(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_local_group(0).status(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_local_group(2, {.timeout = std::chrono::milliseconds(0)}).status(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Handle().wait(), StatusCode::kFailedPrecondition);
}

// One DType (common/dtype.hpp, #26): kNone, a kernel span's "absent", is refused by
// name, never read as fp32 (as the runtime's comm_dtype once mapped it).
TEST(LocalComm, ACollectiveOfDTypeNoneIsRefusedNamingIt) {
  Group g = make_group(1);
  Communicator& c = *g[0];
  std::vector<float> buf(8);
  auto expect_refused = [](const Result<Handle>& started) {
    ASSERT_EQ(started.status(), StatusCode::kInvalidArgument);
    EXPECT_NE(started.status().message().find("chunk collectives move fp32, bf16 or fp16"), std::string::npos)
        << started.status();
  };
  expect_refused(c.reduce_scatter(buf.data(), buf.data(), 4, DType::kNone));
  expect_refused(c.all_gather(buf.data(), buf.data(), 4, DType::kNone));
  expect_refused(c.reduce_scatter(buf.data(), buf.data(), 4, static_cast<DType>(7)));
  EXPECT_NE(c.all_gather(buf.data(), buf.data(), 4, DType::kNone).status().message().find("dtype none"),
            std::string::npos);
  EXPECT_EQ(c.stats().collectives, 0u) << "a refused collective started";
}

TEST(CommDType, HalfConversionsRoundToNearestEven) {
  EXPECT_EQ(0x3f80, to_bf16(1.0f));
  EXPECT_EQ(1.0f, from_bf16(to_bf16(1.0f)));
  EXPECT_EQ(0x3f80, to_bf16(1.00390625f));  // halfway 0x3f80|0x3f81: to even
  EXPECT_EQ(0x3c00, to_f16(1.0f));
  EXPECT_EQ(65504.0f, from_f16(to_f16(65504.0f)));
  EXPECT_TRUE(std::isnan(from_bf16(to_bf16(std::nanf("")))));
  // A rank-ordered bf16 sum rounds after each addition, as sequential accumulation does.
  const std::uint16_t a = to_bf16(256.0f), b = to_bf16(1.0f), c = to_bf16(1.0f);
  std::vector<const void*> src{&a, &b, &c};
  std::uint16_t out = 0;
  sum_in_rank_order(src, &out, 1, DType::kBF16);
  EXPECT_EQ(256.0f, from_bf16(out));  // (256 + 1) rounds to 256, then again: not 258
}

}  // namespace
}  // namespace strata::comm
