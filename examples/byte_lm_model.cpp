// strata-example-lm's model (byte_lm_model.hpp).
#include "byte_lm_model.hpp"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "strata/common/log.hpp"

namespace strata::example {
namespace {

void sgemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, const float* a, const float* b,
           float* c, float beta) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a,
              ta ? static_cast<int>(m) : static_cast<int>(k), b,
              tb ? static_cast<int>(k) : static_cast<int>(n), beta, c, static_cast<int>(n));
}

}  // namespace

Status build(Runtime& rt, Model& m, std::uint64_t seed) {
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  std::normal_distribution<float> n(0.0f, 1.0f);
  STRATA_ASSIGN_OR_RETURN(m.embed, rt.register_tensor("embed", {256, static_cast<std::int64_t>(m.E)}));
  for (std::size_t l = 0; l <= m.D; ++l) {
    STRATA_ASSIGN_OR_RETURN(
        TensorId w, rt.register_tensor(fmt::format("l{}.w", l), {static_cast<std::int64_t>(m.in_dim(l)),
                                                                 static_cast<std::int64_t>(m.out_dim(l))}));
    STRATA_ASSIGN_OR_RETURN(
        TensorId b, rt.register_tensor(fmt::format("l{}.b", l), {static_cast<std::int64_t>(m.out_dim(l))}));
    m.w.push_back(w);
    m.b.push_back(b);
  }
  std::vector<float> e(256 * m.E);
  for (auto& v : e) v = 0.5f * n(rng);
  STRATA_RETURN_IF_ERROR(rt.init_tensor(m.embed, e));
  for (std::size_t l = 0; l <= m.D; ++l) {
    std::vector<float> w(m.in_dim(l) * m.out_dim(l));
    const float scale = std::sqrt(2.0f / static_cast<float>(m.in_dim(l))) * (l == m.D ? 0.2f : 1.0f);
    for (auto& v : w) v = scale * n(rng);
    STRATA_RETURN_IF_ERROR(rt.init_tensor(m.w[l], w));
    STRATA_RETURN_IF_ERROR(rt.init_tensor(m.b[l], std::vector<float>(m.out_dim(l), 0.0f)));
  }
  m.act.resize(m.D + 2);
  m.dact.resize(m.D + 2);
  m.act[0].resize(m.B * m.C * m.E);
  m.dact[0].resize(m.B * m.C * m.E);
  for (std::size_t l = 0; l <= m.D; ++l) {
    m.act[l + 1].resize(m.B * m.out_dim(l));
    m.dact[l + 1].resize(m.B * m.out_dim(l));
  }
  return Status::Ok();
}

// One training step's forward and backward through leases.
Status train_step(Runtime& rt, Model& m) {
  const std::size_t B = m.B, C = m.C, E = m.E;
  {  // gather the byte embeddings
    STRATA_ASSIGN_OR_RETURN(Lease e, rt.param(m.embed));
    const float* table = e.as<float>();
    STRATA_RETURN_IF_ERROR(rt.launch([&m, table, B, C, E] {
      for (std::size_t r = 0; r < B; ++r)
        for (std::size_t c = 0; c < C; ++c)
          std::copy_n(table + m.ctx[r * C + c] * E, E, m.act[0].data() + (r * C + c) * E);
    }));
  }
  for (std::size_t l = 0; l <= m.D; ++l) {
    STRATA_ASSIGN_OR_RETURN(Lease w, rt.param(m.w[l]));
    STRATA_ASSIGN_OR_RETURN(Lease b, rt.param(m.b[l]));
    const float* W = w.as<float>();
    const float* bias = b.as<float>();
    STRATA_RETURN_IF_ERROR(rt.launch([&m, l, W, bias, B] {
      const std::size_t out = m.out_dim(l);
      float* y = m.act[l + 1].data();
      for (std::size_t r = 0; r < B; ++r) std::copy_n(bias, out, y + r * out);
      sgemm(false, false, B, out, m.in_dim(l), m.act[l].data(), W, y, 1.0f);
      if (l < m.D) {
        for (std::size_t i = 0; i < B * out; ++i) y[i] = std::max(y[i], 0.0f);
      }
    }));
  }
  STRATA_RETURN_IF_ERROR(rt.launch([&m, B] {  // softmax cross-entropy
    float total = 0;
    for (std::size_t r = 0; r < B; ++r) {
      const float* z = m.act[m.D + 1].data() + r * 256;
      float* dz = m.dact[m.D + 1].data() + r * 256;
      const float mx = *std::max_element(z, z + 256);
      float sum = 0;
      for (int i = 0; i < 256; ++i) sum += std::exp(z[i] - mx);
      for (int i = 0; i < 256; ++i) dz[i] = std::exp(z[i] - mx) / sum / static_cast<float>(B);
      dz[m.next[r]] -= 1.0f / static_cast<float>(B);
      total += std::log(sum) + mx - z[m.next[r]];
    }
    m.loss = total / static_cast<float>(B);
  }));
  for (std::size_t l = m.D + 1; l-- > 0;) {
    STRATA_ASSIGN_OR_RETURN(Lease w, rt.param(m.w[l]));
    STRATA_ASSIGN_OR_RETURN(Lease gw, rt.grad(m.w[l]));
    STRATA_ASSIGN_OR_RETURN(Lease gb, rt.grad(m.b[l]));
    const float* W = w.as<float>();
    float* GW = gw.as<float>();
    float* GB = gb.as<float>();
    STRATA_RETURN_IF_ERROR(rt.launch([&m, l, W, GW, GB, B] {
      const std::size_t in = m.in_dim(l), out = m.out_dim(l);
      const float* dy = m.dact[l + 1].data();
      sgemm(true, false, in, out, B, m.act[l].data(), dy, GW, 0.0f);  // dW = x^T dy
      std::fill_n(GB, out, 0.0f);
      for (std::size_t r = 0; r < B; ++r)
        for (std::size_t j = 0; j < out; ++j) GB[j] += dy[r * out + j];
      float* dx = m.dact[l].data();
      sgemm(false, true, B, in, out, dy, W, dx, 0.0f);  // dx = dy W^T
      if (l > 0) {
        const float* x = m.act[l].data();
        for (std::size_t i = 0; i < B * in; ++i) dx[i] = x[i] > 0 ? dx[i] : 0.0f;
      }
    }));
  }
  STRATA_ASSIGN_OR_RETURN(Lease ge, rt.grad(m.embed));
  float* GE = ge.as<float>();
  return rt.launch([&m, GE, B, C, E] {  // scatter into the embedding gradient
    std::fill_n(GE, 256 * E, 0.0f);
    for (std::size_t r = 0; r < B; ++r)
      for (std::size_t c = 0; c < C; ++c) {
        const float* d = m.dact[0].data() + (r * C + c) * E;
        float* g = GE + m.ctx[r * C + c] * E;
        for (std::size_t k = 0; k < E; ++k) g[k] += d[k];
      }
  });
}

}  // namespace strata::example
