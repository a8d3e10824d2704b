#pragma once
// The CPU driver: runs one op over [begin, end) of a span in lane groups of
// Lanes<T>::kWidth, in blocks of kBlockElems, staging the ragged tail through
// zero-padded buffers so the tail runs the very same vector code.
// Included only by the per-ISA translation units (kernels_<isa>.cpp).
//
// Note [ISA translation units]
// kernels_avx2.cpp and kernels_avx512.cpp (and q8_<isa>.cpp, which share their
// lane types through lanes_<isa>.hpp) are compiled with their target flags.
// Everything they instantiate is a template over their own lane type, which
// lives in an anonymous namespace, so no AVX code can leak into a shared inline
// symbol that the scalar path would link against; the default build stays
// runnable on any x86-64 and CPUID (isa.cpp) decides what runs.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

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

// Note [Software prefetch]
// The update ops are streaming loops whose arithmetic (a divide and a square
// root per lane for Adam) keeps the core busy long enough that the hardware
// prefetchers alone leave the loads late: AdamW f32 ran at 0.87-0.88 of its
// memory-only roofline. Prefetching every read stream kPrefetchElems elements
// ahead (2 KiB for 4-byte streams, 1 KiB for 2-byte ones), one prefetch per 16
// elements per stream, brought it to about 0.98 at 1 thread. 128 elements gave
// a little less, 2048 gave nothing. Prefetches change no value: results stay
// bit-identical. Prefetching past a span's end is harmless (no fault). The
// memory-only roofline (bench/roofline/mem_kernel.hpp) prefetches the same
// streams the same way, so it stays an upper bound for the kernel. The scalar
// path does not prefetch (it is compute-bound).

namespace {  // each ISA's translation unit its own copy (Note [ISA translation units])

//! The streams a pass reads, as (base, bytes per element), for prefetching.
//! Unread or absent streams repeat a read one, so the loop prefetches without
//! branches (GCC 12 dropped a __builtin_prefetch guarded by a null test here).
struct PrefetchStreams {
  const char* base[4] = {};
  std::size_t size[4] = {};
  PrefetchStreams(const Span& s, bool grad, bool master, std::size_t states) {
    const void* ptr[4] = {grad ? s.grad : nullptr, master ? s.master : nullptr,
                          states > 0 ? s.state[0] : nullptr, states > 1 ? s.state[1] : nullptr};
    const std::size_t bytes[4] = {dtype_size(s.grad_dtype), 4, dtype_size(s.state_dtype),
                                  dtype_size(s.state_dtype)};
    int first = 0;
    while (first < 3 && ptr[first] == nullptr) ++first;
    for (int k = 0; k < 4; ++k) {
      const int from = ptr[k] != nullptr ? k : first;
      base[k] = static_cast<const char*>(ptr[from]);
      size[k] = bytes[from];
    }
  }
  //! The streams `pass` reads with hyper-parameters h (ops.hpp, ops_dispatch.hpp).
  static PrefetchStreams of(Pass pass, const Hyper& h, const Span& s) {
    const bool lars = h.optimizer == Optimizer::kLars;
    // LARS reads its buffer only with momentum (ops_dispatch.hpp), as SGD does.
    const std::size_t states = lars ? (h.momentum != 0.0f ? 1 : 0) : optimizer_state_count(h);
    switch (pass) {
      case Pass::kGradStats:
        return {s, true, false, 0};
      case Pass::kTrustPhase1:
        return {s, true, true, lars ? 0 : states};
      case Pass::kTrustPhase2:
        return {s, lars, true, states};
      case Pass::kUpdate:
        break;
    }
    return {s, true, true, states};
  }
};

}  // namespace

template <typename T>
inline void prefetch_streams(const PrefetchStreams& p, std::size_t i) {
  constexpr std::size_t kW = Lanes<T>::kWidth;
  if constexpr (kW >= 8) {
    if (kW < 16 && i % 16 != 0) return;  // one prefetch per 16 elements
    const std::size_t at = i + kPrefetchElems;
    for (int k = 0; k < 4; ++k) __builtin_prefetch(p.base[k] + at * p.size[k]);
  }
}

