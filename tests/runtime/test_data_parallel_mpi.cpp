// Data parallelism on the mpi backend: under `mpiexec -n W` (ctest: W = 2 and
// 4, label dp) every rank trains its 1/W of the batch and compares its params
// and states bit for bit with one rank holding the whole batch (which each
// process also runs, alone), with the states on the GPU (sim), on host and on
// NVMe; then a model mismatch between ranks is refused on every rank; and a
// checkpoint the ranks save loads on one rank and resumes bit-exact; LAMB (three
// tiers) and LARS match one rank bit for bit too.
#include <gtest/gtest.h>
#include <unistd.h>

#include <optional>

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

// #14: per-shard checkpoints on the mpi backend. The W ranks (each with its shard
// of every family's states) train two steps and save into one directory; then
// each process, alone, loads it on one rank and trains a step, and must match one
// rank that trained straight through (the batch in W parts, then whole); then the
// W ranks load it again and train a step (the batch in W parts throughout).
TEST(DataParallelMpiCheckpoint, SavedByTheRanksLoadsOnOneRankAndOnTheRanksAndResumesBitExact) {
  auto c = world();
  const int w = c->size();
  constexpr int kBefore = 2;
  // One directory for every rank: rank 0's, sent to the others.
  std::optional<ScratchDir> own;
  std::string path(512, '\0');
  if (c->rank() == 0) {
    own.emplace(scratch("ckpt"));
    const std::string p = own->path().string();
    ASSERT_LT(p.size(), path.size());
    std::copy(p.begin(), p.end(), path.begin());
  }
  auto sent = c->broadcast(path.data(), path.size(), 0);
  ASSERT_TRUE(sent.ok()) << sent.status();
  ASSERT_TRUE(sent->wait().ok());
  const std::string dir = path.c_str();
  const std::uint32_t states = 2;  // AdamW
  // This rank's runtime, one of the W, with the model registered.
  struct Rank {
    std::unique_ptr<memory::Device> device = testing::dp_device();
    Result<std::unique_ptr<Runtime>> rt = internal_error("not created");
    bench::DpModel m = testing::dp_model();
  };
  auto rank_runtime = [&](Rank& r) {
    RuntimeOptions o = testing::dp_options(Tier::kHost, "", w);
    o.comm = c;
    r.rt = Runtime::create(*r.device, std::move(o));
    ASSERT_TRUE(r.rt.ok()) << r.rt.status();
    ASSERT_TRUE(r.m.build(**r.rt).ok());
  };
  {
    Rank r;
    ASSERT_NO_FATAL_FAILURE(rank_runtime(r));
    auto& rt = r.rt;
    bench::DpModel& m = r.m;
    for (int s = 0; s < kBefore; ++s) {
      auto st = m.train_step(**rt, c->rank(), static_cast<std::size_t>(w));
      ASSERT_TRUE(st.ok()) << st.status();
    }
    Status saved = (*rt)->save_checkpoint(dir);
    ASSERT_TRUE(saved.ok()) << saved;
  }
  auto one_rank = [&](bool load) -> Result<bench::DpModel::Outcome> {
    auto device = testing::dp_device();
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt,
                            Runtime::create(*device, testing::dp_options(Tier::kHost, "")));
    bench::DpModel m = testing::dp_model();
    STRATA_RETURN_IF_ERROR(m.build(*rt));
    if (load) {
      STRATA_RETURN_IF_ERROR(rt->load_checkpoint(dir));
    } else {
      for (int s = 0; s < kBefore; ++s) STRATA_RETURN_IF_ERROR(m.train_step(*rt, -1, w).status());
    }
    STRATA_RETURN_IF_ERROR(m.train_step(*rt, -1, 1).status());
    return m.collect(*rt, states);
  };
  const auto straight = one_rank(false);
  const auto loaded = one_rank(true);
  ASSERT_TRUE(straight.ok()) << straight.status();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(straight->params, loaded->params) << "rank " << c->rank();
  EXPECT_EQ(straight->state0, loaded->state0) << "rank " << c->rank();
  EXPECT_EQ(straight->state1, loaded->state1) << "rank " << c->rank();
  // The same W ranks load it (each its shard of the states) and train a step with
  // their parts of the batch: one rank with the whole batch in W parts throughout.
  {
    Rank r;
    ASSERT_NO_FATAL_FAILURE(rank_runtime(r));
    auto& rt = r.rt;
    bench::DpModel& m = r.m;
    Status load = (*rt)->load_checkpoint(dir);
    ASSERT_TRUE(load.ok()) << load;
    auto st = m.train_step(**rt, c->rank(), static_cast<std::size_t>(w));
    ASSERT_TRUE(st.ok()) << st.status();
    auto got = m.collect(**rt, states);
    ASSERT_TRUE(got.ok()) << got.status();
    testing::DpResult reference;
    {
      auto ref_device = testing::dp_device();
      auto ref = Runtime::create(*ref_device, testing::dp_options(Tier::kHost, ""));
      ASSERT_TRUE(ref.ok()) << ref.status();
      bench::DpModel rm = testing::dp_model();
      ASSERT_TRUE(rm.build(**ref).ok());
      for (int s = 0; s <= kBefore; ++s) ASSERT_TRUE(rm.train_step(**ref, -1, w).ok());
      auto out = rm.collect(**ref, states);
      ASSERT_TRUE(out.ok()) << out.status();
      reference.params = out->params;
      reference.state0 = out->state0;
      reference.state1 = out->state1;
    }
    testing::DpResult mine;
    mine.params = got->params;
    mine.state0 = got->state0;
    mine.state1 = got->state1;
    mine.state_first = got->state_first;
    mine.state_count = got->state_count;
    testing::expect_bit_identical(reference, mine, c->rank());
  }
  // Rank 0 removes the directory only once every rank has read it.
  std::vector<double> done{0.0};
  auto all = c->all_reduce(done, comm::ReduceOp::kMax);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_TRUE(all->wait().ok());
  // (A ScratchDir removes only an empty directory; this one holds the checkpoint.)
  if (own) {
    std::error_code ec;
    std::filesystem::remove_all(own->path(), ec);
    EXPECT_FALSE(std::filesystem::exists(own->path())) << own->path() << " left behind";
  }
}

