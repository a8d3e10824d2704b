#pragma once
// The memory-only roofline of `strata-bench optim`: for each optimizer pass, a
// kernel with the same streams (the same loads, the same in-place stores, the
// same element widths) and trivial arithmetic, so the optimizer kernel can be
// measured against what its memory traffic alone costs on this machine.
//
// Note [Memory-only roofline]
// - Same streams: a MemPass lists, per element, the gradient (read), the master
//   (read, or read and written in place), up to two states (read, or read and
//   written in place) and the compute-dtype param (written only), each with its
//   element width. The caller builds it from the very Span the kernel timed, so
//   both touch the same buffers (same alignment, same pages, same NUMA node).
// - Trivial arithmetic: each in-place store writes back the value it loaded plus
//   (gradient AND a run-time zero), so values are unchanged (the optimizer can
//   keep stepping on the same buffers) but every store depends on the loads; the
//   param is the master's upper 16 bits (2-byte params) or the master itself.
//   Read-only streams are summed into a sink. 2-byte streams are widened to 32
//   bits on load and narrowed on store, as the kernels do.
// - Same ISA: one translation unit per ISA (mem_kernel_<isa>.cpp), compiled with
//   the flags the kernels' own per-ISA files carry (bench/CMakeLists.txt copies
//   them from kernels/CMakeLists.txt), chosen by the Isa the kernels run with
//   (kernels::default_isa(), i.e. CPUID, or the forced one).
// - Same prefetch: the read streams are prefetched kernels::kPrefetchElems ahead,
//   one prefetch per 16 elements, as the SIMD kernels do (Note [Software
//   prefetch]); without it the kernels beat this "bound" on the bf16 rows.
// - Same pool and split: pieces of kernels::kPieceElems at fixed offsets, run by
//   ThreadPool::parallel_for with the pool's default parts, as kernels::step does.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/kernels/optim.hpp"

namespace strata {
class ThreadPool;
}

namespace strata::bench {

//! One stream of a pass. elem_bytes 0: absent.
struct MemStream {
  void* data = nullptr;
  std::uint8_t elem_bytes = 0;  //!< 2 or 4
  bool write = false;           //!< written in place after the read (the param is write-only)
};

//! The streams of one pass over n elements; see Note [Memory-only roofline].
struct MemPass {
  std::size_t n = 0;
  MemStream grad;                  //!< read only
  MemStream master;                //!< read, or read and written
  std::array<MemStream, 2> state;  //!< read, or read and written (both alike)
  MemStream param;                 //!< written only
  //! Bytes the pass moves per element (reads plus writes, no write-allocate).
  double bytes_per_elem() const;
};

//! What one timed run of a list of passes found.
struct MemTiming {
  double seconds = 0.0;
  std::size_t threads_used = 0;  //!< distinct threads that ran a piece (caller + pool workers)
};

//! Runs `passes` in order with the memory-only kernel of `isa` on `pool` (null:
//! the calling thread) and times them together. Blocks. Fails: Unavailable when
//! the CPU lacks `isa`, Internal for a stream shape kShapes lacks (a bench bug).
Result<MemTiming> run_mem_passes(std::span<const MemPass> passes, ThreadPool* pool, kernels::Isa isa);

//! One STREAM triad a = b + s c over n floats with the kernel of `isa`, on `pool`; seconds.
Result<double> run_triad(float* a, const float* b, const float* c, std::size_t n, ThreadPool* pool,
                         kernels::Isa isa);

//! The memory-only passes of one kernels::step() call over `span` with `hyper`,
//! as kernels/src/orchestrate.cpp runs them with GradCheck::kCallerChecked (LAMB
//! and LARS: both trust phases). grad_check_pass: prepend the gradient read of
//! GradCheck::kSeparatePass (not for LARS, whose phase 1 is its check).
std::vector<MemPass> mem_passes_for_step(const kernels::Hyper& hyper, const kernels::Span& span,
                                         bool grad_check_pass);

//! The memory-only pass of kernels::grad_stats() over `span`: the gradient read.
MemPass mem_pass_for_grad_stats(const kernels::Span& span);

}  // namespace strata::bench