template <typename T, typename Op>
PieceResult drive(const Op& op, const Span& span, std::size_t begin, std::size_t end, const PassArgs& args,
                  const PrefetchStreams& streams) {
  constexpr std::size_t kW = Lanes<T>::kWidth;
  static_assert(kBlockElems % kW == 0, "blocks hold whole lane groups");
  // Local copies: the compiler then keeps the pointers and coefficients in
  // registers instead of reloading them after every store (the stores could
  // alias the caller's Span as far as it knows).
  const Span s = span;
  const PassArgs pa = args;
  const PrefetchStreams pf = streams;
  PieceResult r;
  for (std::size_t b = begin; b < end; b += kBlockElems) {
    const std::size_t e = std::min(end, b + kBlockElems);
    const std::size_t full = b + (e - b) / kW * kW;
    Acc<T> acc;
    for (std::size_t i = b; i < full; i += kW) {
      prefetch_streams<T>(pf, i);
      op(s, i, pa, acc);
    }
    if (full < e) run_tail<T>(op, s, full, e - full, pa, acc);
    r.a += static_cast<double>(Lanes<T>::hsum(acc.a));
    r.b += static_cast<double>(Lanes<T>::hsum(acc.b));
    if (!std::isfinite(Lanes<T>::hsum(acc.bad))) r.nonfinite = true;
  }
  return r;
}

//! Sums of squares an op makes (sums_exactly passes): 1 (acc.a) or 2 (acc.a, acc.b); 0 for the rest.
template <typename Op>
inline constexpr int kNormSums = 0;
template <DType G>
inline constexpr int kNormSums<GradStatsOp<G>> = 1;
template <DType G, DType S>
inline constexpr int kNormSums<LambPhase1Op<G, S>> = 2;
template <DType G>
inline constexpr int kNormSums<LarsPhase1Op<G>> = 2;

//! drive() for the passes that sum squares (sums_exactly): fp32 sums per group
//! of kGroupElems elements aligned to the chunk (Span::group_phase), each added
//! to an exact sum (Note [Exact norms]); a group's order depends only on where
//! its elements are. kSecond: the op also sums into acc.b.
template <typename T, bool kSecond, typename Op>
PieceResult drive_grouped(const Op& op, const Span& span, std::size_t begin, std::size_t end,
                          const PassArgs& args, const PrefetchStreams& streams) {
  constexpr std::size_t kW = Lanes<T>::kWidth;
  static_assert(kGroupElems % kW == 0, "groups hold whole lane groups");
  const Span s = span;
  const PassArgs pa = args;
  const PrefetchStreams pf = streams;
  const std::size_t phase = s.group_phase;
  PieceResult r;
  Acc<T> acc;  // bad over the piece; a and b per group
  for (std::size_t b = begin; b < end;) {
    const std::size_t e = std::min(end, ((b + phase) / kGroupElems + 1) * kGroupElems - phase);
    const std::size_t full = b + (e - b) / kW * kW;
    acc.a = T(0.0f);
    acc.b = T(0.0f);
    for (std::size_t i = b; i < full; i += kW) {
      prefetch_streams<T>(pf, i);
      op(s, i, pa, acc);
    }
    if (full < e) run_tail<T>(op, s, full, e - full, pa, acc);
    r.ea.add(Lanes<T>::hsum_tree(acc.a));
    if constexpr (kSecond) r.eb.add(Lanes<T>::hsum_tree(acc.b));
    b = e;
  }
  r.nonfinite = !std::isfinite(Lanes<T>::hsum(acc.bad));
  return r;
}

//! The body of each ISA's run_piece_<isa>().
template <typename T>
PieceResult run_piece_with(Pass pass, const Hyper& h, const Span& s, std::size_t begin, std::size_t end,
                           const PassArgs& pa) {
  PieceResult r;
  const PrefetchStreams pf = PrefetchStreams::of(pass, h, s);
  const bool known = with_op(pass, h, s, [&](const auto& op) {
    using Op = std::decay_t<decltype(op)>;
    if constexpr (kNormSums < Op >> 0) {
      r = drive_grouped<T, kNormSums<Op> == 2>(op, s, begin, end, pa, pf);
    } else {
      r = drive<T>(op, s, begin, end, pa, pf);
    }
  });
  STRATA_CHECK(known);  // validate_spans() admits only instantiated combinations
  return r;
}

}  // namespace strata::kernels::cpu
