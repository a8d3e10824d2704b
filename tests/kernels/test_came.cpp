// CAME against a double-precision transcription of the paper's algorithm
// (Luo et al. 2023, Alg. 1, and the reference code's 1-D branch), 2-D factored
// and 1-D, over several steps; Inf/NaN; thread-count determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <random>

#include "problem.hpp"
#include "strata/common/thread_pool.hpp"

namespace strata::kernels::test {
namespace {

Hyper came_hyper() {
  Hyper h;
  h.optimizer = Optimizer::kCame;
  h.lr = 2e-3f;
  h.beta1 = 0.9f;
  h.beta2 = 0.999f;
  h.beta3 = 0.9999f;
  h.eps = 1e-30f;
  h.eps2 = 1e-16f;
  h.weight_decay = 0.01f;
  h.clip_threshold = 1.0f;
  return h;
}

struct CameRef {
  std::size_t rows, cols;
  std::vector<double> p, m, v, r, c, R, C;
  void step(const Hyper& h, const std::vector<double>& g) {
    const std::size_t n = rows * cols;
    const bool fact = rows > 1 && cols > 1;
    std::vector<double> u(n);
    if (fact) {
      for (std::size_t i = 0; i < rows; ++i) {
        double s = 0;
        for (std::size_t j = 0; j < cols; ++j) s += g[i * cols + j] * g[i * cols + j] + h.eps;
        r[i] = h.beta2 * r[i] + (1 - h.beta2) * s / cols;
      }
      for (std::size_t j = 0; j < cols; ++j) {
        double s = 0;
        for (std::size_t i = 0; i < rows; ++i) s += g[i * cols + j] * g[i * cols + j] + h.eps;
        c[j] = h.beta2 * c[j] + (1 - h.beta2) * s / rows;
      }
      double rmean = 0;
      for (double x : r) rmean += x;
      rmean /= rows;
      for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = 0; j < cols; ++j)
          u[i * cols + j] = g[i * cols + j] / std::sqrt(r[i] / rmean * c[j]);
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        v[i] = h.beta2 * v[i] + (1 - h.beta2) * (g[i] * g[i] + h.eps);
        u[i] = g[i] / std::sqrt(v[i]);
      }
    }
    double ss = 0;
    for (double x : u) ss += x * x;
    const double clip = std::max(1.0, std::sqrt(ss / n) / h.clip_threshold);
    std::vector<double> U(n);
    for (std::size_t i = 0; i < n; ++i) {
      u[i] /= clip;
      m[i] = h.beta1 * m[i] + (1 - h.beta1) * u[i];
      U[i] = (u[i] - m[i]) * (u[i] - m[i]) + h.eps2;
    }
    std::vector<double> conf(n, 1.0);
    if (fact) {
      for (std::size_t i = 0; i < rows; ++i) {
        double s = 0;
        for (std::size_t j = 0; j < cols; ++j) s += U[i * cols + j];
        R[i] = h.beta3 * R[i] + (1 - h.beta3) * s / cols;
      }
      for (std::size_t j = 0; j < cols; ++j) {
        double s = 0;
        for (std::size_t i = 0; i < rows; ++i) s += U[i * cols + j];
        C[j] = h.beta3 * C[j] + (1 - h.beta3) * s / rows;
      }
      double Rmean = 0;
      for (double x : R) Rmean += x;
      Rmean /= rows;
      for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = 0; j < cols; ++j) conf[i * cols + j] = 1.0 / std::sqrt(R[i] / Rmean * C[j]);
    }
    for (std::size_t i = 0; i < n; ++i) p[i] = p[i] - h.lr * h.weight_decay * p[i] - h.lr * m[i] * conf[i];
  }
};

