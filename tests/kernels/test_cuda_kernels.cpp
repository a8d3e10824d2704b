// Real CUDA launches (label gpu): cuda_step against the emulated grid and the
// double reference. Skips, saying why, when no GPU/driver is present or strata
// was built without CUDA.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "problem.hpp"
#include "strata/kernels/cuda.hpp"

namespace strata::kernels::test {
namespace {

//! Managed-memory copies of a Problem's buffers and its spans rebased onto them.
struct DeviceCopy {
  CudaBuffer bufs[5];
  const Buffer* src[5];
  explicit DeviceCopy(const Problem& p) : src{&p.master, &p.grad, &p.param, &p.s0, &p.s1} {
    for (int k = 0; k < 5; ++k) {
      if (src[k]->data == nullptr) continue;
      bufs[k] = std::move(CudaBuffer::allocate(src[k]->n * dtype_size(src[k]->dtype) + 64, true).value());
      std::memcpy(bufs[k].data(), src[k]->data, src[k]->n * dtype_size(src[k]->dtype));
    }
  }
  void* rebase(const void* p, int k) const {
    if (p == nullptr) return nullptr;
    return static_cast<unsigned char*>(bufs[k].data()) +
           (static_cast<const unsigned char*>(p) - src[k]->data);
  }
  std::vector<Span> spans(const Problem& p) const {
    std::vector<Span> s = p.spans();
    for (Span& x : s) {
      x.master = static_cast<float*>(rebase(x.master, 0));
      x.grad = rebase(x.grad, 1);
      x.param = rebase(x.param, 2);
      x.state = {rebase(x.state[0], 3), rebase(x.state[1], 4)};
    }
    return s;
  }
  void refresh_grad(const Problem& p) {
    std::memcpy(bufs[1].data(), p.grad.data, p.n * dtype_size(p.grad.dtype));
  }
  double master(std::size_t i) const { return static_cast<const float*>(bufs[0].data())[i]; }
};

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    Status s = cuda_probe();
    if (!s.ok()) GTEST_SKIP() << "no usable GPU: " << s.to_string();
  }
};

TEST_F(Cuda, EveryOptimizerMatchesReferenceOnDevice) {
  for (Optimizer o : {Optimizer::kAdam, Optimizer::kAdamW, Optimizer::kLamb, Optimizer::kLars,
                      Optimizer::kSgd, Optimizer::kLion, Optimizer::kAdagrad}) {
    Hyper h;
    h.optimizer = o;
    h.lr = 1e-2f;
    h.weight_decay = 0.01f;
    if (o == Optimizer::kSgd || o == Optimizer::kLars) h.momentum = 0.9f;
    for (DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (std::size_t n : {1, 17, 1023, 100003}) {
        SCOPED_TRACE(::testing::Message() << optimizer_name(o) << " grad " << dtype_name(gd) << " n " << n);
        Problem pb(h, n, gd, DType::kBF16, DType::kF32, 1, 5 + n);
        DeviceCopy dev(pb);
        // Lion: one step (sign() of a value within rounding of 0 differs from double later on).
        const int steps = o == Optimizer::kLion ? 1 : 3;
        for (int t = 1; t <= steps; ++t) {
          const std::vector<double> g = pb.next_grad(0.5);
          dev.refresh_grad(pb);
          std::vector<Span> spans = dev.spans(pb);
          Result<StepReport> r = cuda_step({.hyper = h, .step = t, .grad_scale = 0.5f, .spans = spans});
          ASSERT_TRUE(r.ok()) << r.status().to_string();
          ASSERT_TRUE(r->applied);
          ref_step(h, t, pb.ref, g);
        }
        ASSERT_TRUE(cuda_synchronize().ok());
        std::size_t bad = 0;
        const double atol = 1e-6 + h.lr * 2e-4 * steps;
        for (std::size_t i = 0; i < n; ++i) {
          if (std::fabs(dev.master(i) - pb.ref.p[i]) > atol + 1e-6 * std::fabs(pb.ref.p[i]) && ++bad <= 3) {
            ADD_FAILURE() << "master[" << i << "] = " << dev.master(i) << " reference " << pb.ref.p[i];
          }
        }
        EXPECT_EQ(bad, 0u);
      }
    }
  }
}

