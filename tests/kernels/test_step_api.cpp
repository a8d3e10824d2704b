// The step API's contracts: Inf/NaN leaves everything untouched, bad input is
// a clear Status, results are identical for any thread count, LAMB/LARS norms
// over spans split across calls equal one call over the whole tensor.
#include <gtest/gtest.h>

#include <limits>
#include <memory>

#include "problem.hpp"
#include "strata/common/thread_pool.hpp"

namespace strata::kernels::test {
namespace {

Hyper hyper(Optimizer o) {
  Hyper h;
  h.optimizer = o;
  h.lr = 1e-2f;
  h.weight_decay = 0.01f;
  if (o == Optimizer::kSgd || o == Optimizer::kLars) h.momentum = 0.9f;
  return h;
}

struct Snapshot {
  std::vector<unsigned char> master, param, s0, s1;
  explicit Snapshot(const Problem& p)
      : master(p.master.snapshot()), param(p.param.snapshot()), s0(p.s0.snapshot()), s1(p.s1.snapshot()) {}
  bool operator==(const Snapshot&) const = default;
};

class NonFinite : public ::testing::TestWithParam<Optimizer> {};

TEST_P(NonFinite, InfOrNanGradientLeavesEverythingUntouched) {
  const Hyper h = hyper(GetParam());
  for (float poison : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                       -std::numeric_limits<float>::infinity()}) {
    for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
      if (!isa_supported(isa)) continue;
      Problem pb(h, 100003, DType::kBF16, DType::kBF16, DType::kF32, 1, 9);
      pb.next_grad(1.0);
      pb.grad.set(77777, poison);  // in the second span, far into it
      const Snapshot before(pb);
      std::vector<Span> spans = pb.spans();
      Result<StepReport> r = step({.hyper = h, .step = 3, .spans = spans, .isa = isa});
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      EXPECT_FALSE(r->grads_finite);
      EXPECT_FALSE(r->applied);
      EXPECT_TRUE(Snapshot(pb) == before) << "state written despite " << poison << " on " << isa_name(isa);
      Result<GradStats> gs = grad_stats(spans, 1.0f, nullptr, isa);
      ASSERT_TRUE(gs.ok());
      EXPECT_FALSE(gs->finite);
    }
  }
}

TEST_P(NonFinite, OverflowOfTheScaledGradientCountsAsNonFinite) {
  const Hyper h = hyper(GetParam());
  Problem pb(h, 33, DType::kF32, DType::kNone, DType::kF32, 0, 3);
  pb.next_grad(1.0);
  pb.grad.set(5, 3e38);
  const Snapshot before(pb);
  std::vector<Span> spans = pb.spans();
  Result<StepReport> r = step({.hyper = h, .step = 1, .grad_scale = 4.0f, .spans = spans});
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->grads_finite);
  EXPECT_TRUE(Snapshot(pb) == before);
}

INSTANTIATE_TEST_SUITE_P(AllOptimizers, NonFinite,
                         ::testing::Values(Optimizer::kAdam, Optimizer::kAdamW, Optimizer::kLamb,
                                           Optimizer::kLars, Optimizer::kSgd, Optimizer::kLion,
                                           Optimizer::kAdagrad));

TEST(StepApi, CallerCheckedSkipsTheCheckAndCatchesChangedGradients) {
  const Hyper h = hyper(Optimizer::kAdamW);
  Problem pb(h, 4096, DType::kF32, DType::kNone, DType::kF32, 0, 5);
  pb.next_grad(1.0);
  std::vector<Span> spans = pb.spans();
  Result<GradStats> gs = grad_stats(spans, 1.0f);
  ASSERT_TRUE(gs.ok());
  ASSERT_TRUE(gs->finite);
  Result<StepReport> ok =
      step({.hyper = h, .spans = spans, .check = GradCheck::kCallerChecked, .checked = &*gs});
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->applied);
  GradStats bad{.sum_squares = 0, .finite = false};
  Result<StepReport> skipped =
      step({.hyper = h, .spans = spans, .check = GradCheck::kCallerChecked, .checked = &bad});
  ASSERT_TRUE(skipped.ok());
  EXPECT_FALSE(skipped->applied);
  pb.grad.set(10, std::numeric_limits<double>::quiet_NaN());  // changed after the check
  Result<StepReport> changed =
      step({.hyper = h, .spans = spans, .check = GradCheck::kCallerChecked, .checked = &*gs});
  EXPECT_EQ(changed.status().code(), StatusCode::kFailedPrecondition);
  Result<StepReport> missing = step({.hyper = h, .spans = spans, .check = GradCheck::kCallerChecked});
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
}