// #14 follow-up: LAMB with W > 1 on the mpi backend (the per-tensor norms
// all-reduced from the pool thread that runs a family's kernel): bit-identical
// to one rank's run (Note [Sharded step], Note [Exact norms]).
TEST(DataParallelMpiTrust, LambAndLarsRanksMatchOneRankBitForBit) {
  auto c = world();
  const int w = c->size();
  const std::pair<kernels::Optimizer, Tier> cases[] = {{kernels::Optimizer::kLamb, Tier::kGpu},
                                                       {kernels::Optimizer::kLamb, Tier::kHost},
                                                       {kernels::Optimizer::kLamb, Tier::kNvme},
                                                       {kernels::Optimizer::kLars, Tier::kHost}};
  for (const auto& [optimizer, tier] : cases) {
    SCOPED_TRACE(fmt::format("{} on {}", kernels::optimizer_name(optimizer), tier_name(tier)));
    ScratchDir single_dir = scratch("trust-single"), rank_dir = scratch("trust-rank");
    RuntimeOptions so = testing::dp_options(tier, single_dir.path().string());
    testing::use_trust_optimizer(so, optimizer);
    const testing::DpResult single = testing::dp_train(std::move(so), -1, w);
    testing::expect_trained(single);
    RuntimeOptions o = testing::dp_options(tier, rank_dir.path().string(), w);
    testing::use_trust_optimizer(o, optimizer);
    o.comm = c;
    const testing::DpResult mine = testing::dp_train(std::move(o), c->rank(), w);
    testing::expect_bit_identical(single, mine, c->rank());
    EXPECT_EQ(testing::max_ulps_from_one_rank(single, mine), 0.0) << "rank " << c->rank();
  }
}

}  // namespace
}  // namespace strata::runtime
