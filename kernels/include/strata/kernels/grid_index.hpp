#pragma once
// Multi-tensor apply: the block table entry and per-block body shared by the
// CUDA kernels and a host emulation of the grid. No Status/fmt: included by .cu files.
//
// Note [Emulated grid]
// A launch covers many spans at once: the host cuts every span into chunks of
// chunk_elems and lists (span, begin, length) per block; block b handles table
// entry b with block_threads threads striding over it; each thread keeps its
// own float accumulators and thread 0 adds the threads' sums in thread order
// into the block's double partial (deterministic, and the same order on host
// and device). grid_thread() and grid_combine() are that body, __host__ __device__; the CUDA kernel
// calls it with blockIdx/threadIdx, and grid_step_emulated() calls it from
// plain host loops over blocks and threads, so the index logic and the rules
// are tested here without a GPU. Results may still differ from a device run
// in the last bits: nvcc contracts a*b+c into FMA, the host build does not.

#include <cstddef>
#include <cstdint>

#include "strata/kernels/hd.hpp"
#include "strata/kernels/ops.hpp"
#include "strata/kernels/span.hpp"

namespace strata::kernels {

//! Shape of a multi-tensor launch.
struct GridShape {
  std::uint32_t chunk_elems = 16 * 1024;  //!< elements per block (a multiple of block_threads)
  std::uint32_t block_threads = 256;      //!< threads per block (<= kGridThreadsMax)
};

//! Upper bound on block_threads (size of the per-block scratch).
inline constexpr std::uint32_t kGridThreadsMax = 1024;

//! One block's work: elements [begin, begin + len) of span `span`.
struct GridBlock {
  std::uint32_t span;
  std::uint32_t len;
  std::uint64_t begin;
};

//! One block's partial sums (as cpu PieceResult).
struct GridPartial {
  double a;
  double b;
  std::uint32_t nonfinite;
};

//! The work of thread `thread` of block `block`: runs op over its strided
//! elements and returns its accumulators. trust: null or one value per span.
template <typename Op>
STRATA_HD inline Acc<float> grid_thread(const Op& op, const Span* spans, const GridBlock* table,
                                        std::uint32_t block, std::uint32_t thread, std::uint32_t threads,
                                        PassArgs pa, const float* trust) {
  const GridBlock gb = table[block];
  const Span s = spans[gb.span];
  if (trust != nullptr) pa.trust = trust[gb.span];
  Acc<float> acc;
  const std::uint64_t end = gb.begin + gb.len;
  for (std::uint64_t i = gb.begin + thread; i < end; i += threads)
    op(s, static_cast<std::size_t>(i), pa, acc);
  return acc;
}

//! Thread 0's combination of the threads' accumulators, in thread order.
STRATA_HD inline GridPartial grid_combine(const Acc<float>* per_thread, std::uint32_t threads) {
  GridPartial r{0.0, 0.0, 0u};
  float bad = 0.0f;
  for (std::uint32_t t = 0; t < threads; ++t) {
    r.a += static_cast<double>(per_thread[t].a);
    r.b += static_cast<double>(per_thread[t].b);
    bad += per_thread[t].bad;
  }
  r.nonfinite = (bad - bad) != 0.0f ? 1u : 0u;  // NaN iff some lane saw Inf/NaN
  return r;
}

}  // namespace strata::kernels
