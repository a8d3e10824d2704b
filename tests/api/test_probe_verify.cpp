// strata-probe's runtime side: --verify's refusals, what the runtime accepts, and the
// rows that follow the runtime's own answers. Links strata_probe (and so the runtime);
// test_probe_model links the model side alone.
#include <gtest/gtest.h>

#include <regex>

#include "probe/model.hpp"
#include "probe/runtime_spec.hpp"
#include "probe/verify.hpp"
#include "strata/common/bytes.hpp"

namespace strata::probe {
namespace {

TrainSpec spec_for(std::uint64_t params) {
  TrainSpec s;
  s.shape = shape_for_params(params, 512, 4, 32000).value();
  return s;
}

// Issue 16: --verify-steps 0 (and -1) reached the median of no steps: SIGSEGV.
TEST(ProbeVerify, ZeroOrNegativeStepsAreRefused) {
  for (int steps : {0, -1}) {
    VerifyOptions o;
    o.spec.shape = shape_for_verify(2'000'000, 128, 1).value();
    o.placement = Placement::kParamsOptimHost;
    o.capacity = {.gpu_bytes = 4 * kGiB, .host_bytes = 8 * kGiB, .nvme_bytes = 0};
    o.steps = steps;
    auto r = verify(o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("--verify-steps"), std::string::npos) << r.status();
  }
}

// Issue 16: the probe planned SGD with bf16 states, which the runtime refuses.
TEST(ProbeSpec, OnlyWhatTheRuntimeAccepts) {
  TrainSpec spec;
  spec.optimizer = kernels::Optimizer::kSgd;
  spec.state_dtype = kernels::DType::kBF16;
  Status s = check_supported(spec);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("--state-dtype bf16"), std::string::npos) << s;
  spec.optimizer = kernels::Optimizer::kAdamW;
  EXPECT_TRUE(check_supported(spec).ok());
}

// Issue 16: an oversized --verify was refused with "holds at most 566.8M params"
// right after 1.69B verified on the same placement: the figure came from another
// family of shapes. The suggested size must itself fit (Note [Largest verify model]).
TEST(ProbeVerify, TooLargeSuggestsAVerifySizeThatFits) {
  VerifyOptions o;
  o.spec.shape = shape_for_verify(50'000'000'000, 1024, 4).value();
  o.placement = Placement::kParamsOptimHost;
  o.capacity = {.gpu_bytes = 4 * kGiB, .host_bytes = 24 * kGiB, .nvme_bytes = 0};
  auto r = verify(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfBudget);
  std::smatch m;
  const std::string message = r.status().message();
  ASSERT_TRUE(std::regex_search(message, m, std::regex("--verify-params ([0-9.]+[KMBT]?) or less")))
      << message;
  TrainSpec fits = o.spec;
  fits.shape = shape_for_verify(parse_count(m[1].str()).value(), 1024, 4).value();
  EXPECT_TRUE(plan_fits(fits, o.placement, o.capacity).ok()) << message;
}

// Item 4 of issue #15: on a CUDA machine the all-gpu row was offered (and
// predicted) although the runtime plans every optimizer step on the CPU there.
// The row follows the runtime's own answer, runtime::gpu_optimizer_supported.
TEST(ProbePlacements, AllGpuOnlyWhereTheRuntimeRunsTheOptimizerOnTheDevice) {
  const Capacity cap{.gpu_bytes = 16 * kGiB, .host_bytes = 64 * kGiB, .nvme_bytes = 0};
  TrainSpec sim = spec_for(125'000'000);
  sim.gpu_optimizer = runtime::gpu_optimizer_supported(memory::DeviceKind::kSim, kernels::Optimizer::kLamb);
  const Estimate on_sim = estimate(sim, Placement::kAllGpu, cap, runtime::Rates{});
  EXPECT_TRUE(on_sim.feasible) << on_sim.why;
  EXPECT_TRUE(on_sim.plan.all_gpu);

  TrainSpec cuda = sim;
  // LAMB needs the host between its passes: on CUDA it steps on the CPU (AdamW would not).
  cuda.optimizer = kernels::Optimizer::kLamb;
  cuda.gpu_optimizer = runtime::gpu_optimizer_supported(memory::DeviceKind::kCuda, cuda.optimizer);
  ASSERT_FALSE(cuda.gpu_optimizer);
  EXPECT_TRUE(runtime::gpu_optimizer_supported(memory::DeviceKind::kCuda, kernels::Optimizer::kAdamW));
  const Estimate on_cuda = estimate(cuda, Placement::kAllGpu, cap, runtime::Rates{});
  EXPECT_FALSE(on_cuda.feasible);
  EXPECT_NE(on_cuda.why.find("CPU"), std::string::npos) << on_cuda.why;
  EXPECT_FALSE(on_cuda.reason.empty());
  // The other rows do not need the device's optimizer.
  EXPECT_TRUE(estimate(cuda, Placement::kOptimHost, cap, runtime::Rates{}).feasible);
  // --verify at all-gpu on a CUDA machine is refused up front.
  EXPECT_FALSE(plan_fits(cuda, Placement::kAllGpu, cap).ok());
}

}  // namespace
}  // namespace strata::probe
