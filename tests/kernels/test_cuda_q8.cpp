// The CUDA q8 kernel (label gpu; Note [Q8 on CUDA] in kernels/src/cuda/cuda_q8.cu)
// against the scalar CPU kernel, bit for bit: full and partial blocks, several
// spans, fp32/bf16/fp16 gradients, with and without a bf16 param copy, Adam and
// AdamW, several steps; a non-finite gradient writes nothing. Skips, saying
// why, without a GPU or a CUDA build.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "strata/kernels/cuda.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::kernels {
namespace {

//! One span's buffers in managed memory (host-visible), and its Q8Span.
struct Q8Buffers {
  std::size_t n = 0;
  CudaBuffer master, grad, param, mc, ms, vc, vs;
  DType grad_dtype = DType::kF32;
  bool with_param = false;

  Q8Buffers(std::size_t elems, DType gd, bool param_copy, std::uint32_t seed)
      : n(elems), grad_dtype(gd), with_param(param_copy) {
    auto alloc = [](std::size_t bytes) { return std::move(CudaBuffer::allocate(bytes + 64, true).value()); };
    master = alloc(n * 4);
    grad = alloc(n * 4);
    param = alloc(n * 2);
    mc = alloc(n);
    vc = alloc(n);
    ms = alloc(q8_blocks(n) * 4);
    vs = alloc(q8_blocks(n) * 4);
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) static_cast<float*>(master.data())[i] = d(rng);
    q8_zero_states(span());
  }
  Q8Span span() const {
    return Q8Span{.master = static_cast<float*>(master.data()),
                  .grad = grad.data(),
                  .grad_dtype = grad_dtype,
                  .param = with_param ? param.data() : nullptr,
                  .param_dtype = with_param ? DType::kBF16 : DType::kNone,
                  .m_codes = static_cast<std::uint8_t*>(mc.data()),
                  .m_scales = static_cast<float*>(ms.data()),
                  .v_codes = static_cast<std::uint8_t*>(vc.data()),
                  .v_scales = static_cast<float*>(vs.data()),
                  .n = n};
  }
  //! Gradients of mixed magnitude (codes across the whole map) in grad_dtype.
  void fill_grad(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> d(0.0f, 1.0f);
    for (std::size_t i = 0; i < n; ++i) {
      const float g = d(rng) * std::pow(10.0f, static_cast<float>(i % 7) - 4.0f);
      if (grad_dtype == DType::kF32) static_cast<float*>(grad.data())[i] = g;
      if (grad_dtype == DType::kBF16) static_cast<std::uint16_t*>(grad.data())[i] = float_to_bf16(g);
      if (grad_dtype == DType::kF16) static_cast<std::uint16_t*>(grad.data())[i] = float_to_f16(g);
    }
  }
  //! Every byte the step writes, for comparison.
  std::vector<unsigned char> bytes() const {
    std::vector<unsigned char> out;
    auto add = [&](const CudaBuffer& b, std::size_t len) {
      const auto* p = static_cast<const unsigned char*>(b.data());
      out.insert(out.end(), p, p + len);
    };
    add(master, n * 4);
    if (with_param) add(param, n * 2);
    add(mc, n);
    add(vc, n);
    add(ms, q8_blocks(n) * 4);
    add(vs, q8_blocks(n) * 4);
    return out;
  }
};

class CudaQ8 : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Status s = cuda_probe(); !s.ok()) GTEST_SKIP() << "no usable GPU: " << s.to_string();
  }
};

TEST_F(CudaQ8, EqualsCpuKernelBitForBit) {
  for (const Optimizer opt : {Optimizer::kAdamW, Optimizer::kAdam}) {
    for (const DType gd : {DType::kF32, DType::kBF16, DType::kF16}) {
      const std::vector<std::size_t> sizes = {1, 255, 256, 257, 1000, 2 * kPieceElems + 300};
      std::vector<Q8Buffers> cpu, gpu;
      for (std::size_t k = 0; k < sizes.size(); ++k) {
        const bool param = k % 2 == 1;
        cpu.emplace_back(sizes[k], gd, param, static_cast<std::uint32_t>(k + 1));
        gpu.emplace_back(sizes[k], gd, param, static_cast<std::uint32_t>(k + 1));
      }
      Hyper h;
      h.optimizer = opt;
      h.lr = 1e-2f;
      h.weight_decay = 0.1f;
      for (std::int64_t t = 1; t <= 3; ++t) {
        std::vector<Q8Span> cs, gs;
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          cpu[k].fill_grad(static_cast<std::uint32_t>(t * 31 + k));
          gpu[k].fill_grad(static_cast<std::uint32_t>(t * 31 + k));
          cs.push_back(cpu[k].span());
          gs.push_back(gpu[k].span());
        }
        Result<StepReport> c =
            step_q8({.hyper = h, .step = t, .grad_scale = 0.5f, .spans = cs, .isa = Isa::kScalar});
        ASSERT_TRUE(c.ok()) << c.status().to_string();
        Result<StepReport> g = cuda_step_q8({.hyper = h, .step = t, .grad_scale = 0.5f, .spans = gs});
        ASSERT_TRUE(g.ok()) << g.status().to_string();
        ASSERT_TRUE(g->applied);
        for (std::size_t k = 0; k < sizes.size(); ++k) {
          ASSERT_EQ(cpu[k].bytes(), gpu[k].bytes())
              << optimizer_name(opt) << " grad " << dtype_name(gd) << " n " << sizes[k] << " step " << t;
        }
      }
    }
  }
}

TEST_F(CudaQ8, NonFiniteGradientWritesNothing) {
  Q8Buffers b(1000, DType::kF32, true, 3);
  b.fill_grad(5);
  const Q8Span s = b.span();
  Hyper h;
  ASSERT_TRUE(cuda_step_q8({.hyper = h, .step = 1, .spans = {&s, 1}}).ok());
  for (const float bad : {std::nanf(""), INFINITY, -INFINITY}) {
    static_cast<float*>(b.grad.data())[777] = bad;
    const std::vector<unsigned char> before = b.bytes();
    Result<StepReport> r = cuda_step_q8({.hyper = h, .step = 2, .spans = {&s, 1}});
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    EXPECT_FALSE(r->grads_finite);
    EXPECT_FALSE(r->applied);
    EXPECT_EQ(before, b.bytes());
  }
}

}  // namespace
}  // namespace strata::kernels
