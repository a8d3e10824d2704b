// 100-step trajectories against torch.optim (fixtures/torch_trajectories.json,
// written by gen_torch_reference.py with Debian's python3-torch 1.13).
//
// Tolerance: |ours - torch| <= 2e-6 + 2e-6 |torch| at steps 1, 10 and 100, for
// every implementation. Both sides compute in float32 but in different orders
// (torch's foreach ops vs our fused rule, FMA on the SIMD paths), so bits differ
// by a few ulps per step; measured worst case 6.6e-7 (AdamW, FMA paths), printed per run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>

#include "strata/kernels/grid.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::kernels::test {
namespace {

// The same hash as gen_torch_reference.py: integer mixing, then IEEE double.
double hash_unit(std::uint64_t i, std::uint64_t t, std::uint64_t salt) {
  std::uint64_t x = (i * 2654435761ull + t * 40503ull + salt * 97ull) & 0xFFFFFFFFull;
  x ^= x >> 13;
  x = (x * 1274126177ull) & 0xFFFFFFFFull;
  x ^= x >> 16;
  return (static_cast<double>(x % 2001) - 1000.0) / 1000.0;
}

nlohmann::json load_fixture() {
  std::ifstream in(STRATA_TORCH_FIXTURE);
  EXPECT_TRUE(in.good()) << "cannot open " << STRATA_TORCH_FIXTURE;
  return nlohmann::json::parse(in);
}

Hyper hyper_of(const std::string& name, const nlohmann::json& j) {
  Hyper h;
  if (name == "adamw") h.optimizer = Optimizer::kAdamW;
  if (name == "adam") h.optimizer = Optimizer::kAdam;
  if (name.rfind("sgd", 0) == 0) h.optimizer = Optimizer::kSgd;
  if (name == "adagrad") h.optimizer = Optimizer::kAdagrad;
  h.lr = j.value("lr", h.lr);
  h.beta1 = j.value("beta1", h.beta1);
  h.beta2 = j.value("beta2", h.beta2);
  h.eps = j.value("eps", h.eps);
  h.weight_decay = j.value("weight_decay", h.weight_decay);
  h.momentum = j.value("momentum", h.momentum);
  h.dampening = j.value("dampening", h.dampening);
  h.nesterov = j.value("nesterov", h.nesterov);
  h.lr_decay = j.value("lr_decay", h.lr_decay);
  return h;
}

class TorchReference : public ::testing::TestWithParam<std::string> {};

TEST_P(TorchReference, HundredStepsMatchTorchOptim) {
  const std::string impl = GetParam();
  if (impl == "avx2" && !isa_supported(Isa::kAvx2)) GTEST_SKIP() << "this CPU lacks AVX2";
  if (impl == "avx512" && !isa_supported(Isa::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512";
  const nlohmann::json fx = load_fixture();
  const std::size_t n = fx["n"];
  const int steps = fx["steps"];
  ASSERT_EQ(fx["cases"].size(), 5u);
  for (const auto& c : fx["cases"]) {
    const std::string name = c["name"];
    SCOPED_TRACE(name);
    const Hyper h = hyper_of(name, c["hyper"]);
    std::vector<float> master(n), grad(n), s0(n, 0.0f), s1(n, 0.0f);
    for (std::size_t i = 0; i < n; ++i) master[i] = static_cast<float>(hash_unit(i, 0, 1));
    Span span{.master = master.data(), .grad = grad.data(), .state = {s0.data(), s1.data()}, .n = n};
    double worst = 0.0;
    for (int t = 1; t <= steps; ++t) {
      for (std::size_t i = 0; i < n; ++i) grad[i] = static_cast<float>(0.1 * hash_unit(i, t, 2));
      StepArgs args{.hyper = h, .step = t, .grad_scale = 1.0f, .spans = {&span, 1}};
      Result<StepReport> r =
          impl == "grid" ? grid_step_emulated(args) : (args.isa = parse_isa(impl).value(), step(args));
      ASSERT_TRUE(r.ok()) << r.status().to_string();
      ASSERT_TRUE(r->applied);
      const std::string key = std::to_string(t);
      if (!c["params"].contains(key)) continue;
      const auto& want = c["params"][key];
      for (std::size_t i = 0; i < n; ++i) {
        const double w = want[i], d = std::fabs(double{master[i]} - w);
        worst = std::max(worst, d);
        ASSERT_LE(d, 2e-6 + 2e-6 * std::fabs(w)) << "step " << t << " element " << i;
      }
    }
    std::printf("[ torch ] %-7s %-13s worst |ours - torch| over %d steps = %.3g\n", impl.c_str(),
                name.c_str(), steps, worst);
  }
}

INSTANTIATE_TEST_SUITE_P(AllImpls, TorchReference, ::testing::Values("scalar", "avx2", "avx512", "grid"));

}  // namespace
}  // namespace strata::kernels::test
