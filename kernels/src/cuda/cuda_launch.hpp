#pragma once
// The boundary between the nvcc-compiled launches (cuda_step.cu) and the
// host-compiled CUDA backend (cuda_backend.cpp). Plain types only: nvcc's host
// pass cannot compile fmt 9 (consteval format strings), so no Status here;
// calls return a cudaError_t value and name the failed call in *what.

#include <cstddef>
#include <cstdint>

#include "strata/kernels/grid_index.hpp"
#include "strata/kernels/ops.hpp"

//! In the nvcc-compiled files: returns the cudaError_t of a failed call as int, naming it in *what.
#define STRATA_CUDAK_TRY(expr)     \
  do {                             \
    cudaError_t e_ = (expr);       \
    if (e_ != cudaSuccess) {       \
      *what = #expr;               \
      return static_cast<int>(e_); \
    }                              \
  } while (0)

namespace strata::kernels::cudak {

//! Device and pinned host buffers of passes, grown on demand and reused (no
//! cudaMalloc once they are large enough), and the event recorded when a pass's
//! results are back in host memory. One per in-flight pass sequence.
struct PassScratch;
int scratch_create(PassScratch** out, const char** what);
void scratch_destroy(PassScratch* s);

//! Enqueues one pass on `stream` and returns without waiting: spans, table and
//! trust go to the device through the scratch's pinned staging, one kernel per
//! run of equal dtype signature, the block partials come back into the
//! scratch's pinned partials, then its event is recorded. With `gated`, every
//! block first reads the scratch's device flag and does nothing when it is set
//! (see enqueue_flag). Waits (on the scratch's event) only when the scratch's
//! previous pass may still read its staging.
int enqueue_pass(void* stream, PassScratch* s, Pass pass, const Hyper& h, const Span* spans,
                 std::size_t span_count, const GridBlock* table, std::size_t block_count,
                 std::uint32_t block_threads, const PassArgs& pa, const float* trust, bool gated,
                 const char** what);
//! Enqueues, after a Pass::kGradStats pass on `check`, one block that sets the
//! device flag of `gate_of` when any of check's partials is non-finite (or
//! their sum of squares overflows); the flag comes back to the host with
//! gate_of's next pass. Does not wait.
int enqueue_flag(void* stream, PassScratch* check, PassScratch* gate_of, const char** what);
//! Waits for the scratch's last pass (its event) and points at its partials
//! (block_count of that pass) and the flag copied back with it.
int wait_pass(PassScratch* s, const GridPartial** partials, std::uint32_t* flag, const char** what);
//! The scratch's event (a cudaEvent_t), recorded after its last pass's results landed.
void* scratch_event(PassScratch* s);

//! Uploads, launches and waits for one pass (enqueue_pass + wait_pass); copies
//! the partials out. Blocks.
int run_pass(void* stream, PassScratch* s, Pass pass, const Hyper& h, const Span* spans,
             std::size_t span_count, const GridBlock* table, std::size_t block_count,
             std::uint32_t block_threads, const PassArgs& pa, const float* trust, GridPartial* partials,
             const char** what);

//! a = b + 3 c over n floats on the default stream; *ms = kernel time by events.
int triad(float* a, const float* b, const float* c, std::size_t n, float* ms, const char** what);

}  // namespace strata::kernels::cudak
