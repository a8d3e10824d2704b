#pragma once
// The body of the memory-only kernel (Note [Memory-only roofline]), a template
// over a lane policy. Included only by mem_kernel_<isa>.cpp; everything here is
// in an anonymous namespace so no ISA's code is shared with another through an
// inline symbol (the same reason as kernels' Note [ISA translation units]).
//
// A policy P provides: V (32-bit lanes), kWidth, zero(), set1(), load4(),
// load2() and load1() (zero-extend 16- and 8-bit elements), store4(), store2()
// and store1() (keep the low 16 or 8 bits of each lane; lanes hold values that
// fit), add(), and_(), shr16(), low() (lane 0) and hsum().

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "roofline/mem_roofline.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::bench {
namespace {

//! A pass's stream widths as compile-time values.
struct Shape {
  int grad, master, states, state, param;  //!< bytes (0 absent); master: 0 absent, 1 read, 2 read+write
  bool state_write;
  bool block_scales = false;  //!< q8: both states' per-block scales (Note [Q8 roofline])
  friend constexpr bool operator==(const Shape&, const Shape&) = default;
};

// The shapes kernels::step() and grad_stats() produce for f32 / 2-byte gradients,
// params and states (mem_passes_for_step in mem_roofline.cpp builds them).
constexpr Shape kShapes[] = {
    {4, 0, 0, 4, 0, false},      {2, 0, 0, 4, 0, false},  // grad_stats
    {4, 2, 2, 4, 0, true},       {2, 2, 2, 4, 2, true},
    {2, 2, 2, 2, 2, true},       {4, 2, 2, 2, 0, true},   // Adam(W)
    {4, 2, 1, 4, 0, true},       {2, 2, 1, 4, 2, true},   // SGD momentum, Lion, Adagrad, LARS phase 2
    {4, 2, 0, 4, 0, false},      {2, 2, 0, 4, 2, false},  // SGD / LARS phase 2 without momentum
    {4, 1, 2, 4, 0, true},       {2, 1, 2, 4, 0, true},
    {2, 1, 2, 2, 0, true},       {4, 1, 2, 2, 0, true},  // LAMB 1
    {0, 2, 2, 4, 0, false},      {0, 2, 2, 4, 2, false},
    {0, 2, 2, 2, 2, false},      {0, 2, 2, 2, 0, false},  // LAMB 2
    {4, 1, 0, 4, 0, false},      {2, 1, 0, 4, 0, false},  // LARS phase 1
    {4, 2, 2, 1, 0, true, true},                          // q8 Adam(W), fp32 gradient, no param copy
};

//! Sum of the 32-bit lanes of a vector register.
template <typename V>
std::uint64_t hsum_lanes(V x) {
  std::uint32_t lanes[sizeof(V) / 4];
  std::memcpy(lanes, &x, sizeof(V));
  std::uint64_t s = 0;
  for (std::uint32_t l : lanes) s += l;
  return s;
}

template <typename P, int kBytes>
inline typename P::V load_n(const void* base, std::size_t i) {
  if constexpr (kBytes == 4) return P::load4(static_cast<const unsigned char*>(base) + 4 * i);
  if constexpr (kBytes == 1) return P::load1(static_cast<const unsigned char*>(base) + i);
  if constexpr (kBytes == 2) return P::load2(static_cast<const unsigned char*>(base) + 2 * i);
  return P::zero();
}

template <typename P, int kBytes>
inline void store_n(void* base, std::size_t i, typename P::V x) {
  if constexpr (kBytes == 4) P::store4(static_cast<unsigned char*>(base) + 4 * i, x);
  if constexpr (kBytes == 2) P::store2(static_cast<unsigned char*>(base) + 2 * i, x);
  if constexpr (kBytes == 1) P::store1(static_cast<unsigned char*>(base) + i, x);
}

//! q8: at a block's first element, each state's scale loaded and stored back (+ dep, 0).
template <Shape S>
inline void block_scales_n(const MemPass& m, std::size_t i, std::uint32_t dep) {
  if constexpr (S.block_scales) {
    if (i % kernels::kQ8BlockElems != 0) return;
    for (const MemStream& b : m.block_scales) {
      std::uint32_t x;
      unsigned char* at = static_cast<unsigned char*>(b.data) + 4 * (i / kernels::kQ8BlockElems);
      std::memcpy(&x, at, 4);
      x += dep;
      std::memcpy(at, &x, 4);
    }
  }
}

//! Elements [begin, end) in steps of P::kWidth; returns the sink of the read-only streams.
//! kWritePrefetch: also prefetch the write-only param stream for writing (Note [Write prefetch]).
template <typename P, Shape S, bool kWritePrefetch>
typename P::V mem_loop(const MemPass& m, std::size_t begin, std::size_t end, typename P::V zero) {
  using V = typename P::V;
  V sink = P::zero();
  for (std::size_t i = begin; i + P::kWidth <= end; i += P::kWidth) {
    // The kernels' prefetch (Note [Software prefetch]): the same streams, distance and rate.
    if constexpr (P::kWidth >= 8) {
      if (P::kWidth >= 16 || i % 16 == 0) {
        const std::size_t at = i + kernels::kPrefetchElems;
        if constexpr (S.grad != 0) __builtin_prefetch(static_cast<const char*>(m.grad.data) + at * S.grad);
        if constexpr (S.master != 0) __builtin_prefetch(static_cast<const char*>(m.master.data) + at * 4);
        for (int k = 0; k < S.states; ++k) {
          __builtin_prefetch(static_cast<const char*>(m.state[k].data) + at * S.state);
        }
        if constexpr (kWritePrefetch && S.param != 0) {
          __builtin_prefetch(static_cast<const char*>(m.param.data) + at * S.param, 1);
        }
      }
    }
    const V g = load_n<P, S.grad>(m.grad.data, i);
    const V p = S.master ? load_n<P, 4>(m.master.data, i) : P::zero();
    V s[2] = {P::zero(), P::zero()};
    for (int k = 0; k < S.states; ++k) s[k] = load_n<P, S.state>(m.state[k].data, i);
    // Every store depends on a load; (x AND zero) keeps the stored values unchanged.
    const V dep = P::and_(S.grad ? g : (S.states ? s[0] : p), zero);
    block_scales_n<S>(m, i, P::low(dep));
    if constexpr (S.grad != 0) sink = P::add(sink, g);
    if constexpr (S.master == 2) {
      store_n<P, 4>(m.master.data, i, P::add(p, dep));
    } else if constexpr (S.master == 1) {
      sink = P::add(sink, p);
    }
    for (int k = 0; k < S.states; ++k) {
      if constexpr (S.state_write) {
        store_n<P, S.state>(m.state[k].data, i, P::add(s[k], dep));
      } else {
        sink = P::add(sink, s[k]);
      }
    }
    if constexpr (S.param == 2) store_n<P, 2>(m.param.data, i, P::shr16(P::add(p, dep)));
    if constexpr (S.param == 4) store_n<P, 4>(m.param.data, i, P::add(p, dep));
  }
  return sink;
}

//! Runs [begin, end) of m with the policy P's lanes and the scalar policy Q for
//! the ragged tail. False when m's shape is not in kShapes.
template <typename P, typename Q, std::size_t... I>
bool mem_piece_with(const Shape& want, MemVariant variant, const MemPass& m, std::size_t begin,
                    std::size_t end, std::uint32_t zero, std::uint64_t* sink, std::index_sequence<I...>) {
  auto one = [&]<std::size_t K>(std::integral_constant<std::size_t, K>) {
    if (!(want == kShapes[K])) return false;
    const std::size_t full = begin + (end - begin) / P::kWidth * P::kWidth;
    if (variant == MemVariant::kWritePrefetch) {
      *sink += P::hsum(mem_loop<P, kShapes[K], true>(m, begin, full, P::set1(zero)));
    } else {
      *sink += P::hsum(mem_loop<P, kShapes[K], false>(m, begin, full, P::set1(zero)));
    }
    if (full < end) *sink += Q::hsum(mem_loop<Q, kShapes[K], false>(m, full, end, Q::set1(zero)));
    return true;
  };
  return (one(std::integral_constant<std::size_t, I>{}) || ...);
}

//! The shape of a pass, as kShapes spells it.
inline Shape shape_of(const MemPass& m) {
  return Shape{m.grad.elem_bytes,
               m.master.elem_bytes == 0 ? 0 : (m.master.write ? 2 : 1),
               (m.state[0].elem_bytes ? 1 : 0) + (m.state[1].elem_bytes ? 1 : 0),
               m.state[0].elem_bytes ? m.state[0].elem_bytes : 4,
               m.param.elem_bytes,
               m.state[0].elem_bytes != 0 && m.state[0].write,
               m.block_scales[0].elem_bytes != 0};
}

template <typename P, typename Q>
bool mem_piece(const MemPass& m, MemVariant variant, std::size_t begin, std::size_t end, std::uint32_t zero,
               std::uint64_t* sink) {
  return mem_piece_with<P, Q>(shape_of(m), variant, m, begin, end, zero, sink,
                              std::make_index_sequence<std::size(kShapes)>{});
}

//! One lane of 32 bits: the scalar policy, and every ISA's tail.
struct Scalar {
  using V = std::uint32_t;
  static constexpr std::size_t kWidth = 1;
  static V zero() { return 0; }
  static V set1(std::uint32_t x) { return x; }
  static V load4(const void* p) {
    V x;
    std::memcpy(&x, p, 4);
    return x;
  }
  static V load2(const void* p) {
    std::uint16_t x;
    std::memcpy(&x, p, 2);
    return x;
  }
  static V load1(const void* p) { return *static_cast<const std::uint8_t*>(p); }
  static void store1(void* p, V x) { *static_cast<std::uint8_t*>(p) = static_cast<std::uint8_t>(x); }
  static std::uint32_t low(V a) { return a; }
  static void store4(void* p, V x) { std::memcpy(p, &x, 4); }
  static void store2(void* p, V x) {
    const auto h = static_cast<std::uint16_t>(x);
    std::memcpy(p, &h, 2);
  }
  static V add(V a, V b) { return a + b; }
  static V and_(V a, V b) { return a & b; }
  static V shr16(V a) { return a >> 16; }
  static std::uint64_t hsum(V a) { return a; }
};

//! The triad body, vectorised by the compiler with the translation unit's flags.
inline void triad_loop(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
                       std::size_t begin, std::size_t end) {
  for (std::size_t i = begin; i < end; ++i) a[i] = b[i] + s * c[i];
}

}  // namespace
}  // namespace strata::bench
