// Note [Software prefetch]: the SIMD kernels prefetch exactly the streams each
// pass reads. A stream prefetched but never read would be extra memory traffic
// (e.g. the gradient in LAMB's phase 2) that no value check can see.
#include <gtest/gtest.h>

#include <set>

#include "cpu/driver.hpp"

namespace strata::kernels::cpu {
namespace {

struct Buffers {
  float master[16], grad[16], param[16], s0[16], s1[16];
  Span span() {
    Span s;
    s.n = 16;
    s.master = master;
    s.grad = grad;
    s.param = param;
    s.param_dtype = DType::kF32;
    s.state = {s0, s1};
    return s;
  }
};

// The distinct stream bases a PrefetchStreams covers.
std::set<const void*> bases(const PrefetchStreams& p) {
  std::set<const void*> out;
  for (const char* b : p.base) out.insert(b);
  return out;
}

Hyper hyper(Optimizer o, float momentum = 0.0f) {
  Hyper h;
  h.optimizer = o;
  h.momentum = momentum;
  return h;
}

TEST(PrefetchStreams, EachPassPrefetchesWhatItReadsAndNothingElse) {
  Buffers b;
  const Span s = b.span();
  using Set = std::set<const void*>;
  const Set adam = {b.grad, b.master, b.s0, b.s1};
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kUpdate, hyper(Optimizer::kAdamW), s)), adam);
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kGradStats, hyper(Optimizer::kAdamW), s)), Set{b.grad});
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kTrustPhase1, hyper(Optimizer::kLamb), s)), adam);
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kTrustPhase2, hyper(Optimizer::kLamb), s)),
            (Set{b.master, b.s0, b.s1}));
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kTrustPhase1, hyper(Optimizer::kLars, 0.9f), s)),
            (Set{b.grad, b.master}));
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kTrustPhase2, hyper(Optimizer::kLars, 0.9f), s)),
            (Set{b.grad, b.master, b.s0}));
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kTrustPhase2, hyper(Optimizer::kLars), s)),
            (Set{b.grad, b.master}));
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kUpdate, hyper(Optimizer::kSgd), s)), (Set{b.grad, b.master}));
  EXPECT_EQ(bases(PrefetchStreams::of(Pass::kUpdate, hyper(Optimizer::kLion), s)),
            (Set{b.grad, b.master, b.s0}));
}

TEST(PrefetchStreams, ElementSizesFollowTheDtypes) {
  Buffers b;
  Span s = b.span();
  s.grad_dtype = DType::kBF16;
  s.state_dtype = DType::kBF16;
  const PrefetchStreams p = PrefetchStreams::of(Pass::kUpdate, hyper(Optimizer::kAdamW), s);
  for (int k = 0; k < 4; ++k) {
    const void* base = p.base[k];
    const std::size_t want = base == static_cast<const void*>(b.master) ? 4 : 2;
    EXPECT_EQ(p.size[k], want) << "stream " << k;
  }
}

}  // namespace
}  // namespace strata::kernels::cpu
