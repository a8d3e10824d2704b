// The memory-only roofline kernel (bench/roofline, Note [Memory-only roofline]):
// for every ISA this CPU has and every pass kernels::step() makes, it leaves the
// in-place streams' values unchanged, writes the param, moves the bytes the
// optimizer benchmark counts, and uses no more threads than the pool has.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "roofline/mem_roofline.hpp"
#include "strata/common/thread_pool.hpp"

namespace strata::bench {
namespace {

using kernels::DType;
using kernels::Isa;
using kernels::Optimizer;

struct Case {
  Optimizer optimizer;
  DType grad, param, state;
  float momentum;
};

std::vector<Case> cases() {
  const DType f = DType::kF32, b = DType::kBF16, h = DType::kF16, none = DType::kNone;
  return {{Optimizer::kAdamW, f, none, f, 0}, {Optimizer::kAdamW, b, b, f, 0},
          {Optimizer::kAdamW, b, b, b, 0},    {Optimizer::kAdam, h, h, f, 0},
          {Optimizer::kLamb, f, none, f, 0},  {Optimizer::kLamb, b, b, f, 0},
          {Optimizer::kLamb, b, b, b, 0},     {Optimizer::kLars, f, none, f, 0.9f},
          {Optimizer::kLars, f, none, f, 0},  {Optimizer::kSgd, f, none, f, 0.9f},
          {Optimizer::kSgd, b, b, f, 0},      {Optimizer::kLion, f, none, f, 0},
          {Optimizer::kAdagrad, b, b, f, 0}};
}

//! n elements of dtype d with distinct non-trivial bit patterns.
std::vector<unsigned char> pattern(std::size_t n, DType d, unsigned seed) {
  std::vector<unsigned char> v(n * kernels::dtype_size(d) + 1);  // +1: unaligned start below
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<unsigned char>(i * 131 + seed * 17 + 7);
  return v;
}

class MemRoofline : public ::testing::TestWithParam<Isa> {};

TEST_P(MemRoofline, KeepsValuesAndWritesParam) {
  const Isa isa = GetParam();
  if (!kernels::isa_supported(isa)) GTEST_SKIP() << "this CPU lacks " << kernels::isa_name(isa);
  auto pool = std::move(ThreadPool::create({.threads = 1}).value());
  for (const Case& c : cases()) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, kernels::kPieceElems + 5}) {
      SCOPED_TRACE(testing::Message()
                   << kernels::optimizer_name(c.optimizer) << " grad " << kernels::dtype_name(c.grad)
                   << " state " << kernels::dtype_name(c.state) << " n " << n);
      auto master = pattern(n, DType::kF32, 1), grad = pattern(n, c.grad, 2);
      auto s0 = pattern(n, c.state, 3), s1 = pattern(n, c.state, 4);
      std::vector<unsigned char> param(n * 2 + 1 + (c.param == DType::kNone ? 0 : n * 2), 0);
      kernels::Span span;
      span.n = n;
      span.master = reinterpret_cast<float*>(master.data() + 1);  // unaligned on purpose
      span.grad = grad.data() + 1;
      span.grad_dtype = c.grad;
      span.param = c.param == DType::kNone ? nullptr : param.data() + 1;
      span.param_dtype = c.param;
      span.state = {s0.data() + 1, s1.data() + 1};
      span.state_dtype = c.state;
      kernels::Hyper h;
      h.optimizer = c.optimizer;
      h.momentum = c.momentum;
      const auto before = std::vector{master, grad, s0, s1};
      const std::vector<MemPass> passes = mem_passes_for_step(h, span, true);
      for (MemVariant variant : kMemVariants) {  // each keeps the values (Note [Write prefetch])
        Result<MemTiming> t = run_mem_passes(passes, pool.get(), isa, variant);
        ASSERT_TRUE(t.ok()) << t.status().to_string() << " " << mem_variant_name(variant);
        EXPECT_LE(t->threads_used, 1u);  // a pool of one: the caller alone
      }
      EXPECT_EQ(master, before[0]);
      EXPECT_EQ(grad, before[1]);
      EXPECT_EQ(s0, before[2]);
      EXPECT_EQ(s1, before[3]);
      if (c.param != DType::kNone) {
        for (std::size_t i = 0; i < n; ++i) {
          std::uint32_t m;
          std::uint16_t p;
          std::memcpy(&m, master.data() + 1 + 4 * i, 4);
          std::memcpy(&p, param.data() + 1 + 2 * i, 2);
          ASSERT_EQ(p, m >> 16) << "element " << i;
        }
      }
    }
  }
}

