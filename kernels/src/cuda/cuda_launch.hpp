#pragma once
// The boundary between the nvcc-compiled launches (cuda_step.cu) and the
// host-compiled CUDA backend (cuda_backend.cpp). Plain types only: nvcc's host
// pass cannot compile fmt 9 (consteval format strings), so no Status here;
// calls return a cudaError_t value and name the failed call in *what.

#include <cstddef>
#include <cstdint>

#include "strata/kernels/grid_index.hpp"
#include "strata/kernels/ops.hpp"

namespace strata::kernels::cudak {

//! Uploads spans, the (dtype-sorted) block table and trust, launches one kernel
//! per run of equal dtype signature, copies the block partials back to
//! `partials` (block_count entries) and synchronises `stream`. Blocks.
int run_pass(void* stream, Pass pass, const Hyper& h, const Span* spans, std::size_t span_count,
             const GridBlock* table, std::size_t block_count, std::uint32_t block_threads, const PassArgs& pa,
             const float* trust, GridPartial* partials, const char** what);

//! a = b + 3 c over n floats on the default stream; *ms = kernel time by events.
int triad(float* a, const float* b, const float* c, std::size_t n, float* ms, const char** what);

}  // namespace strata::kernels::cudak
