#pragma once
// The q8 Adam block kernel (Note [Q8 step] in q8.hpp), one template over a lane
// type T. Besides Lanes<T> (lanes.hpp) each ISA supplies Q8Lanes<T>: gather
// from a map by codes, the nearest-code search (Note [Q8 nearest-code search]
// in q8_search.hpp), |x| and the lanes' max.
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
    std::uint16_t b;
    bucket(x, &b);
    quantize(s, x, &b, out);
  }
  //! x's bucket (Note [Q8 nearest-code search]); below 2^16.
  static void bucket(float x, std::uint16_t* b) { *b = static_cast<std::uint16_t>(q8_bucket(float_bits(x))); }
  //! The number of thresholds below x, given its bucket b.
  static void quantize(const Q8Search& s, float x, const std::uint16_t* b, std::uint8_t* out) {
    const std::uint32_t e = s.entry[*b];
    *out = static_cast<std::uint8_t>((e >> 16) + ((e & kQ8KeyMask) < q8_key(float_bits(x)) ? 1u : 0u));
  }
  static float abs(float x) { return std::fabs(x); }
  static float hmax(float x) { return x; }
};

//! Note [Software prefetch] (driver.hpp) for the q8 streams: the gradient and
//! master one line per 16 elements, the codes one per 64, kPrefetchElems ahead.
//! The scalar kernel does not prefetch (it is compute-bound).
template <std::size_t kW, DType G>
inline void q8_prefetch(const Q8Span& s, std::size_t i) {
  if constexpr (kW >= 8) {
    if (kW < 16 && i % 16 != 0) return;
    const std::size_t at = i + kPrefetchElems;
    __builtin_prefetch(static_cast<const char*>(s.grad) + at * dtype_size(G));
    __builtin_prefetch(s.master + at);
    if (i % 64 == 0) {
      __builtin_prefetch(s.m_codes + at);
      __builtin_prefetch(s.v_codes + at);
    }
  }
}

// Note [Q8 passes over a block]
// A block runs four loops over its 256 elements: dequantize both states into
// two stack buffers; the Adam rule (as the fp32 kernel's loop, plus the two
// maxima); with the new scales, each element's bucket; the codes (Note [Q8
// lookups on AMD]). One loop doing the first two held about 100 operations an
// iteration with a long chain (lookups, then the square root and the divide),
// so the out-of-order window saw only two or three iterations and waited on
// latency: 1 thread in cache, 270 Mparams/s against 437 as separate loops.
// Dequantizing the next block inside this block's Adam loop (a two-block
// pipeline) gained nothing measurable (398 against 409 at 16 M params), so the
// loops stay per block. The buffers stay in L1; every element gets the same
// operations in the same order either way.

template <typename T, DType G, DType P>
struct Q8AdamBlock {
  //! Updates `count` elements (a multiple of the lane width) at `at`, whose
  //! block scales are m_scale / v_scale; writes the new scales there.
  //! Returns g * 0 folded over the lanes (NaN iff a gradient was not finite).
  static T run(const Q8Span& span, std::size_t at, std::size_t count, float& m_scale, float& v_scale,
               const AdamCoeffs& c, float grad_scale, const Q8Tables& tab) {
    constexpr std::size_t kW = Lanes<T>::kWidth;
    using Q = Q8Lanes<T>;
    const Q8Span s = span;  // a local copy: pointers stay in registers across the stores
    alignas(64) float mf[kQ8BlockElems];
    alignas(64) float vf[kQ8BlockElems];
    // Three short loops, not one long one (Note [Q8 passes over a block]).
    const T ms = T(m_scale), vs = T(v_scale);
    for (std::size_t i = 0; i < count; i += kW) {
      Lanes<T>::store_f32(mf + i, Q::gather(tab.signed_map, s.m_codes + at + i) * ms);
      Lanes<T>::store_f32(vf + i, Q::gather(tab.unsigned_map, s.v_codes + at + i) * vs);
    }
    T bad = T(0.0f), m_max = T(0.0f), v_max = T(0.0f);
    for (std::size_t i = 0; i < count; i += kW) {
      q8_prefetch<kW, G>(s, at + i);
      const T g = load<T, G>(s.grad, at + i) * T(grad_scale);
      bad = madd(g, T(0.0f), bad);
      T p = load<T, DType::kF32>(s.master, at + i);
      T m = Lanes<T>::load_f32(mf + i);
      T v = Lanes<T>::load_f32(vf + i);
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
    // The buckets first, then the codes: the lookups' indices come from memory
    // (Note [Q8 lookups on AMD]); x is the same product both times.
    alignas(64) std::uint16_t mb[kQ8BlockElems];
    alignas(64) std::uint16_t vb[kQ8BlockElems];
    for (std::size_t i = 0; i < count; i += kW) {
      Q::bucket(Lanes<T>::load_f32(mf + i) * m_inv, mb + i);
      Q::bucket(Lanes<T>::load_f32(vf + i) * v_inv, vb + i);
    }
    for (std::size_t i = 0; i < count; i += kW) {
      Q::quantize(tab.signed_search, Lanes<T>::load_f32(mf + i) * m_inv, mb + i, s.m_codes + at + i);
      Q::quantize(tab.unsigned_search, Lanes<T>::load_f32(vf + i) * v_inv, vb + i, s.v_codes + at + i);
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
  STRATA_CHECK(known);  // q8_validate() admits only these dtypes
  return nonfinite;
}

}  // namespace strata::kernels::cpu
