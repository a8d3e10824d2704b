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
// - Two prefetch variants, the roofline the faster (Note [Write prefetch]):
//   kKernelPrefetch is the kernels' prefetch exactly; kWritePrefetch also
//   prefetches the write-only param stream for writing (prefetchw), the same
//   distance ahead.
// - Same pool and split: pieces of kernels::kPieceElems at fixed offsets, run by
//   ThreadPool::parallel_for with the pool's default parts, as kernels::step does.
//
// Note [Q8 roofline]
// kernels::step_q8 reads the gradient, reads and writes the fp32 master, the
// two states' 1-byte codes and, once per block of kQ8BlockElems elements, each
// state's fp32 scale: 4 + 8 + 2 * 2 + 2 * 2 * 4 / 256 = 16.0625 B a parameter
// (fp32 AdamW: 28). Its memory-only pass has exactly those streams: the codes
// widened to 32-bit lanes on load and narrowed back on store, each scale loaded
// and stored back once per block; the same prefetch as the kernel's for the
// gradient and master, one line per 16 elements for the codes.
//
// Note [Write prefetch]
// With the kernels' own prefetch the memory-only kernel was still not an upper
// bound for the rows that write a 2-byte param: AdamW bf16 grad+param ran at
// 1.006-1.028 of it. Timed on one thread's CPU time (so the load on the shared
// machine drops out), best of 9, the same buffers: the kernel 0.0679-0.0682 s,
// the memory-only kernel 0.0683-0.0693 s. Reordering its stores as the kernel
// does, a prefetch distance of 1024, or a square root per lane to pace its
// loads (the kernel's arithmetic) moved it by 1 % at most; a distance of 256
// or no software prefetch made it 4-8 % slower. What did: prefetching the
// write-only param stream for writing (prefetchw), 0.0646-0.0649 s, about 5 %
// ahead of the kernel. The param is stored without a load, so each of its
// lines costs a read-for-ownership that, without the hint, starts only when the
// store reaches the cache; the hint changes when that read starts, not which
// bytes move. The roofline runs both variants in every repeat and takes the
// faster, so it stays at least the kernels' own access pattern if they ever
// prefetch the param too. The kernels do not today: that 5 % is theirs to gain.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/kernels/q8.hpp"

namespace strata {
class ThreadPool;
}

namespace strata::bench {

//! One stream of a pass. elem_bytes 0: absent.
struct MemStream {
  void* data = nullptr;
  std::uint8_t elem_bytes = 0;  //!< 1 (q8 codes), 2 or 4
  bool write = false;           //!< written in place after the read (the param is write-only)
};

//! The streams of one pass over n elements; see Note [Memory-only roofline].
struct MemPass {
  std::size_t n = 0;
  MemStream grad;                  //!< read only
  MemStream master;                //!< read, or read and written
  std::array<MemStream, 2> state;  //!< read, or read and written (both alike)
  MemStream param;                 //!< written only
  //! q8 (Note [Q8 roofline]): each state's fp32 scale per kernels::kQ8BlockElems
  //! elements, read and written once per block; absent (elem_bytes 0) otherwise.
  std::array<MemStream, 2> block_scales;
  //! Bytes the pass moves per element (reads plus writes, no write-allocate).
  double bytes_per_elem() const;
};

//! How the memory-only kernel prefetches (Note [Write prefetch]).
enum class MemVariant : std::uint8_t {
  kKernelPrefetch,  //!< the read streams, as the SIMD kernels do (Note [Software prefetch])
  kWritePrefetch,   //!< those and the write-only param stream, for writing
};
inline constexpr MemVariant kMemVariants[] = {MemVariant::kKernelPrefetch, MemVariant::kWritePrefetch};
//! "kernel_prefetch" or "write_prefetch".
const char* mem_variant_name(MemVariant v);

//! What one timed run of a list of passes found.
struct MemTiming {
  double seconds = 0.0;
  std::size_t threads_used = 0;  //!< distinct threads that ran a piece (caller + pool workers)
};

//! Runs `passes` in order with the memory-only kernel of `isa` on `pool` (null:
//! the calling thread) and times them together. Blocks. Fails: Unavailable when
//! the CPU lacks `isa`, Internal for a stream shape kShapes lacks (a bench bug).
Result<MemTiming> run_mem_passes(std::span<const MemPass> passes, ThreadPool* pool, kernels::Isa isa,
                                 MemVariant variant = MemVariant::kKernelPrefetch);

//! One STREAM triad a = b + s c over n floats with the kernel of `isa`, on `pool`; seconds.
Result<double> run_triad(float* a, const float* b, const float* c, std::size_t n, ThreadPool* pool,
                         kernels::Isa isa);

//! The memory-only passes of one kernels::step() call over `span` with `hyper`,
//! as kernels/src/orchestrate.cpp runs them with GradCheck::kCallerChecked (LAMB
//! and LARS: both trust phases). grad_check_pass: prepend the gradient read of
//! GradCheck::kSeparatePass (not for LARS, whose phase 1 is its check).
std::vector<MemPass> mem_passes_for_step(const kernels::Hyper& hyper, const kernels::Span& span,
                                         bool grad_check_pass);

//! The memory-only pass of kernels::step_q8() over `span` (Note [Q8 roofline]).
MemPass mem_pass_for_q8(const kernels::Q8Span& span);

//! The memory-only pass of kernels::grad_stats() over `span`: the gradient read.
MemPass mem_pass_for_grad_stats(const kernels::Span& span);

}  // namespace strata::bench
