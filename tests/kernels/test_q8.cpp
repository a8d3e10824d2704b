// 8-bit Adam states (issue #49): the maps' properties, and every ISA's
// step_q8 against a plain scalar reference written here, bit for bit
// (Note [Q8 step] in q8.hpp): full and partial blocks, fp32/bf16/fp16
// gradients, with and without a param copy, several steps, any thread count;
// a non-finite gradient writes nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu/q8_driver.hpp"  // the scalar search (Note [Q8 nearest-code search])
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/q8.hpp"
#include "strata/kernels/rules/adam.hpp"

namespace strata::kernels {
namespace {

// ---- the maps ----

TEST(Q8Maps, SortedWithZeroAndBitsandbytesEnds) {
  for (const auto* map : {&q8_signed_map(), &q8_unsigned_map()}) {
    for (std::size_t k = 1; k < 256; ++k) EXPECT_LT((*map)[k - 1], (*map)[k]) << "entry " << k;
    EXPECT_EQ(map->back(), 1.0f);
    EXPECT_EQ(std::count(map->begin(), map->end(), 0.0f), 1);
  }
  const auto& s = q8_signed_map();
  const auto& u = q8_unsigned_map();
  // Signed: 127 negatives, 0, 127 positives and 1; the most negative is
  // -(1 - 0.9 / 128), the midpoint of linspace(0.1, 1, 65)'s last step: no -1.
  EXPECT_EQ(s[127], 0.0f);
  EXPECT_FLOAT_EQ(s[0], -0.99296875f);
  EXPECT_FLOAT_EQ(s[254], 0.99296875f);
  EXPECT_FLOAT_EQ(s[128], 5.5e-7f);  // 1e-6 * (0.1 + 1) / 2
  // Unsigned: 0, then 254 positives, and 1.
  EXPECT_EQ(u[0], 0.0f);
  EXPECT_FLOAT_EQ(u[1], 3.25e-7f);  // 1e-6 * midpoint of linspace(0.1, 1, 3)'s first step
  EXPECT_FLOAT_EQ(u[254], 0.996484375f);
  // Symmetric below 1: the signed map's negatives mirror its positives.
  for (std::size_t k = 0; k < 127; ++k) EXPECT_EQ(s[k], -s[254 - k]) << k;
}

//! The nearest code by a linear count of the midpoints below x.
std::uint8_t reference_code(const std::array<float, 256>& map, float x);

// The bucket search equals the linear count at every threshold, one ulp either
// side, zeros, the ends and beyond, and random values of every magnitude.
TEST(Q8Maps, BucketSearchEqualsLinearCount) {
  const cpu::Q8Tables& tab = cpu::q8_tables();
  EXPECT_LE(tab.signed_search.extra, 1u);  // one compare per map: Note [Q8 nearest-code search]
  EXPECT_LE(tab.unsigned_search.extra, 1u);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> exponent(-30.0f, 1.0f);
  for (const bool is_signed : {true, false}) {
    const auto& map = is_signed ? q8_signed_map() : q8_unsigned_map();
    const cpu::Q8Search& search = is_signed ? tab.signed_search : tab.unsigned_search;
    std::vector<float> xs = {0.0f,  -0.0f,  1.0f,     -1.0f,     2.0f,  -2.0f,
                             1e30f, -1e30f, INFINITY, -INFINITY, 1e-40f};
    for (std::size_t k = 0; k + 1 < 256; ++k) {
      const float t = (map[k] + map[k + 1]) / 2.0f;
      xs.insert(xs.end(), {t, std::nextafter(t, -INFINITY), std::nextafter(t, INFINITY), map[k]});
    }
    for (int i = 0; i < 100000; ++i) {
      const float x = std::pow(2.0f, exponent(rng));
      xs.push_back(i % 2 == 0 ? x : -x);
    }
    for (const float x : xs) {
      std::uint8_t got = 0;
      cpu::Q8Lanes<float>::quantize(search, x, &got);
      ASSERT_EQ(got, reference_code(map, x)) << (is_signed ? "signed" : "unsigned") << " x = " << x;
    }
  }
}

// ---- a plain reference: dequantize, Adam in rules/adam.hpp's order, quantize ----

struct State {
  std::vector<float> master;
  std::vector<std::uint16_t> param;  // bf16 copy (when used)
  std::vector<std::uint8_t> mc, vc;
  std::vector<float> ms, vs;
};

//! The nearest code by a linear count of the midpoints below x.
std::uint8_t reference_code(const std::array<float, 256>& map, float x) {
  int c = 0;
  for (std::size_t k = 0; k + 1 < 256; ++k) c += (map[k] + map[k + 1]) / 2.0f < x ? 1 : 0;
  return static_cast<std::uint8_t>(c);
}

//! The nearest code by distance (the first on a tie): must be within one of reference_code.
int argmin_code(const std::array<float, 256>& map, float x) {
  int best = 0;
  for (int k = 1; k < 256; ++k) {
    if (std::fabs(x - map[k]) < std::fabs(x - map[best])) best = k;
  }
  return best;
}

void reference_step(State& st, const std::vector<float>& grad, float scale, const AdamCoeffs& c, bool param) {
  const auto& smap = q8_signed_map();
  const auto& umap = q8_unsigned_map();
  const std::size_t n = st.master.size();
  std::vector<float> m(n), v(n);
  for (std::size_t b = 0; b < q8_blocks(n); ++b) {
    const std::size_t lo = b * kQ8BlockElems, hi = std::min(n, lo + kQ8BlockElems);
    float m_max = 0.0f, v_max = 0.0f;
    for (std::size_t i = lo; i < hi; ++i) {
      float g = grad[i] * scale;
      float p = st.master[i];
      float mi = smap[st.mc[i]] * st.ms[b];
      float vi = umap[st.vc[i]] * st.vs[b];
      g = c.l2 * p + g;
      mi = c.beta1 * mi + c.one_minus_beta1 * g;
      vi = c.beta2 * vi + c.one_minus_beta2 * g * g;
      const float denom = std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps;
      p = p * c.decay - c.step_size * mi / denom;
      st.master[i] = p;
      if (param) st.param[i] = float_to_bf16(p);
      m[i] = mi;
      v[i] = vi;
      m_max = std::max(m_max, std::fabs(mi));
      v_max = std::max(v_max, std::fabs(vi));
    }
    st.ms[b] = m_max;
    st.vs[b] = v_max;
    const float m_inv = m_max > 0.0f ? 1.0f / m_max : 0.0f;
    const float v_inv = v_max > 0.0f ? 1.0f / v_max : 0.0f;
    for (std::size_t i = lo; i < hi; ++i) {
      st.mc[i] = reference_code(smap, m[i] * m_inv);
      st.vc[i] = reference_code(umap, v[i] * v_inv);
      if (n > 4096) continue;  // the distance scan is slow; small spans cover it
      EXPECT_LE(std::abs(argmin_code(smap, m[i] * m_inv) - st.mc[i]), 1);
      EXPECT_LE(std::abs(argmin_code(umap, v[i] * v_inv) - st.vc[i]), 1);
    }
  }
}

State zero_state(std::size_t n, std::uint32_t seed) {
  State st;
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  st.master.resize(n);
  for (float& x : st.master) x = d(rng);
  st.param.assign(n, 0);
  st.mc.assign(n, 0);
  st.vc.assign(n, 0);
  st.ms.assign(q8_blocks(n), 1.0f);
  st.vs.assign(q8_blocks(n), 1.0f);
  q8_zero_states(Q8Span{.m_codes = st.mc.data(),
                        .m_scales = st.ms.data(),
                        .v_codes = st.vc.data(),
                        .v_scales = st.vs.data(),
                        .n = n});
  return st;
}

//! Gradients of mixed magnitude, so blocks see codes across the whole map.
std::vector<float> make_grad(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = d(rng) * std::pow(10.0f, static_cast<float>(i % 7) - 4.0f);
  return g;
}

Q8Span span_of(State& st, const void* grad, DType grad_dtype, bool param) {
  return Q8Span{.master = st.master.data(),
                .grad = grad,
                .grad_dtype = grad_dtype,
                .param = param ? st.param.data() : nullptr,
                .param_dtype = param ? DType::kBF16 : DType::kNone,
                .m_codes = st.mc.data(),
                .m_scales = st.ms.data(),
                .v_codes = st.vc.data(),
                .v_scales = st.vs.data(),
                .n = st.master.size()};
}

// The same bits (NaN included); an empty vector's data() may be null, which memcmp must not get.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void expect_same(const State& a, const State& b, const std::string& what) {
  ASSERT_EQ(a.master.size(), b.master.size());
  EXPECT_TRUE(same_bits(a.master, b.master)) << what << ": master";
  EXPECT_EQ(a.param, b.param) << what << ": param";
  EXPECT_EQ(a.mc, b.mc) << what << ": m codes";
  EXPECT_EQ(a.vc, b.vc) << what << ": v codes";
  EXPECT_TRUE(same_bits(a.ms, b.ms)) << what << ": m scales";
  EXPECT_TRUE(same_bits(a.vs, b.vs)) << what << ": v scales";
}

class Q8Isa : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!isa_supported(GetParam())) {
      GTEST_SKIP() << "this CPU lacks " << isa_name(GetParam()) << " (AVX2+FMA+F16C / AVX-512 F/BW/DQ/VL)";
    }
  }
};

