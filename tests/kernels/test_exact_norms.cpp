// #14: norms summed in 64-element groups aligned to the chunk and added exactly
// (Note [Exact norms]) give the same bits however a tensor is cut at shard
// boundaries (multiples of 64 from the chunk's start), on every ISA: the
// gradient norm² (clipping) and LAMB/LARS's ||p||² and ||u||² / ||g||².
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "strata/kernels/optim.hpp"

namespace strata::kernels {
namespace {

constexpr std::size_t kChunk = 4096;
constexpr std::size_t kFirst = 37;  // the tensor's chunk offset: not a group boundary
constexpr std::size_t kCount = 3500;

//! Values spread over 2^-12 .. 2^12 within every 16 elements, and each run of
//! 16 scaled by 2^-40 .. 2^40: fp32 group sums round, and so does a double sum
//! of the squares (they span far more than 53 bits).
std::vector<float> spread(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> m(-2.0f, 2.0f);
  std::uniform_int_distribution<int> e(-12, 12), run(-40, 40);
  std::vector<float> v(n);
  int scale = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 16 == 0) scale = run(rng);
    v[i] = std::ldexp(m(rng), e(rng) + scale);
  }
  return v;
}

//! The tensor's parts on W ranks: [max(first, r C/W), min(end, (r+1) C/W)), non-empty ones.
std::vector<std::pair<std::size_t, std::size_t>> parts(int w) {
  std::vector<std::pair<std::size_t, std::size_t>> out;
  const std::size_t shard = kChunk / static_cast<std::size_t>(w);
  for (int r = 0; r < w; ++r) {
    const std::size_t b = std::max(kFirst, static_cast<std::size_t>(r) * shard);
    const std::size_t e = std::min(kFirst + kCount, static_cast<std::size_t>(r + 1) * shard);
    if (b < e) out.emplace_back(b, e);
  }
  return out;
}

std::vector<Isa> isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

Span grad_span(const std::vector<float>& chunk, std::size_t b, std::size_t e) {
  Span s;
  s.grad = chunk.data() + b;
  s.n = e - b;
  s.group_phase = static_cast<std::uint32_t>(b % kGroupElems);
  return s;
}

TEST(ExactNorms, GradNormOfATensorCutAtShardBoundariesIsOneRanksBitForBit) {
  bool old_order_differs = false;
  for (unsigned seed = 1; seed <= 4; ++seed) {
    const std::vector<float> chunk = spread(kChunk, seed);
    for (Isa isa : isas()) {
      const Span whole_span = grad_span(chunk, kFirst, kFirst + kCount);
      Result<GradStats> whole = grad_stats({&whole_span, 1}, 0.5f, nullptr, isa);
      ASSERT_TRUE(whole.ok()) << whole.status();
      ASSERT_TRUE(whole->exact);
      for (int w : {2, 4}) {
        ExactSum ranks;          // each rank's grad_stats of its part, added as the all-reduce does
        double old_order = 0.0;  // what summing the parts' doubles (the old exchange) gives
        for (const auto& [b, e] : parts(w)) {
          const Span s = grad_span(chunk, b, e);
          Result<GradStats> part = grad_stats({&s, 1}, 0.5f, nullptr, isa);
          ASSERT_TRUE(part.ok()) << part.status();
          ranks.add(part->sum_exact);
          old_order += part->sum_squares;
        }
        EXPECT_EQ(ranks.to_double(), whole->sum_squares) << isa_name(isa) << " W " << w << " seed " << seed;
        old_order_differs = old_order_differs || old_order != whole->sum_squares;
      }
    }
  }
  // The data is such that adding the parts' rounded sums does not give one rank's bits.
  EXPECT_TRUE(old_order_differs);
}

TEST(ExactNorms, TrustNormsOfATensorCutAtShardBoundariesAreOneRanksBitForBit) {
  for (Optimizer o : {Optimizer::kLamb, Optimizer::kLars}) {
    Hyper h;
    h.optimizer = o;
    h.lr = 1e-2f;
    h.weight_decay = 0.01f;
    if (o == Optimizer::kLars) h.momentum = 0.9f;
    for (Isa isa : isas()) {
      const std::vector<float> grad = spread(kChunk, 5), master0 = spread(kChunk, 6);
      // One rank: the whole tensor in one span.
      std::vector<float> master = master0, m(kChunk, 0.0f), v(kChunk, 0.0f);
      Span whole;
      whole.master = master.data() + kFirst;
      whole.grad = grad.data() + kFirst;
      whole.state = {m.data() + kFirst, o == Optimizer::kLamb ? v.data() + kFirst : nullptr};
      whole.n = kCount;
      whole.group_phase = kFirst % kGroupElems;
      TrustPartial one;
      ASSERT_TRUE(trust_phase1({.hyper = h, .step = 1, .spans = {&whole, 1}, .isa = isa}, {&one, 1}).ok());
      ASSERT_TRUE(one.exact);
      for (int w : {2, 4}) {
        std::vector<float> pm = master0, pmom(kChunk, 0.0f), pv(kChunk, 0.0f);
        ExactSum p_sum, o_sum;
        for (const auto& [b, e] : parts(w)) {
          Span s;
          s.master = pm.data() + b;
          s.grad = grad.data() + b;
          s.state = {pmom.data() + b, o == Optimizer::kLamb ? pv.data() + b : nullptr};
          s.n = e - b;
          s.group_phase = static_cast<std::uint32_t>(b % kGroupElems);
          TrustPartial part;
          ASSERT_TRUE(trust_phase1({.hyper = h, .step = 1, .spans = {&s, 1}, .isa = isa}, {&part, 1}).ok());
          p_sum.add(part.param_exact);
          o_sum.add(part.other_exact);
        }
        EXPECT_TRUE(p_sum == one.param_exact) << optimizer_name(o) << " " << isa_name(isa) << " W " << w;
        EXPECT_TRUE(o_sum == one.other_exact) << optimizer_name(o) << " " << isa_name(isa) << " W " << w;
        EXPECT_EQ(p_sum.to_double(), one.param_sq);
        EXPECT_EQ(o_sum.to_double(), one.other_sq);
        EXPECT_GT(one.other_sq, 0.0);
      }
    }
  }
}

TEST(ExactNorms, AGroupPhaseOutOfRangeIsRefused) {
  std::vector<float> g(10, 1.0f);
  Span s;
  s.grad = g.data();
  s.n = g.size();
  s.group_phase = kGroupElems;
  Result<GradStats> r = grad_stats({&s, 1}, 1.0f);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("group_phase"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace strata::kernels
