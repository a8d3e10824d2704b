// The mpi backend: every collective under `mpiexec -n W` (ctest runs W = 2 and
// 4, label dp), checked bit for bit against rank-ordered sums, in
// deterministic mode and (fp32 reduce-scatter, scalar sums) MPI's own reductions.
#include <gtest/gtest.h>

#include "comm/collective_checks.hpp"
#include "strata/comm/mpi.hpp"

namespace strata::comm {
namespace {

Communicator& world() {
  static std::unique_ptr<Communicator> c = [] {
    auto r = make_mpi_communicator({.timeout = std::chrono::milliseconds(60000)});
    if (!r.ok()) {
      ADD_FAILURE() << r.status();
      std::abort();
    }
    return std::move(r).value();
  }();
  return *c;
}

TEST(MpiComm, RunsUnderALauncher) {
  if (!launched_by_mpi())
    GTEST_SKIP() << "not started by mpiexec (ctest starts it with mpiexec -n 2 and -n 4)";
  EXPECT_EQ("mpi", world().backend());
  EXPECT_GE(world().size(), 1);
}

TEST(MpiComm, EveryCollectiveMatchesTheRankOrderedReference) {
  testing::check_all_collectives(world());
  EXPECT_GT(world().stats().collectives, 0u);
}

TEST(MpiComm, NonDeterministicModeSumsToo) {
  static auto fast =
      make_mpi_communicator({.timeout = std::chrono::milliseconds(60000), .deterministic = false});
  ASSERT_TRUE(fast.ok()) << fast.status();
  Communicator& c = **fast;
  const int w = c.size();
  // Small integers: every order of summation gives the same float.
  std::vector<float> send(static_cast<std::size_t>(w) * 64), recv(64);
  for (std::size_t i = 0; i < send.size(); ++i)
    send[i] = static_cast<float>(i % 17 + static_cast<std::size_t>(c.rank()));
  ASSERT_TRUE(c.reduce_scatter(send.data(), recv.data(), 64, DType::kF32)->wait().ok());
  for (std::size_t i = 0; i < 64; ++i) {
    const std::size_t j = static_cast<std::size_t>(c.rank()) * 64 + i;
    EXPECT_EQ(static_cast<float>(w * static_cast<int>(j % 17) + w * (w - 1) / 2), recv[i]);
  }
  std::vector<double> v{1.0};
  ASSERT_TRUE(c.all_reduce(v, ReduceOp::kSum)->wait().ok());
  EXPECT_EQ(static_cast<double>(w), v[0]);
}

}  // namespace
}  // namespace strata::comm
