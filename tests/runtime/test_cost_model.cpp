// The cost model against the runtime: a step that follows the plan moves exactly
// the bytes predict_step says (Note [Cost model follows the runtime] in
// runtime/plan/cost_model.cpp), on every link and the disk.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / fmt::format("strata-cost-{}", ::getpid());
  TempDir() { fs::create_directories(path); }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

constexpr std::size_t kFamilies = 12;
constexpr std::uint64_t kElems = 64 * 1024;  // one 256 KiB fp32 chunk per family
constexpr std::uint64_t kChunkBytes = kElems * 4;

struct Case {
  const char* name;
  std::uint64_t gpu_bytes, host_bytes, nvme_bytes;
  std::uint32_t prefetch_depth_max;
  bool gpu_optimizer = true;  //!< PlanOptions::allow_gpu_optimizer
};

// Trains `steps` steps of kFamilies one-tensor layers (forward: each param;
// backward in reverse: param and gradient), the device and the optimizer kept
// up with the training thread (the model's assumptions), and returns the last
// step's stats and the runtime's prediction for its plan.
void train(const Case& c, const fs::path& dir, StepStats* last, StepCost* predicted, Plan* plan) {
  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = 64 * kMiB;
  auto device = memory::make_device(dopt);
  ASSERT_TRUE(device.ok()) << device.status();
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.layout.chunk_elems = kElems;
  o.threads = 2;
  o.budgets = {.gpu_bytes = c.gpu_bytes, .host_bytes = c.host_bytes, .nvme_bytes = c.nvme_bytes};
  if (c.nvme_bytes > 0) o.nvme_dirs = {dir.string()};
  o.plan.prefetch_depth_max = c.prefetch_depth_max;
  o.plan.allow_gpu_optimizer = c.gpu_optimizer;
  auto rt = Runtime::create(**device, o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  std::vector<TensorId> ids;
  for (std::size_t i = 0; i < kFamilies; ++i) {
    auto id =
        (*rt)->register_tensor({fmt::format("layer{}", i), {static_cast<std::int64_t>(kElems)}, DType::kF32});
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  memory::Device& dev = **device;
  for (int s = 0; s < 5; ++s) {
    for (std::size_t i = 0; i < kFamilies; ++i) {
      auto p = (*rt)->acquire(ids[i], StateKind::kParam, Access::kRead);
      ASSERT_TRUE(p.ok()) << p.status();
      ASSERT_TRUE((*rt)->launch([] {}).ok());
      p->release();
      ASSERT_TRUE(dev.synchronize().ok());  // every fence done before the next pick
    }
    for (std::size_t i = kFamilies; i-- > 0;) {
      {
        auto p = (*rt)->acquire(ids[i], StateKind::kParam, Access::kRead);
        ASSERT_TRUE(p.ok()) << p.status();
        auto g = (*rt)->acquire(ids[i], StateKind::kGrad, Access::kWrite);
        ASSERT_TRUE(g.ok()) << g.status();
        float* grad = static_cast<float*>(g->data());
        ASSERT_TRUE((*rt)->launch([grad] { std::fill(grad, grad + kElems, 1e-3f); }).ok());
      }  // releasing both starts the family's optimizer
      ASSERT_TRUE(dev.synchronize().ok());
      ASSERT_TRUE((*rt)->flush().ok());  // its optimizer has committed
    }
    auto st = (*rt)->step();
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE((*rt)->flush().ok());  // the write-backs after step() land in the next step's stats
    *last = *st;
  }
  *predicted = (*rt)->predict(Rates{});
  *plan = (*rt)->plan();
}

class CostModelBytes : public ::testing::TestWithParam<Case> {};

// Before the cost model replayed the runtime's own slot choice, it predicted
// fewer h2d bytes than the runtime moved: it kept params on the device across
// the step boundary that the runtime drops once their update commits.
TEST_P(CostModelBytes, StepMovesTheBytesPredictStepSays) {
  TempDir dir;
  StepStats last;
  StepCost predicted;
  Plan plan;
  ASSERT_NO_FATAL_FAILURE(train(GetParam(), dir.path, &last, &predicted, &plan));
  ASSERT_TRUE(last.followed_plan);
  ASSERT_FALSE(plan.all_gpu) << plan.summary();
  SCOPED_TRACE(plan.summary());
  EXPECT_EQ(last.bytes_h2d, predicted.bytes_h2d)
      << "in chunks: " << last.bytes_h2d / kChunkBytes << " vs " << predicted.bytes_h2d / kChunkBytes;
  EXPECT_EQ(last.bytes_d2h, predicted.bytes_d2h);
  EXPECT_EQ(last.bytes_disk_read, predicted.bytes_disk_read);
  EXPECT_EQ(last.bytes_disk_write, predicted.bytes_disk_write);
  EXPECT_GT(last.bytes_h2d, 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Plans, CostModelBytes,
    ::testing::Values(Case{"StreamingHost", 6 * kChunkBytes, 64 * kMiB, 0, 2},
                      Case{"StreamingHostDeepPrefetch", 8 * kChunkBytes, 64 * kMiB, 0, 4},
                      Case{"StreamingNvme", 6 * kChunkBytes, 7 * kMiB, 64 * kMiB, 2},
                      Case{"ResidentParamsSomeStreaming", 14 * kChunkBytes, 64 * kMiB, 0, 2, false}),
    [](const auto& param_info) { return std::string(param_info.param.name); });

}  // namespace
}  // namespace strata::runtime
