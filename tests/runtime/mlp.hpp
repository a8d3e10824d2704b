#pragma once
// A small MLP trained through the Runtime on the sim device: real forward and
// backward (ReLU layers, MSE loss), every parameter reached through leases, the
// math run as "device kernels" on the compute stream. Used by the runtime tests.

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "strata/runtime/runtime.hpp"

namespace strata::runtime::testing {

struct Mlp {
  std::size_t layers = 4;
  std::size_t width = 64;
  std::size_t batch = 8;
  std::vector<TensorId> w, b;
  std::vector<float> x, y;                // input and target (batch x width)
  std::vector<std::vector<float>> acts;   // activations per layer boundary
  std::vector<std::vector<float>> grads;  // d loss / d activation
  float loss = 0.0f;
  //! When set, a call that returns a failed prefetch's error (which did nothing:
  //! Note [Prefetch errors] in runtime/src/residency/eviction.cpp) is kept here and made again.
  std::vector<Status>* prefetch_errors = nullptr;

  static bool is_prefetch_error(const Status& s) {
    return s.message().find("prefetch (a read ahead of use)") != std::string::npos;
  }
  //! Makes the runtime call `f` (returning Status or Result), again after a failed
  //! prefetch's error when prefetch_errors is set (at most 100 times).
  template <class F>
  auto call(F&& f) -> decltype(f()) {
    for (int tries = 0;; ++tries) {
      auto r = f();
      Status s;
      if constexpr (std::is_same_v<decltype(r), Status>) {
        s = r;
      } else {
        s = r.status();
      }
      if (prefetch_errors == nullptr || s.ok() || !is_prefetch_error(s) || tries == 100) return r;
      prefetch_errors->push_back(std::move(s));
    }
  }

  //! Registers the tensors; `frozen_layer` (if < layers) gets a frozen bias.
  Status build(Runtime& rt, std::size_t frozen = ~std::size_t{0}) {
    frozen_layer = frozen;
    for (std::size_t l = 0; l < layers; ++l) {
      auto wi = rt.register_tensor(
          {fmt::format("l{}.w", l), {static_cast<std::int64_t>(width), static_cast<std::int64_t>(width)}});
      if (!wi.ok()) return wi.status();
      auto bi = rt.register_tensor(
          {fmt::format("l{}.b", l), {static_cast<std::int64_t>(width)}, DType::kF32, l == frozen});
      if (!bi.ok()) return bi.status();
      w.push_back(*wi);
      b.push_back(*bi);
    }
    std::mt19937 rng(7);
    std::normal_distribution<float> n(0.0f, 1.0f);
    x.resize(batch * width);
    y.resize(batch * width);
    for (auto& v : x) v = n(rng);
    for (auto& v : y) v = 0.5f * n(rng);
    acts.assign(layers + 1, std::vector<float>(batch * width));
    grads.assign(layers + 1, std::vector<float>(batch * width));
    const float scale = 1.0f / std::sqrt(static_cast<float>(width));
    for (std::size_t l = 0; l < layers; ++l) {
      std::vector<float> wv(width * width), bv(width, 0.01f);
      for (auto& v : wv) v = n(rng) * scale;
      if (Status s = rt.init_tensor(w[l], wv); !s.ok()) return s;
      if (Status s = rt.init_tensor(b[l], bv); !s.ok()) return s;
    }
    return Status::Ok();
  }