TEST(StepApi, BadInputIsInvalidArgument) {
  Hyper h = hyper(Optimizer::kAdamW);
  Problem pb(h, 64, DType::kF32, DType::kBF16, DType::kF32, 0, 5);
  std::vector<Span> spans = pb.spans();
  auto code = [&](const Hyper& hh, std::vector<Span> ss, std::int64_t t = 1, float scale = 1.0f) {
    return step({.hyper = hh, .step = t, .grad_scale = scale, .spans = ss}).status().code();
  };
  EXPECT_EQ(code(h, spans), StatusCode::kOk);
  Hyper bad = h;
  bad.lr = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(code(bad, spans), StatusCode::kInvalidArgument);
  bad = h;
  bad.beta2 = 1.0f;
  EXPECT_EQ(code(bad, spans), StatusCode::kInvalidArgument);
  bad = h;
  bad.eps = 0.0f;
  EXPECT_EQ(code(bad, spans), StatusCode::kInvalidArgument);
  bad = hyper(Optimizer::kSgd);
  bad.nesterov = true;
  bad.dampening = 0.5f;
  EXPECT_EQ(code(bad, spans), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(h, spans, 0), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(h, spans, 1, std::numeric_limits<float>::infinity()), StatusCode::kInvalidArgument);
  std::vector<Span> s = spans;
  s[1].state[1] = nullptr;  // AdamW needs exp_avg_sq
  EXPECT_EQ(code(h, s), StatusCode::kInvalidArgument);
  s = spans;
  s[0].param_dtype = DType::kNone;  // pointer without dtype
  EXPECT_EQ(code(h, s), StatusCode::kInvalidArgument);
  s = spans;
  s[0].param = s[0].master;
  s[0].param_dtype = DType::kF32;
  EXPECT_EQ(code(h, s), StatusCode::kInvalidArgument);
  s = spans;
  s[0].grad_dtype = DType::kNone;
  EXPECT_EQ(code(h, s), StatusCode::kInvalidArgument);
  s = spans;
  s[0].state_dtype = DType::kBF16;  // fine for AdamW...
  EXPECT_EQ(code(h, s), StatusCode::kOk);
  EXPECT_EQ(code(hyper(Optimizer::kSgd), s), StatusCode::kInvalidArgument);  // ...not for SGD
  s = spans;
  s[0].grad = static_cast<const unsigned char*>(s[0].grad) + 1;  // misaligned float
  EXPECT_EQ(code(h, s), StatusCode::kInvalidArgument);
  s = spans;
  s[0].n = 0;  // zero-length spans are fine, even without pointers
  s[0].master = nullptr;
  EXPECT_EQ(code(h, s), StatusCode::kOk);
  Hyper came = h;
  came.optimizer = Optimizer::kCame;
  EXPECT_EQ(code(came, spans), StatusCode::kInvalidArgument);
  std::vector<TrustPartial> wrong(1);
  EXPECT_EQ(trust_phase1({.hyper = hyper(Optimizer::kLamb), .spans = spans}, wrong).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(parse_isa("sse9").status().code(), StatusCode::kInvalidArgument);
}

TEST(StepApi, IdenticalBitsForAnyThreadCount) {
  for (Optimizer o : {Optimizer::kAdamW, Optimizer::kLamb, Optimizer::kLars}) {
    const Hyper h = hyper(o);
    std::vector<Snapshot> results;
    std::vector<double> norms;
    for (std::size_t threads : {0, 1, 3}) {
      std::unique_ptr<ThreadPool> pool;
      if (threads > 0) pool = std::move(ThreadPool::create({.threads = threads}).value());
      Problem pb(h, 3 * kPieceElems + 12345, DType::kBF16, DType::kBF16, DType::kF32, 1, 77);
      for (int t = 1; t <= 2; ++t) {
        pb.next_grad(0.5);
        std::vector<Span> spans = pb.spans();
        Result<StepReport> r =
            step({.hyper = h, .step = t, .grad_scale = 0.5f, .spans = spans, .pool = pool.get()});
        ASSERT_TRUE(r.ok() && r->applied);
      }
      Result<GradStats> gs = grad_stats(pb.spans(), 0.5f, pool.get());
      norms.push_back(gs->sum_squares);
      results.emplace_back(pb);
    }
    EXPECT_TRUE(results[0] == results[1]) << optimizer_name(o);
    EXPECT_TRUE(results[0] == results[2]) << optimizer_name(o);
    EXPECT_EQ(norms[0], norms[1]);
    EXPECT_EQ(norms[0], norms[2]);
  }
}

TEST(StepApi, TrustNormsOverSpansSplitAcrossCallsMatchOneCall) {
  for (Optimizer o : {Optimizer::kLamb, Optimizer::kLars}) {
    const Hyper h = hyper(o);
    Problem whole(h, 3000, DType::kF32, DType::kNone, DType::kF32, 0, 11);
    Problem split(h, 3000, DType::kF32, DType::kNone, DType::kF32, 0, 11);
    whole.next_grad(1.0);
    split.next_grad(1.0);
    std::vector<Span> ws = whole.spans();
    ASSERT_TRUE(step({.hyper = h, .spans = ws, .isa = Isa::kScalar}).ok());
    // The chunked runtime's way: phase 1 per chunk (separate calls), combine, phase 2 per chunk.
    std::vector<Span> ss = split.spans();
    TrustPartial parts[2];
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(trust_phase1({.hyper = h, .spans = {&ss[k], 1}, .isa = Isa::kScalar}, {&parts[k], 1}).ok());
    }
    // Exact sums, as step() combines them (Note [Exact norms]).
    ExactSum pe = parts[0].param_exact, oe = parts[0].other_exact;
    pe.add(parts[1].param_exact);
    oe.add(parts[1].other_exact);
    const double p2 = pe.to_double(), o2 = oe.to_double();
    const float ratio = o == Optimizer::kLamb ? lamb_trust_ratio(p2, o2) : lars_trust_ratio(h, p2, o2);
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(trust_phase2({.hyper = h, .spans = {&ss[k], 1}, .isa = Isa::kScalar}, {&ratio, 1}).ok());
    }
    EXPECT_TRUE(Snapshot(whole) == Snapshot(split)) << optimizer_name(o);
  }
}

TEST(StepApi, GradStatsMatchesDoubleSum) {
  Problem pb(hyper(Optimizer::kSgd), 100000, DType::kF16, DType::kNone, DType::kF32, 1, 21);
  const std::vector<double> g = pb.next_grad(0.25);
  double want = 0.0;
  for (double x : g) want += x * x;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!isa_supported(isa)) continue;
    Result<GradStats> gs = grad_stats(pb.spans(), 0.25f, nullptr, isa);
    ASSERT_TRUE(gs.ok());
    EXPECT_NEAR(gs->sum_squares, want, 1e-5 * want) << isa_name(isa);
  }
  EXPECT_FLOAT_EQ(clip_coefficient(10.0, 1.0), static_cast<float>(1.0 / (10.0 + 1e-6)));
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0f);
  EXPECT_FLOAT_EQ(nvlamb_grad_scale(4.0, 1.0, 128.0), 1.0f / 512.0f);
}

}  // namespace
}  // namespace strata::kernels::test