// The q8 pass (Note [Q8 roofline]): 1-byte codes and per-block scales kept too.
TEST_P(MemRoofline, Q8PassKeepsValues) {
  const Isa isa = GetParam();
  if (!kernels::isa_supported(isa)) GTEST_SKIP() << "this CPU lacks " << kernels::isa_name(isa);
  auto pool = std::move(ThreadPool::create({.threads = 1}).value());
  for (std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{257}, kernels::kPieceElems + 5}) {
    SCOPED_TRACE(testing::Message() << "n " << n);
    const std::size_t blocks = kernels::q8_blocks(n);
    auto master = pattern(n, DType::kF32, 1), grad = pattern(n, DType::kF32, 2);
    std::vector<unsigned char> mc(n + 1), vc(n + 1);
    for (std::size_t i = 0; i <= n; ++i) {
      mc[i] = static_cast<unsigned char>(i * 37 + 5);
      vc[i] = static_cast<unsigned char>(i * 53 + 11);
    }
    auto ms = pattern(blocks, DType::kF32, 5), vs = pattern(blocks, DType::kF32, 6);
    const kernels::Q8Span span{.master = reinterpret_cast<float*>(master.data() + 1),  // unaligned on purpose
                               .grad = grad.data() + 1,
                               .m_codes = mc.data() + 1,
                               .m_scales = reinterpret_cast<float*>(ms.data() + 1),
                               .v_codes = vc.data() + 1,
                               .v_scales = reinterpret_cast<float*>(vs.data() + 1),
                               .n = n};
    const auto before = std::vector{master, grad, mc, vc, ms, vs};
    const MemPass pass = mem_pass_for_q8(span);
    for (MemVariant variant : kMemVariants) {
      Result<MemTiming> t = run_mem_passes({&pass, 1}, pool.get(), isa, variant);
      ASSERT_TRUE(t.ok()) << t.status().to_string() << " " << mem_variant_name(variant);
    }
    EXPECT_EQ((std::vector{master, grad, mc, vc, ms, vs}), before);
  }
}

TEST_P(MemRoofline, TriadComputes) {
  const Isa isa = GetParam();
  if (!kernels::isa_supported(isa)) GTEST_SKIP() << "this CPU lacks " << kernels::isa_name(isa);
  const std::size_t n = kernels::kPieceElems * 2 + 3;
  std::vector<float> a(n), b(n, 1.0f), c(n, 2.0f);
  ASSERT_TRUE(run_triad(a.data(), b.data(), c.data(), n, nullptr, isa).ok());
  for (float x : a) ASSERT_EQ(x, 7.0f);
}

INSTANTIATE_TEST_SUITE_P(Isas, MemRoofline, ::testing::Values(Isa::kScalar, Isa::kAvx2, Isa::kAvx512),
                         [](const ::testing::TestParamInfo<Isa>& p) {
                           return std::string(kernels::isa_name(p.param));
                         });

TEST(MemRoofline, BytesPerElementCountsEveryStream) {
  std::vector<unsigned char> buf(64);
  kernels::Span span;
  span.n = 1;
  span.master = reinterpret_cast<float*>(buf.data());
  span.grad = buf.data();
  span.grad_dtype = DType::kBF16;
  span.param = buf.data();
  span.param_dtype = DType::kBF16;
  span.state = {buf.data(), buf.data()};
  kernels::Hyper h;
  h.optimizer = Optimizer::kAdamW;
  // grad 2 + master 4 + 4 + states 2 x (4 + 4) + param 2 = 28 (as bench_optim's Note [Bytes per param]).
  const auto passes = mem_passes_for_step(h, span, false);
  ASSERT_EQ(passes.size(), 1u);
  EXPECT_EQ(passes[0].bytes_per_elem(), 28.0);
  // With the separate gradient check, one more pass reads the gradient.
  EXPECT_EQ(mem_passes_for_step(h, span, true).size(), 2u);
  h.optimizer = Optimizer::kLamb;
  double lamb = 0;
  for (const MemPass& m : mem_passes_for_step(h, span, false)) lamb += m.bytes_per_elem();
  // phase 1: grad 2, master read 4, states rw 16; phase 2: master rw 8, states read 8, param 2.
  EXPECT_EQ(lamb, (2 + 4 + 16) + (8 + 8 + 2));
  // q8: grad 4, master 4 + 4, codes 2 x (1 + 1), scales 2 x (4 + 4) per 256 (Note [Q8 roofline]).
  std::vector<float> scales(2);
  const kernels::Q8Span q8{.master = span.master,
                           .grad = buf.data(),
                           .m_codes = buf.data(),
                           .m_scales = scales.data(),
                           .v_codes = buf.data(),
                           .v_scales = scales.data(),
                           .n = 1};
  EXPECT_EQ(mem_pass_for_q8(q8).bytes_per_elem(), 4 + 8 + 4 + 16.0 / 256);
}

}  // namespace
}  // namespace strata::bench
