// The one rate measurer (runtime/rates/, Note [One rate measurer]): each
// measurement sets its fields of runtime::Rates and only those, the disk passes
// leave no file and honour their bounds, bad options are refused before anything
// runs. Links strata_rates alone: the link fails if it comes to need the runtime.
// The copies under the sim device's throttle are tests/bench/test_step_rates.cpp's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/rates/rate_measurer.hpp"

namespace strata::rates {
namespace {

namespace fs = std::filesystem;

class RateMeasurerDisk : public ::testing::Test {
 protected:
  void SetUp() override {
    // One directory a process: ctest runs each case as a process of its own, in parallel, and a
    // case's fixture removes its directory when it ends.
    auto d = ScratchDir::create(fs::temp_directory_path(),
                                "strata-test-rate-measurer-" + std::to_string(::getpid()));
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    dir_.emplace(std::move(*d));
  }
  DiskOptions options(MixedPass mixed) const {
    return {.dir = dir_->path(),
            .slot_bytes = kMiB,
            .slots = 8,
            .in_flight = 4,
            .statistic = Statistic::kMedian,
            .rounds = 1,
            .mixed = mixed,
            .context = "test disk"};
  }
  std::optional<ScratchDir> dir_;
};

TEST_F(RateMeasurerDisk, InterleavedPassHoldsAtEveryFamilySize) {
  RateMeasurer m;
  auto facts = m.measure_disk(options(MixedPass::kInterleaved));
  ASSERT_TRUE(facts.ok()) << facts.status().to_string();
  EXPECT_FALSE(facts->engine.empty());
  EXPECT_EQ(facts->bytes_tested, 8 * kMiB);  // no time bound: every slot
  const runtime::Rates& r = m.rates();
  EXPECT_GT(r.disk_read_bytes_per_s, 0);
  EXPECT_GT(r.disk_write_bytes_per_s, 0);
  EXPECT_GT(r.disk_mixed_bytes_per_s, 0);
  EXPECT_EQ(r.disk_mixed_family_bytes, 0);
  EXPECT_GT(r.disk_cpu_seconds_per_byte, 0);
  EXPECT_EQ(r.h2d_bytes_per_s, runtime::Rates{}.h2d_bytes_per_s) << "a disk pass measured the copies";
  EXPECT_TRUE(fs::is_empty(dir_->path())) << "the swap file was left behind";
}

TEST_F(RateMeasurerDisk, PipelinePassNamesItsFamilySize) {
  RateMeasurer m;
  DiskOptions o = options(MixedPass::kPipeline);
  o.pipeline_threads = 1;
  o.warm_up = DiskWarmUp::kRound;
  auto facts = m.measure_disk(o);
  ASSERT_TRUE(facts.ok()) << facts.status().to_string();
  EXPECT_GT(m.rates().disk_mixed_bytes_per_s, 0);
  EXPECT_EQ(m.rates().disk_mixed_family_bytes, 2.0 * kMiB);  // two state pieces of one slot each
  EXPECT_TRUE(fs::is_empty(dir_->path()));
}

TEST_F(RateMeasurerDisk, APassIssuesAtLeastOneTransferInItsTime) {
  RateMeasurer m;
  DiskOptions o = options(MixedPass::kInterleaved);
  o.pass_seconds_max = 1e-9;
  auto facts = m.measure_disk(o);
  ASSERT_TRUE(facts.ok()) << facts.status().to_string();
  EXPECT_EQ(facts->bytes_tested, kMiB);
}

TEST_F(RateMeasurerDisk, RefusesBadOptionsBeforeWriting) {
  RateMeasurer m;
  DiskOptions unaligned = options(MixedPass::kInterleaved);
  unaligned.slot_bytes = 1000;
  DiskOptions too_many_in_flight = options(MixedPass::kInterleaved);
  too_many_in_flight.in_flight = 9;
  DiskOptions one_slot_pipeline = options(MixedPass::kPipeline);
  one_slot_pipeline.slots = one_slot_pipeline.in_flight = 1;
  for (const DiskOptions& o : {unaligned, too_many_in_flight, one_slot_pipeline}) {
    auto facts = m.measure_disk(o);
    ASSERT_FALSE(facts.ok());
    EXPECT_EQ(facts.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(facts.status().message().find("test disk"), std::string::npos) << facts.status().to_string();
  }
  EXPECT_TRUE(fs::is_empty(dir_->path()));
}

TEST(RateMeasurer, OptimizerSamplesUntilItsTimeAndReportsItsStage) {
  std::vector<double> fractions;
  RateMeasurer m([&](std::string_view stage, double f) {
    EXPECT_EQ(stage, "cpu optimizer");
    fractions.push_back(f);
  });
  Status st = m.measure_cpu_optimizer(
      {.params = 1 << 16,
       .threads = 2,
       .check = kernels::GradCheck::kCallerChecked,
       .sampling = {.statistic = Statistic::kMedian, .runs_min = 2, .runs_max = 5, .seconds_min = 1e6}});
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_GT(m.rates().cpu_optim_params_per_s, 0);
  EXPECT_EQ(m.rates().cpu_threads, 2);
  // The warm-up, then runs_max timed steps (seconds_min is never reached), then the end.
  ASSERT_EQ(fractions.size(), 1u + 5u + 1u);
  EXPECT_EQ(fractions.front(), 0.25);
  EXPECT_EQ(fractions.back(), 1.0);
}

// q8 states (issue #49): the rate of kernels::step_q8, the kernel the runtime runs for them.
TEST(RateMeasurer, OptimizerOnQ8StatesTimesTheQ8Kernel) {
  for (const kernels::GradCheck check :
       {kernels::GradCheck::kSeparatePass, kernels::GradCheck::kCallerChecked}) {
    RateMeasurer m;
    Status st = m.measure_cpu_optimizer(
        {.params = (1 << 16) + 100,  // a partial last block
         .threads = 2,
         .check = check,
         .sampling = {.statistic = Statistic::kMedian, .runs_min = 2, .runs_max = 3, .seconds_min = 1e6},
         .state_dtype = kernels::DType::kQ8});
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_GT(m.rates().cpu_optim_params_per_s, 0);
  }
}

TEST(RateMeasurer, HostMemoryRefusesUnalignedBytesAndBadSampling) {
  RateMeasurer m;
  EXPECT_EQ(m.measure_host_memory({.bytes = 1000, .threads = 1}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      m.measure_host_memory({.bytes = kMiB, .threads = 1, .sampling = {.runs_min = 3, .runs_max = 2}}).code(),
      StatusCode::kInvalidArgument);
  ASSERT_TRUE(m.measure_host_memory({.bytes = kMiB, .threads = 1}).ok());
  EXPECT_GT(m.rates().host_memory_bytes_per_s, 0);
}

}  // namespace
}  // namespace strata::rates
