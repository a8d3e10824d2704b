#pragma once
// The CPU driver: runs one op over [begin, end) of a span in lane groups of
// Lanes<T>::kWidth, in blocks of kBlockElems, staging the ragged tail through
// zero-padded buffers so the tail runs the very same vector code.
// Included only by the per-ISA translation units (kernels_<isa>.cpp).
//
// Note [ISA translation units]
// kernels_avx2.cpp and kernels_avx512.cpp are compiled with their target flags.
// Everything they instantiate is a template over their own lane type, which
// lives in an anonymous namespace, so no AVX code can leak into a shared inline
// symbol that the scalar path would link against; the default build stays
// runnable on any x86-64 and CPUID (isa.cpp) decides what runs.

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/table.hpp"
#include "strata/kernels/ops.hpp"

namespace strata::kernels::cpu {

template <typename T, typename Op>
inline void run_tail(const Op& op, const Span& s, std::size_t at, std::size_t count, const PassArgs& pa,
                     Acc<T>& acc) {
  constexpr std::size_t kW = Lanes<T>::kWidth;
  alignas(64) unsigned char buf[5][kW * 4] = {};
  Span t = s;
  void* const src[5] = {s.master, const_cast<void*>(s.grad), s.param, s.state[0], s.state[1]};
  const std::size_t size[5] = {4, dtype_size(s.grad_dtype), dtype_size(s.param_dtype),
                               dtype_size(s.state_dtype), dtype_size(s.state_dtype)};
  void* dst[5] = {};
  for (int k = 0; k < 5; ++k) {
    if (src[k] == nullptr || size[k] == 0) continue;
    std::memcpy(buf[k], static_cast<unsigned char*>(src[k]) + at * size[k], count * size[k]);
    dst[k] = buf[k];
  }
  t.master = static_cast<float*>(dst[0]);
  t.grad = dst[1];
  t.param = dst[2];
  t.state = {dst[3], dst[4]};
  op(t, 0, pa, acc);
  for (int k : {0, 2, 3, 4}) {  // never the gradient: it is read-only
    if (dst[k] != nullptr)
      std::memcpy(static_cast<unsigned char*>(src[k]) + at * size[k], buf[k], count * size[k]);
  }
}

template <typename T, typename Op>
PieceResult drive(const Op& op, const Span& s, std::size_t begin, std::size_t end, const PassArgs& pa) {
  constexpr std::size_t kW = Lanes<T>::kWidth;
  static_assert(kBlockElems % kW == 0, "blocks hold whole lane groups");
  PieceResult r;
  for (std::size_t b = begin; b < end; b += kBlockElems) {
    const std::size_t e = std::min(end, b + kBlockElems);
    const std::size_t full = b + (e - b) / kW * kW;
    Acc<T> acc;
    for (std::size_t i = b; i < full; i += kW) op(s, i, pa, acc);
    if (full < e) run_tail<T>(op, s, full, e - full, pa, acc);
    r.a += static_cast<double>(Lanes<T>::hsum(acc.a));
    r.b += static_cast<double>(Lanes<T>::hsum(acc.b));
    if (!std::isfinite(Lanes<T>::hsum(acc.bad))) r.nonfinite = true;
  }
  return r;
}

//! The body of each ISA's run_piece_<isa>().
template <typename T>
PieceResult run_piece_with(Pass pass, const Hyper& h, const Span& s, std::size_t begin, std::size_t end,
                           const PassArgs& pa) {
  PieceResult r;
  const bool known = with_op(pass, h, s, [&](const auto& op) { r = drive<T>(op, s, begin, end, pa); });
  STRATA_CHECK(known);  // validate_spans() admits only instantiated combinations
  return r;
}

}  // namespace strata::kernels::cpu