struct CameCase {
  std::size_t rows, cols;
  Buffer master, grad, param;
  std::vector<float> m, v, r, c, R, C;
  CameRef ref;
  std::mt19937_64 rng{42};
  CameCase(std::size_t rr, std::size_t cc, DType gd, DType pd) : rows(rr), cols(cc) {
    const std::size_t n = rr * cc;
    master.init(DType::kF32, n, 1);
    grad.init(gd, n, 1);
    param.init(pd, n, 0);
    m.assign(n, 0);
    v.assign(n, 0);
    r.assign(rr, 0);
    c.assign(cc, 0);
    R.assign(rr, 0);
    C.assign(cc, 0);
    ref = {rr,
           cc,
           std::vector<double>(n),
           std::vector<double>(n, 0),
           std::vector<double>(n, 0),
           std::vector<double>(rr, 0),
           std::vector<double>(cc, 0),
           std::vector<double>(rr, 0),
           std::vector<double>(cc, 0)};
    std::uniform_real_distribution<double> u(-1, 1);
    for (std::size_t i = 0; i < n; ++i) ref.p[i] = master.set(i, u(rng));
  }
  std::vector<double> next_grad() {
    std::uniform_real_distribution<double> u(-0.3, 0.3);
    std::vector<double> g(rows * cols);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad.set(i, u(rng) * (1 + i % 7));
    return g;
  }
  CameTensor tensor() {
    return CameTensor{.master = reinterpret_cast<float*>(master.data),
                      .grad = grad.data,
                      .grad_dtype = grad.dtype,
                      .param = param.data,
                      .param_dtype = param.dtype,
                      .rows = rows,
                      .cols = cols,
                      .exp_avg = m.data(),
                      .exp_avg_sq = v.data(),
                      .row = r.data(),
                      .col = c.data(),
                      .res_row = R.data(),
                      .res_col = C.data()};
  }
};

TEST(Came, FactoredAndVectorMatchPaperReference) {
  const Hyper h = came_hyper();
  struct Shape {
    std::size_t rows, cols;
  };
  for (Shape s : {Shape{37, 53}, Shape{1, 101}, Shape{101, 1}, Shape{300, 700}}) {
    for (DType gd : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(::testing::Message() << s.rows << "x" << s.cols << " grad " << dtype_name(gd));
      CameCase cc(s.rows, s.cols, gd, DType::kBF16);
      for (int t = 1; t <= 4; ++t) {
        const std::vector<double> g = cc.next_grad();
        CameTensor tt = cc.tensor();
        Result<StepReport> r = came_step(h, t, 1.0f, {&tt, 1});
        ASSERT_TRUE(r.ok()) << r.status().to_string();
        ASSERT_TRUE(r->applied);
        cc.ref.step(h, g);
      }
      std::size_t bad = 0;
      for (std::size_t i = 0; i < s.rows * s.cols; ++i) {
        const double got = cc.master.get(i), want = cc.ref.p[i];
        if (std::fabs(got - want) > 1e-6 + 1e-3 * 4 * h.lr && ++bad <= 3) {
          ADD_FAILURE() << "master[" << i << "] = " << got << " reference " << want;
        }
        Buffer one;
        one.init(DType::kBF16, 1, 0);
        if (cc.param.get(i) != one.set(0, got) && ++bad <= 3)
          ADD_FAILURE() << "param[" << i << "] not master rounded";
      }
      EXPECT_EQ(bad, 0u);
    }
  }
}

TEST(Came, NonFiniteGradientLeavesEverythingUntouched) {
  CameCase cc(20, 30, DType::kF32, DType::kNone);
  cc.next_grad();
  cc.grad.set(123, std::numeric_limits<double>::infinity());
  const auto before = cc.master.snapshot();
  CameTensor tt = cc.tensor();
  Result<StepReport> r = came_step(came_hyper(), 1, 1.0f, {&tt, 1});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->grads_finite);
  EXPECT_EQ(cc.master.snapshot(), before);
  EXPECT_EQ(cc.m, std::vector<float>(600, 0.0f));
  EXPECT_EQ(cc.r, std::vector<float>(20, 0.0f));
}

TEST(Came, IdenticalBitsForAnyThreadCountAndBadInput) {
  std::vector<std::vector<unsigned char>> results;
  for (std::size_t threads : {0, 1, 3}) {
    std::unique_ptr<ThreadPool> pool;
    if (threads > 0) pool = std::move(ThreadPool::create({.threads = threads}).value());
    CameCase cc(700, 300, DType::kF32, DType::kNone);
    for (int t = 1; t <= 2; ++t) {
      cc.next_grad();
      CameTensor tt = cc.tensor();
      ASSERT_TRUE(came_step(came_hyper(), t, 1.0f, {&tt, 1}, pool.get()).ok());
    }
    results.push_back(cc.master.snapshot());
  }
  EXPECT_EQ(results[0], results[1]);
  EXPECT_EQ(results[0], results[2]);
  CameCase cc(4, 5, DType::kF32, DType::kNone);
  CameTensor tt = cc.tensor();
  tt.res_col = nullptr;
  EXPECT_EQ(came_step(came_hyper(), 1, 1.0f, {&tt, 1}).status().code(), StatusCode::kInvalidArgument);
  Hyper h = came_hyper();
  h.beta3 = 1.5f;
  tt = cc.tensor();
  EXPECT_EQ(came_step(h, 1, 1.0f, {&tt, 1}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::kernels::test
