// Data parallelism on the mpi backend: under `mpiexec -n W` (ctest: W = 2 and
// 4, label dp) every rank trains its 1/W of the batch and compares its params
// and states bit for bit with one rank holding the whole batch (which each
// process also runs, alone), with the states on the GPU (sim), on host and on
// NVMe; then a model mismatch between ranks is refused on every rank.
#include <gtest/gtest.h>
#include <unistd.h>

#include "dp_harness.hpp"
#include "strata/comm/mpi.hpp"
#include "strata/common/scratch_dir.hpp"

namespace strata::runtime {
namespace {

std::shared_ptr<comm::Communicator> world() {
  static std::shared_ptr<comm::Communicator> c = [] {
    auto r = comm::make_mpi_communicator({.timeout = std::chrono::milliseconds(120000)});
    if (!r.ok()) {
      fmt::print(stderr, "test_data_parallel_mpi: {}\n", r.status());
      std::abort();
    }
    return std::shared_ptr<comm::Communicator>(std::move(r).value());
  }();
  return c;
}

ScratchDir scratch(const std::string& name) {
  auto d = ScratchDir::create(std::filesystem::temp_directory_path(),
                              fmt::format("strata-dpmpi-{}-{}", ::getpid(), name));
  EXPECT_TRUE(d.ok()) << d.status();
  return std::move(d).value();
}

class DataParallelMpi : public ::testing::TestWithParam<Tier> {};

TEST_P(DataParallelMpi, RanksMatchOneRankWithTheWholeBatch) {
  const Tier tier = GetParam();
  auto c = world();
  const int w = c->size();
  ScratchDir single_dir = scratch("single"), rank_dir = scratch("rank");
  const testing::DpResult single =
      testing::dp_train(testing::dp_options(tier, single_dir.path().string()), -1, w);
  testing::expect_trained(single);
  RuntimeOptions o = testing::dp_options(tier, rank_dir.path().string(), w);
  o.comm = c;
  const testing::DpResult mine = testing::dp_train(std::move(o), c->rank(), w);
  testing::expect_bit_identical(single, mine, c->rank());
  if (w > 1) {
    EXPECT_LT(mine.state_bytes, single.state_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(Tiers, DataParallelMpi, ::testing::Values(Tier::kGpu, Tier::kHost, Tier::kNvme),
                         [](const auto& p) { return std::string(tier_name(p.param)); });

TEST(DataParallelMpiMismatch, AModelMismatchIsRefusedOnEveryRank) {
  auto c = world();
  if (c->size() < 2) GTEST_SKIP() << "needs two ranks";
  RuntimeOptions o = testing::dp_options(Tier::kHost, "");
  o.comm = c;
  bench::DpModel m = testing::dp_model();
  if (c->rank() == c->size() - 1) m.numels[4] = 2001;
  auto device = testing::dp_device();
  auto rt = Runtime::create(*device, std::move(o));
  ASSERT_TRUE(rt.ok()) << rt.status();
  Status s = m.build(**rt);
  EXPECT_EQ(s, StatusCode::kFailedPrecondition);
  if (c->rank() == c->size() - 1) {
    EXPECT_NE(s.message().find("shape [2001]"), std::string::npos) << s;
  } else {
    EXPECT_NE(s.message().find(fmt::format("rank(s) {} have a model", c->size() - 1)), std::string::npos)
        << s;
  }
}

}  // namespace
}  // namespace strata::runtime