// Every size class: empty, shorter than a lane group, one lane group off,
// exactly a block, a block and one, several pieces with a partial last block.
TEST_P(Q8Isa, EqualsReferenceBitForBit) {
  const Isa isa = GetParam();
  for (const Optimizer opt : {Optimizer::kAdamW, Optimizer::kAdam}) {
    for (const std::size_t n : {0UL, 1UL, 7UL, 17UL, 255UL, 256UL, 257UL, 1000UL, 2 * kPieceElems + 300}) {
      for (const DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
        const bool param = gd != DType::kF32;  // exercise both with and without the copy
        Hyper h;
        h.optimizer = opt;
        h.lr = 1e-2f;
        h.weight_decay = 0.1f;
        State ref = zero_state(n, 7), got = zero_state(n, 7);
        for (std::int64_t t = 1; t <= 3; ++t) {
          std::vector<float> g = make_grad(n, static_cast<std::uint32_t>(t * 31 + n));
          std::vector<std::uint16_t> g16(n);
          for (std::size_t i = 0; i < n; ++i) {
            if (gd == DType::kBF16) g16[i] = float_to_bf16(g[i]);
            if (gd == DType::kF16) g16[i] = float_to_f16(g[i]);
            if (gd == DType::kBF16) g[i] = bf16_to_float(g16[i]);
            if (gd == DType::kF16) g[i] = f16_to_float(g16[i]);
          }
          const float scale = 0.5f;
          reference_step(ref, g, scale, adam_coeffs(h, t), param);
          const void* gp = gd == DType::kF32 ? static_cast<const void*>(g.data()) : g16.data();
          const Q8Span s = span_of(got, gp, gd, param);
          Result<StepReport> r =
              step_q8({.hyper = h, .step = t, .grad_scale = scale, .spans = {&s, 1}, .isa = isa});
          ASSERT_TRUE(r.ok()) << r.status().to_string();
          ASSERT_TRUE(r->applied);
          const std::string what = std::string(optimizer_name(opt)) + " n=" + std::to_string(n) + " grad " +
                                   std::string(dtype_name(gd)) + " step " + std::to_string(t);
          expect_same(ref, got, what);
          if (HasFailure()) return;
        }
      }
    }
  }
}