  //! One training step; `skip_layer` (if < layers) is bypassed this step (its
  //! params are not used: dynamic control flow).
  Status train_step(Runtime& rt, std::size_t skip_layer = ~std::size_t{0}) {
    acts[0] = x;
    for (std::size_t l = 0; l < layers; ++l) {
      if (l == skip_layer) {
        if (Status s = rt.launch([this, l] { acts[l + 1] = acts[l]; }); !s.ok()) return s;
        continue;
      }
      auto wl = call([&] { return rt.acquire(w[l], StateKind::kParam, Access::kRead); });
      if (!wl.ok()) return wl.status();
      auto bl = call([&] { return rt.acquire(b[l], StateKind::kParam, Access::kRead); });
      if (!bl.ok()) return bl.status();
      const float* W = wl->as<float>();
      const float* B = bl->as<float>();
      const bool relu = l + 1 < layers;
      if (Status s = rt.launch([this, l, W, B, relu] { forward(l, W, B, relu); }); !s.ok()) return s;
    }
    if (Status s = rt.launch([this] { loss_grad(); }); !s.ok()) return s;
    for (std::size_t l = layers; l-- > 0;) {
      if (l == skip_layer) {
        if (Status s = rt.launch([this, l] { grads[l] = grads[l + 1]; }); !s.ok()) return s;
        continue;
      }
      auto wl = call([&] { return rt.acquire(w[l], StateKind::kParam, Access::kRead); });
      if (!wl.ok()) return wl.status();
      auto gw = call([&] { return rt.acquire(w[l], StateKind::kGrad, Access::kWrite); });
      if (!gw.ok()) return gw.status();
      float* GB = nullptr;
      Lease gb;
      if (!frozen_bias(rt, l)) {
        auto g = call([&] { return rt.acquire(b[l], StateKind::kGrad, Access::kWrite); });
        if (!g.ok()) return g.status();
        gb = std::move(g).value();
        GB = gb.as<float>();
      }
      const float* W = wl->as<float>();
      float* GW = gw->as<float>();
      const bool relu = l + 1 < layers;
      if (Status s = rt.launch([this, l, W, GW, GB, relu] { backward(l, W, GW, GB, relu); }); !s.ok())
        return s;
    }
    return Status::Ok();
  }

  bool frozen_bias(Runtime&, std::size_t l) const { return l == frozen_layer; }
  std::size_t frozen_layer = ~std::size_t{0};

  void forward(std::size_t l, const float* W, const float* B, bool relu) {
    const auto& in = acts[l];
    auto& out = acts[l + 1];
    for (std::size_t r = 0; r < batch; ++r) {
      for (std::size_t j = 0; j < width; ++j) {
        float s = B[j];
        for (std::size_t k = 0; k < width; ++k) s += in[r * width + k] * W[k * width + j];
        out[r * width + j] = relu && s < 0.0f ? 0.0f : s;
      }
    }
  }
  void loss_grad() {
    const auto& out = acts[layers];
    auto& g = grads[layers];
    float total = 0.0f;
    const float n = static_cast<float>(batch * width);
    for (std::size_t i = 0; i < out.size(); ++i) {
      const float d = out[i] - y[i];
      total += d * d;
      g[i] = 2.0f * d / n;
    }
    loss = total / n;
  }
  void backward(std::size_t l, const float* W, float* GW, float* GB, bool relu) {
    auto& gout = grads[l + 1];
    if (relu) {
      for (std::size_t i = 0; i < gout.size(); ++i) {
        if (acts[l + 1][i] <= 0.0f) gout[i] = 0.0f;
      }
    }
    const auto& in = acts[l];
    for (std::size_t k = 0; k < width; ++k) {
      for (std::size_t j = 0; j < width; ++j) {
        float s = 0.0f;
        for (std::size_t r = 0; r < batch; ++r) s += in[r * width + k] * gout[r * width + j];
        GW[k * width + j] = s;
      }
    }
    if (GB != nullptr) {
      for (std::size_t j = 0; j < width; ++j) {
        float s = 0.0f;
        for (std::size_t r = 0; r < batch; ++r) s += gout[r * width + j];
        GB[j] = s;
      }
    }
    auto& gin = grads[l];
    for (std::size_t r = 0; r < batch; ++r) {
      for (std::size_t k = 0; k < width; ++k) {
        float s = 0.0f;
        for (std::size_t j = 0; j < width; ++j) s += gout[r * width + j] * W[k * width + j];
        gin[r * width + k] = s;
      }
    }
  }
};

}  // namespace strata::runtime::testing