TEST_F(Cuda, NonFiniteGradientLeavesDeviceStateUntouched) {
  Hyper h;
  h.optimizer = Optimizer::kAdamW;
  Problem pb(h, 70001, DType::kBF16, DType::kBF16, DType::kBF16, 0, 3);
  pb.next_grad(1.0);
  pb.grad.set(65000, std::numeric_limits<double>::infinity());
  DeviceCopy dev(pb);
  std::vector<Span> spans = dev.spans(pb);
  Result<StepReport> r = cuda_step({.hyper = h, .spans = spans});
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->grads_finite);
  ASSERT_TRUE(cuda_synchronize().ok());
  EXPECT_EQ(std::memcmp(dev.bufs[0].data(), pb.master.data, 70001 * 4), 0);
  Result<GradStats> gs = cuda_grad_stats(spans, 1.0f);
  ASSERT_TRUE(gs.ok());
  EXPECT_FALSE(gs->finite);
}

TEST_F(Cuda, EnqueuedStepMatchesBlockingStepAndReusesItsScratch) {
  // cuda_step_enqueue + cuda_step_finish give cuda_step's result bit for bit,
  // over several steps on one scratch (allocated once), on a stream of its own.
  Hyper h;
  h.optimizer = Optimizer::kAdamW;
  h.lr = 1e-2f;
  Problem a(h, 100003, DType::kBF16, DType::kBF16, DType::kF32, 1, 11);
  Problem b(h, 100003, DType::kBF16, DType::kBF16, DType::kF32, 1, 11);
  DeviceCopy da(a), db(b);
  CudaStepScratch scratch;
  for (int t = 1; t <= 3; ++t) {
    a.next_grad(0.5);
    b.next_grad(0.5);
    da.refresh_grad(a);
    db.refresh_grad(b);
    std::vector<Span> sa = da.spans(a), sb = db.spans(b);
    Result<StepReport> blocking = cuda_step({.hyper = h, .step = t, .spans = sa});
    ASSERT_TRUE(blocking.ok()) << blocking.status().to_string();
    Status st = cuda_step_enqueue({.hyper = h, .step = t, .spans = sb}, scratch, nullptr);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_NE(scratch.event(), nullptr);
    Result<StepReport> r = cuda_step_finish(scratch);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_TRUE(r->applied);
  }
  ASSERT_TRUE(cuda_synchronize().ok());
  EXPECT_EQ(std::memcmp(da.bufs[0].data(), db.bufs[0].data(), 100003 * 4), 0);
}

TEST_F(Cuda, EnqueuedStepWithNanInTheLastElementWritesNothing) {
  // The device check gates the update: a NaN in the very last element (the last
  // block of the last span) leaves master and states untouched, with no host
  // synchronisation between the check and the update.
  Hyper h;
  h.optimizer = Optimizer::kAdamW;
  Problem pb(h, 70001, DType::kF32, DType::kNone, DType::kF32, 0, 3);
  pb.next_grad(1.0);
  pb.grad.set(70000, std::numeric_limits<double>::quiet_NaN());
  DeviceCopy dev(pb);
  std::vector<Span> spans = dev.spans(pb);
  CudaStepScratch scratch;
  ASSERT_TRUE(cuda_step_enqueue({.hyper = h, .spans = spans}, scratch, nullptr).ok());
  Result<StepReport> r = cuda_step_finish(scratch);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_FALSE(r->grads_finite);
  EXPECT_FALSE(r->applied);
  ASSERT_TRUE(cuda_synchronize().ok());
  EXPECT_EQ(std::memcmp(dev.bufs[0].data(), pb.master.data, 70001 * 4), 0);
  EXPECT_EQ(std::memcmp(dev.bufs[3].data(), pb.s0.data, 70001 * 4), 0);
}

TEST(CudaApi, EnqueueRefusesTrustOptimizersAndUnfinishedScratch) {
  // Argument checks come before any CUDA call, so they hold without a GPU too.
  Hyper h;
  h.optimizer = Optimizer::kLamb;
  Problem pb(h, 16, DType::kF32, DType::kNone, DType::kF32, 0, 3);
  std::vector<Span> spans = pb.spans();
  CudaStepScratch scratch;
  Status st = cuda_step_enqueue({.hyper = h, .spans = spans}, scratch, nullptr);
  EXPECT_FALSE(st.ok());
  if (cuda_probe().ok()) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.to_string().find("cuda_step"), std::string::npos) << st.to_string();
  }
  EXPECT_FALSE(cuda_step_finish(scratch).ok());  // nothing enqueued
}

TEST_F(Cuda, TriadMeasuresBandwidth) {
  Result<double> gb = cuda_triad_gb_s(std::size_t{1} << 24, 3);
  ASSERT_TRUE(gb.ok()) << gb.status().to_string();
  EXPECT_GT(*gb, 10.0);
}

}  // namespace
}  // namespace strata::kernels::test