TEST_P(Q8Isa, NonFiniteGradientWritesNothing) {
  const std::size_t n = 1000;
  State st = zero_state(n, 3);
  std::vector<float> g = make_grad(n, 5);
  Hyper h;
  const Q8Span s = span_of(st, g.data(), DType::kF32, true);
  ASSERT_TRUE(step_q8({.hyper = h, .step = 1, .spans = {&s, 1}, .isa = GetParam()}).ok());
  for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    g[777] = bad;
    const State before = st;
    Result<StepReport> r = step_q8({.hyper = h, .step = 2, .spans = {&s, 1}, .isa = GetParam()});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->grads_finite);
    EXPECT_FALSE(r->applied);
    expect_same(before, st, "after a non-finite gradient");
  }
}

TEST_P(Q8Isa, SameBitsForAnyThreadCount) {
  const std::size_t n = 3 * kPieceElems + 1234;
  Hyper h;
  State one = zero_state(n, 11);
  std::vector<float> g = make_grad(n, 13);
  for (std::int64_t t = 1; t <= 2; ++t) {
    const Q8Span s = span_of(one, g.data(), DType::kF32, true);
    ASSERT_TRUE(step_q8({.hyper = h, .step = t, .spans = {&s, 1}, .isa = GetParam()}).ok());
  }
  for (const std::size_t threads : {2UL, 3UL, 8UL}) {
    std::unique_ptr<ThreadPool> pool = std::move(ThreadPool::create({.threads = threads}).value());
    State many = zero_state(n, 11);
    for (std::int64_t t = 1; t <= 2; ++t) {
      const Q8Span s = span_of(many, g.data(), DType::kF32, true);
      ASSERT_TRUE(
          step_q8({.hyper = h, .step = t, .spans = {&s, 1}, .pool = pool.get(), .isa = GetParam()}).ok());
    }
    expect_same(one, many, std::to_string(threads) + " threads");
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, Q8Isa, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const auto& p) { return std::string(isa_name(p.param)); });

TEST(Q8Step, RejectsMisuse) {
  State st = zero_state(10, 1);
  std::vector<float> g(10, 0.1f);
  Q8Span s = span_of(st, g.data(), DType::kF32, false);
  Hyper h;
  h.optimizer = Optimizer::kSgd;
  EXPECT_EQ(step_q8({.hyper = h, .spans = {&s, 1}}).status().code(), StatusCode::kInvalidArgument);
  h.optimizer = Optimizer::kAdamW;
  Q8Span missing = s;
  missing.v_scales = nullptr;
  EXPECT_EQ(step_q8({.hyper = h, .spans = {&missing, 1}}).status().code(), StatusCode::kInvalidArgument);
  Q8Span wrong = s;
  wrong.param_dtype = DType::kBF16;  // with no param pointer
  EXPECT_EQ(step_q8({.hyper = h, .spans = {&wrong, 1}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(step_q8({.hyper = h, .step = 0, .spans = {&s, 1}}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::kernels
