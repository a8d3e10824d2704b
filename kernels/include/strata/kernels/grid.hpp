#pragma once
// Multi-tensor apply, host side: the block table and the emulated grid
// (Note [Emulated grid] in grid_index.hpp).

#include <span>
#include <vector>

#include "strata/kernels/grid_index.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::kernels {

//! The block table of a launch over `spans` (host). Pure.
std::vector<GridBlock> plan_grid(std::span<const Span> spans, const GridShape& shape);

//! Checks a shape: InvalidArgument when block_threads is 0 or above kGridThreadsMax,
//! or chunk_elems is not a positive multiple of block_threads.
Status validate_grid_shape(const GridShape& shape);

//! step() run by the emulated grid on the host (Note [Emulated grid]); spans
//! are host memory. For tests: single-threaded and slow. Fails as step().
Result<StepReport> grid_step_emulated(const StepArgs& args, const GridShape& shape = {});

//! grad_stats() by the emulated grid.
Result<GradStats> grid_grad_stats_emulated(std::span<const Span> spans, float grad_scale,
                                           const GridShape& shape = {});

}  // namespace strata::kernels
