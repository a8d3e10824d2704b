#pragma once
// Test helper: one tensor's buffers (master, grad, param copy, two states) in
// chosen dtypes, optionally misaligned, seeded, split into spans, plus the
// double-precision reference that follows it.

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "reference.hpp"
#include "strata/kernels/dtype.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::kernels::test {

//! A typed buffer inside an over-allocated byte vector, starting `offset_elems` past a 64-byte boundary.
struct Buffer {
  std::vector<unsigned char> bytes;
  DType dtype = DType::kNone;
  unsigned char* data = nullptr;
  std::size_t n = 0;

  void init(DType d, std::size_t count, std::size_t offset_elems) {
    dtype = d;
    n = count;
    if (d == DType::kNone) return;
    bytes.assign(count * dtype_size(d) + 128 + offset_elems * 4, 0);
    auto base = reinterpret_cast<std::uintptr_t>(bytes.data());
    data = reinterpret_cast<unsigned char*>((base + 63) / 64 * 64) + offset_elems * dtype_size(d);
  }
  //! Stores x rounded to the dtype; returns the value actually stored.
  double set(std::size_t i, double x) {
    const float f = static_cast<float>(x);
    switch (dtype) {
      case DType::kF32:
        std::memcpy(data + 4 * i, &f, 4);
        return f;
      case DType::kBF16: {
        std::uint16_t h = float_to_bf16(f);
        std::memcpy(data + 2 * i, &h, 2);
        return bf16_to_float(h);
      }
      case DType::kF16: {
        std::uint16_t h = float_to_f16(f);
        std::memcpy(data + 2 * i, &h, 2);
        return f16_to_float(h);
      }
      case DType::kQ8:
      case DType::kNone:
        return 0.0;
    }
    return 0.0;
  }
  double get(std::size_t i) const {
    switch (dtype) {
      case DType::kF32: {
        float f;
        std::memcpy(&f, data + 4 * i, 4);
        return f;
      }
      case DType::kBF16:
      case DType::kF16: {
        std::uint16_t h;
        std::memcpy(&h, data + 2 * i, 2);
        return dtype == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
      }
      case DType::kQ8:
      case DType::kNone:
        return 0.0;
    }
    return 0.0;
  }
  std::vector<unsigned char> snapshot() const {
    return data ? std::vector<unsigned char>(data, data + n * dtype_size(dtype))
                : std::vector<unsigned char>{};
  }
};

struct Problem {
  Hyper hyper;
  std::size_t n = 0;
  Buffer master, grad, param, s0, s1;
  RefTensor ref;
  std::vector<double> init_s0;
  std::mt19937_64 rng;

  Problem(const Hyper& h, std::size_t count, DType grad_dtype, DType param_dtype, DType state_dtype,
          std::size_t offset_elems, std::uint64_t seed)
      : hyper(h), n(count), rng(seed) {
    master.init(DType::kF32, n, offset_elems);
    grad.init(grad_dtype, n, offset_elems);
    param.init(param_dtype, n, offset_elems);
    s0.init(state_dtype, n, offset_elems);
    s1.init(state_dtype, n, offset_elems);
    ref.p.resize(n);
    ref.s0.assign(n, 0.0);
    ref.s1.assign(n, 0.0);
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    const double s0_init = h.optimizer == Optimizer::kAdagrad ? 0.1 : 0.0;
    // SGD/LARS buffers start as garbage: step 1 must overwrite them, not read them.
    const bool garbage_buf = h.optimizer == Optimizer::kSgd || h.optimizer == Optimizer::kLars;
    for (std::size_t i = 0; i < n; ++i) {
      ref.p[i] = master.set(i, u(rng));
      ref.s0[i] = s0.set(i, garbage_buf ? 123.0 : s0_init);
      ref.s1[i] = s1.set(i, 0.0);
    }
  }

  //! Fills the gradient for the next step; returns the reference's scaled gradient.
  std::vector<double> next_grad(double scale) {
    std::uniform_real_distribution<double> u(-0.2, 0.2);
    std::vector<double> g(n);
    for (std::size_t i = 0; i < n; ++i) g[i] = grad.set(i, u(rng)) * scale;
    return g;
  }

  //! Two spans of one tensor (split at n/2), as a chunked runtime would see them.
  std::vector<Span> spans() const {
    std::vector<Span> out;
    const std::size_t cut[3] = {0, n / 2, n};
    for (int k = 0; k < 2; ++k) {
      const std::size_t b = cut[k];
      Span s;
      s.n = cut[k + 1] - b;
      s.master = reinterpret_cast<float*>(master.data) + b;
      s.grad = grad.data + b * dtype_size(grad.dtype);
      s.grad_dtype = grad.dtype;
      s.param = param.data ? param.data + b * dtype_size(param.dtype) : nullptr;
      s.param_dtype = param.dtype;
      s.state = {s0.data + b * dtype_size(s0.dtype), s1.data + b * dtype_size(s1.dtype)};
      s.state_dtype = s0.dtype;
      s.tensor = 7;
      out.push_back(s);
    }
    return out;
  }
};

}  // namespace strata::kernels::test
