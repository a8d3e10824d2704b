// The runtime's gradient check (Note [Gradient check on the device] in
// runtime/src/pipeline/grad_check.cpp): no extra host pass over the gradients, the same
// clipping norm as a check over all of them, and nothing written when a
// gradient is non-finite, even when the only NaN is the last element of the
// last kernel piece.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "sim_device.hpp"
#include "strata/common/bytes.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

using testing::sim_device;

// Three kernel pieces and a bit: the last element is in the last piece.
constexpr std::size_t kBig = 3 * kernels::kPieceElems + 7;
constexpr std::size_t kSmall = 1000;

enum class Mode { kPlain, kClip, kLossScaling };

RuntimeOptions options(Mode mode) {
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-2f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = 4 * kernels::kPieceElems;  // one family per tensor
  o.threads = 2;
  // The optimizers run on the CPU, the gradients come down through grad staging.
  o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
  o.plan.allow_gpu_optimizer = false;
  if (mode == Mode::kClip) o.clip_max_norm = 0.5;
  if (mode == Mode::kLossScaling) o.loss_scaling = true;
  return o;
}

float grad_value(std::size_t tensor, std::size_t i, int step) {
  return 0.01f * static_cast<float>((i * 7 + tensor * 3 + static_cast<std::size_t>(step)) % 13) - 0.05f;
}

struct Model {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<Runtime> rt;
  std::vector<TensorId> ids;
  std::vector<std::size_t> sizes{kSmall, kBig};
  std::vector<std::vector<float>> init;

  explicit Model(Mode mode) : device(sim_device()) {
    auto r = Runtime::create(*device, options(mode));
    EXPECT_TRUE(r.ok()) << r.status();
    rt = std::move(r).value();
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      auto id = rt->register_tensor({fmt::format("t{}", t), {static_cast<std::int64_t>(sizes[t])}});
      EXPECT_TRUE(id.ok()) << id.status();
      ids.push_back(*id);
    }
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      std::vector<float> v(sizes[t]);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.1f * static_cast<float>(i % 17) - 0.5f;
      EXPECT_TRUE(rt->init_tensor(ids[t], v).ok());
      init.push_back(std::move(v));
    }
  }

  //! Every family's optimizer runs on the CPU (its states live on host).
  bool cpu_optimizers() const {
    for (const FamilyPlan& f : rt->plan().families) {
      if (f.optim_home != Tier::kHost) return false;
    }
    return true;
  }

  //! One step: every tensor's gradient written on the compute stream; with
  //! `nan`, the last element of the big tensor (its last piece) is NaN.
  Result<StepStats> step(int s, bool nan) {
    for (std::size_t t = 0; t < ids.size(); ++t) {
      auto p = rt->acquire(ids[t], StateKind::kParam, Access::kRead);
      if (!p.ok()) return p.status();
      auto g = rt->acquire(ids[t], StateKind::kGrad, Access::kWrite);
      if (!g.ok()) return g.status();
      float* G = g->as<float>();
      const std::size_t n = sizes[t];
      const bool poison = nan && t == 1;
      Status st = rt->launch([G, n, t, s, poison] {
        for (std::size_t i = 0; i < n; ++i) G[i] = grad_value(t, i, s);
        if (poison) G[n - 1] = std::numeric_limits<float>::quiet_NaN();
      });
      if (!st.ok()) return st;
    }  // the leases' release completes the gradients
    return rt->step();
  }

  std::vector<std::vector<float>> read(StateKind kind) {
    std::vector<std::vector<float>> out;
    for (std::size_t t = 0; t < ids.size(); ++t) {
      std::vector<float> v(sizes[t]);
      EXPECT_TRUE(rt->read_tensor(ids[t], kind, v).ok());
      out.push_back(std::move(v));
    }
    return out;
  }
};

class GradCheck : public ::testing::TestWithParam<Mode> {};

