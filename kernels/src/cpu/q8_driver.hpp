#pragma once
// The q8 Adam block kernel (Note [Q8 step] in q8.hpp), one template over a lane
// type T. Besides Lanes<T> (lanes.hpp) each ISA supplies Q8Lanes<T>: gather
// from a map by codes, the nearest-code search (Note [Q8 nearest-code search]
// in table.hpp), |x| and the lanes' max.
// Included only by the per-ISA translation units (Note [ISA translation units]).

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/table.hpp"
#include "strata/kernels/lanes.hpp"
#include "strata/kernels/ops_dispatch.hpp"
#include "strata/kernels/q8.hpp"
#include "strata/kernels/rules/adam.hpp"

namespace strata::kernels::cpu {

template <typename T>
struct Q8Lanes;

//! One lane: the plain definitions every other Q8Lanes must match bit for bit.
template <>
struct Q8Lanes<float> {
  static float gather(const float* map, const std::uint8_t* codes) { return map[*codes]; }
  //! The number of thresholds below x (Note [Q8 nearest-code search]).
  static void quantize(const Q8Search& s, float x, std::uint8_t* out) {
    std::uint32_t c = s.lo[q8_bucket(float_bits(x))];
    const std::uint32_t lo = c;
    for (std::uint32_t j = 0; j < s.extra; ++j) c += s.thresholds[lo + j] < x ? 1u : 0u;
    *out = static_cast<std::uint8_t>(c);
  }
  static float abs(float x) { return std::fabs(x); }
  static float hmax(float x) { return x; }
};

template <typename T, DType G, DType P>
struct Q8AdamBlock {
  //! Updates `count` elements (a multiple of the lane width) at `at`, whose
  //! block scales are m_scale / v_scale; writes the new scales there.
  //! Returns g * 0 folded over the lanes (NaN iff a gradient was not finite).
  static T run(const Q8Span& s, std::size_t at, std::size_t count, float& m_scale, float& v_scale,
               const AdamCoeffs& c, float grad_scale, const Q8Tables& tab) {
    constexpr std::size_t kW = Lanes<T>::kWidth;
    using Q = Q8Lanes<T>;
    alignas(64) float mf[kQ8BlockElems];
    alignas(64) float vf[kQ8BlockElems];
    T bad = T(0.0f), m_max = T(0.0f), v_max = T(0.0f);
    const T ms = T(m_scale), vs = T(v_scale);
    for (std::size_t i = 0; i < count; i += kW) {
      const T g = load<T, G>(s.grad, at + i) * T(grad_scale);
      bad = madd(g, T(0.0f), bad);
      T p = load<T, DType::kF32>(s.master, at + i);
      T m = Q::gather(tab.signed_map, s.m_codes + at + i) * ms;
      T v = Q::gather(tab.unsigned_map, s.v_codes + at + i) * vs;
      adam_rule(p, m, v, g, c);
      Lanes<T>::store_f32(mf + i, m);
      Lanes<T>::store_f32(vf + i, v);
      m_max = vmax(m_max, Q::abs(m));
      v_max = vmax(v_max, Q::abs(v));
      store<T, DType::kF32>(s.master, at + i, p);
      store<T, P>(s.param, at + i, p);
    }
    m_scale = Q::hmax(m_max);
    v_scale = Q::hmax(v_max);
    const T m_inv = T(m_scale > 0.0f ? 1.0f / m_scale : 0.0f);
    const T v_inv = T(v_scale > 0.0f ? 1.0f / v_scale : 0.0f);
    for (std::size_t i = 0; i < count; i += kW) {
      Q::quantize(tab.signed_search, Lanes<T>::load_f32(mf + i) * m_inv, s.m_codes + at + i);
      Q::quantize(tab.unsigned_search, Lanes<T>::load_f32(vf + i) * v_inv, s.v_codes + at + i);
    }
    return bad;
  }

  //! A partial last block: staged through zero-state buffers so it runs the
  //! same vector code; padding lanes hold the code of 0 (adding nothing to the
  //! scales) and a zero gradient, master and param.
  static T run_partial(const Q8Span& s, std::size_t at, std::size_t count, float& m_scale, float& v_scale,
                       const AdamCoeffs& c, float grad_scale, const Q8Tables& tab) {
    constexpr std::size_t kW = Lanes<T>::kWidth;
    alignas(64) float master[kQ8BlockElems] = {};
    alignas(64) unsigned char grad[kQ8BlockElems * 4] = {};
    alignas(64) unsigned char param[kQ8BlockElems * 4] = {};
    alignas(64) std::uint8_t m_codes[kQ8BlockElems];
    alignas(64) std::uint8_t v_codes[kQ8BlockElems];
    std::fill(std::begin(m_codes), std::end(m_codes), tab.signed_zero);
    std::fill(std::begin(v_codes), std::end(v_codes), tab.unsigned_zero);
    const std::size_t gsize = dtype_size(G), psize = dtype_size(P);
    std::memcpy(master, s.master + at, count * 4);
    std::memcpy(grad, static_cast<const unsigned char*>(s.grad) + at * gsize, count * gsize);
    std::memcpy(m_codes, s.m_codes + at, count);
    std::memcpy(v_codes, s.v_codes + at, count);
    Q8Span t = s;
    t.master = master;
    t.grad = grad;
    t.param = P == DType::kNone ? nullptr : param;
    t.m_codes = m_codes;
    t.v_codes = v_codes;
    const std::size_t padded = (count + kW - 1) / kW * kW;
    const T bad = run(t, 0, padded, m_scale, v_scale, c, grad_scale, tab);
    std::memcpy(s.master + at, master, count * 4);
    if constexpr (P != DType::kNone)
      std::memcpy(static_cast<unsigned char*>(s.param) + at * psize, param, count * psize);
    std::memcpy(s.m_codes + at, m_codes, count);
    std::memcpy(s.v_codes + at, v_codes, count);
    return bad;
  }
};

//! The body of each ISA's q8_piece_<isa>(): blocks [begin, end) of s (begin a
//! multiple of kQ8BlockElems). Returns true when a gradient was not finite.
template <typename T>
bool q8_piece_with(const Q8Span& s, std::size_t begin, std::size_t end, const AdamCoeffs& c, float grad_scale,
                   const Q8Tables& tab) {
  bool nonfinite = false;
  const bool known = detail::on_grad_dtype(s.grad_dtype, [&](auto gt) {
    return detail::on_param_dtype(s.param_dtype, [&](auto pt) {
      using Block = Q8AdamBlock<T, decltype(gt)::value, decltype(pt)::value>;
      for (std::size_t b = begin; b < end; b += kQ8BlockElems) {
        const std::size_t count = std::min(end - b, kQ8BlockElems);
        const std::size_t blk = b / kQ8BlockElems;
        const T bad =
            count == kQ8BlockElems
                ? Block::run(s, b, count, s.m_scales[blk], s.v_scales[blk], c, grad_scale, tab)
                : Block::run_partial(s, b, count, s.m_scales[blk], s.v_scales[blk], c, grad_scale, tab);
        if (!std::isfinite(Lanes<T>::hsum(bad))) nonfinite = true;
      }
      return true;
    });
  });
  STRATA_CHECK(known);  // validate_q8_spans() admits only these dtypes
  return nonfinite;
}

}  // namespace strata::kernels::cpu
