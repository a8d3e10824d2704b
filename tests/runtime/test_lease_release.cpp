// Lease::release says when it starts its family's optimizer step (Note
// [Scheduler]; Note [Gradient completion]): the side effect is visible at the
// call site, and behaviour is unchanged.
#include <gtest/gtest.h>

#include <vector>

#include "sim_device.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

using testing::sim_device;

constexpr std::int64_t kWidth = 64;

struct Training {
  std::unique_ptr<memory::Device> device = sim_device();
  std::unique_ptr<Runtime> rt;
  std::vector<TensorId> w;

  explicit Training(double clip) {
    RuntimeOptions o;
    o.layout.chunk_elems = kWidth * kWidth;  // one family per tensor
    o.threads = 2;
    o.clip_max_norm = clip;
    o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
    auto r = Runtime::create(*device, o);
    EXPECT_TRUE(r.ok()) << r.status();
    rt = std::move(r).value();
    for (int l = 0; l < 3; ++l) {
      auto id = rt->register_tensor({fmt::format("l{}.w", l), {kWidth, kWidth}});
      EXPECT_TRUE(id.ok()) << id.status();
      w.push_back(*id);
    }
    for (TensorId t : w) EXPECT_TRUE(rt->init_tensor(t, std::vector<float>(kWidth * kWidth, 0.5f)).ok());
  }

  //! One step through leases; returns what each release said, in order.
  std::vector<Released> step() {
    std::vector<Released> out;
    for (TensorId t : w) {
      auto p = rt->acquire(t, StateKind::kParam, Access::kRead);
      EXPECT_TRUE(p.ok()) << p.status();
      out.push_back(p->release());
    }
    for (auto it = w.rbegin(); it != w.rend(); ++it) {
      auto p = rt->acquire(*it, StateKind::kParam, Access::kRead);
      auto g = rt->acquire(*it, StateKind::kGrad, Access::kWrite);
      EXPECT_TRUE(p.ok() && g.ok());
      out.push_back(g->release());  // the param is still leased: not complete yet
      out.push_back(p->release());  // now complete
    }
    auto st = rt->step();
    EXPECT_TRUE(st.ok()) << st.status();
    if (st.ok()) {
      EXPECT_TRUE(st->applied);
    }
    return out;
  }
};

TEST(LeaseRelease, SaysWhenItStartsTheFamilysOptimizer) {
  Training run(/*clip=*/0.0);
  constexpr auto U = Released::kUnpinned;
  constexpr auto S = Released::kOptimizerStarted;
  const std::vector<Released> expected{U, U, U, U, S, U, S, U, S};
  for (int s = 0; s < 3; ++s) EXPECT_EQ(run.step(), expected) << "step " << s;
}

TEST(LeaseRelease, DeferredStepsStartNothingOnRelease) {
  Training run(/*clip=*/1.0);  // clipping defers every optimizer step to step()
  for (int s = 0; s < 2; ++s) {
    for (Released r : run.step()) EXPECT_EQ(r, Released::kUnpinned) << "step " << s;
  }
}

TEST(LeaseRelease, SecondReleaseIsANoOp) {
  Training run(/*clip=*/0.0);
  auto p = run.rt->acquire(run.w[0], StateKind::kParam, Access::kRead);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->release(), Released::kUnpinned);
  EXPECT_EQ(p->release(), Released::kUnpinned);
  EXPECT_FALSE(p->valid());
}

}  // namespace
}  // namespace strata::runtime