TEST_P(GradCheck, NanInTheLastElementOfTheLastPieceWritesNothing) {
  Model m(GetParam());
  auto first = m.step(0, false);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE(first->applied);
  ASSERT_TRUE(m.cpu_optimizers()) << "the test needs optimizer states on host";
  const auto master = m.read(StateKind::kMaster);
  const auto s0 = m.read(StateKind::kState0);
  const auto s1 = m.read(StateKind::kState1);
  EXPECT_NE(master, m.init);  // the first step did update

  auto poisoned = m.step(1, true);
  ASSERT_TRUE(poisoned.ok()) << poisoned.status();
  EXPECT_FALSE(poisoned->applied) << "d2h " << poisoned->bytes_d2h << " h2d " << poisoned->bytes_h2d
                                  << " host check " << poisoned->grad_check_host_bytes << " followed "
                                  << poisoned->followed_plan;
  EXPECT_EQ(m.read(StateKind::kMaster), master);
  EXPECT_EQ(m.read(StateKind::kState0), s0);
  EXPECT_EQ(m.read(StateKind::kState1), s1);

  // Training goes on after the skipped step.
  auto next = m.step(2, false);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->applied);
  EXPECT_NE(m.read(StateKind::kMaster), master);
}

TEST_P(GradCheck, GradientsFromTheDeviceNeedNoHostCheckPass) {
  Model m(GetParam());
  for (int s = 0; s < 3; ++s) {
    auto st = m.step(s, s == 1);
    ASSERT_TRUE(st.ok()) << st.status();
    ASSERT_TRUE(m.cpu_optimizers()) << "the test needs optimizer states on host";
    EXPECT_EQ(st->grad_check_host_bytes, 0u) << "step " << s << " read gradients on the host to check them";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, GradCheck, ::testing::Values(Mode::kPlain, Mode::kClip, Mode::kLossScaling),
                         [](const ::testing::TestParamInfo<Mode>& i) {
                           switch (i.param) {
                             case Mode::kPlain:
                               return "plain";
                             case Mode::kClip:
                               return "clip";
                             case Mode::kLossScaling:
                               return "loss_scaling";
                           }
                           return "unknown";
                         });

TEST(GradCheckClip, NormIsTheNormOverAllGradients) {
  // The step with clipping equals kernels::step with the clip coefficient of
  // grad_stats over every gradient at once (the norm before this change).
  Model m(Mode::kClip);
  auto st = m.step(0, false);
  ASSERT_TRUE(st.ok()) << st.status();
  ASSERT_TRUE(st->applied);

  std::vector<std::vector<float>> grad(m.ids.size()), master = m.init, s0, s1;
  std::vector<kernels::Span> spans;
  for (std::size_t t = 0; t < m.ids.size(); ++t) {
    grad[t].resize(m.sizes[t]);
    for (std::size_t i = 0; i < m.sizes[t]; ++i) grad[t][i] = grad_value(t, i, 0);
    s0.emplace_back(m.sizes[t], 0.0f);
    s1.emplace_back(m.sizes[t], 0.0f);
  }
  for (std::size_t t = 0; t < m.ids.size(); ++t) {
    kernels::Span s;
    s.n = m.sizes[t];
    s.tensor = static_cast<std::uint32_t>(t);
    s.grad = grad[t].data();
    s.grad_dtype = DType::kF32;
    s.master = master[t].data();
    s.state = {s0[t].data(), s1[t].data()};
    s.state_dtype = DType::kF32;
    spans.push_back(s);
  }
  auto stats = kernels::grad_stats(spans, 1.0f);
  ASSERT_TRUE(stats.ok());
  const RuntimeOptions o = options(Mode::kClip);
  kernels::StepArgs args{
      .hyper = o.hyper,
      .step = 1,
      .grad_scale = kernels::clip_coefficient(std::sqrt(stats->sum_squares), o.clip_max_norm),
      .spans = spans};
  ASSERT_LT(args.grad_scale, 1.0f) << "the test's gradients must be clipped";
  auto r = kernels::step(args);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(m.read(StateKind::kMaster), master);
  EXPECT_EQ(m.read(StateKind::kState0), s0);
  EXPECT_EQ(m.read(StateKind::kState1), s1);
}

}  // namespace
}  // namespace strata::runtime
