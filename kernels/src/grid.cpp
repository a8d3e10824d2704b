// Host side of multi-tensor apply: the block table and the emulated grid
// (Note [Emulated grid]).
#include "strata/kernels/grid.hpp"

#include <vector>

#include "orchestrate.hpp"
#include "strata/common/assert.hpp"

namespace strata::kernels {

Status validate_grid_shape(const GridShape& shape) {
  if (shape.block_threads == 0 || shape.block_threads > kGridThreadsMax) {
    return invalid_argument("grid block_threads = {} must be in [1, {}]", shape.block_threads,
                            kGridThreadsMax);
  }
  if (shape.chunk_elems == 0 || shape.chunk_elems % shape.block_threads != 0) {
    return invalid_argument("grid chunk_elems = {} must be a positive multiple of block_threads = {}",
                            shape.chunk_elems, shape.block_threads);
  }
  return Status::Ok();
}

std::vector<GridBlock> plan_grid(std::span<const Span> spans, const GridShape& shape) {
  std::vector<GridBlock> table;
  for (std::size_t si = 0; si < spans.size(); ++si) {
    for (std::size_t b = 0; b < spans[si].n; b += shape.chunk_elems) {
      const std::size_t len = std::min<std::size_t>(shape.chunk_elems, spans[si].n - b);
      table.push_back({static_cast<std::uint32_t>(si), static_cast<std::uint32_t>(len), b});
    }
  }
  return table;
}

namespace detail {

PassOutcome combine_grid_partials(std::span<const GridBlock> table, std::span<const GridPartial> partials,
                                  std::size_t span_count) {
  PassOutcome out;
  out.per_span = per_span_scratch(span_count);
  for (std::size_t k = 0; k < table.size(); ++k) {
    out.per_span[table[k].span].param_sq += partials[k].a;
    out.per_span[table[k].span].other_sq += partials[k].b;
    out.nonfinite = out.nonfinite || partials[k].nonfinite != 0;
  }
  return out;
}

}  // namespace detail

namespace {

Result<detail::PassOutcome> emulate_pass(const GridShape& shape, Pass pass, const Hyper& h,
                                         std::span<const Span> spans, const PassArgs& pa,
                                         std::span<const float> trust) {
  const std::vector<GridBlock> table = plan_grid(spans, shape);
  std::vector<GridPartial> partials(table.size());
  std::vector<Acc<float>> per_thread(shape.block_threads);
  for (std::uint32_t block = 0; block < table.size(); ++block) {
    const Span& s = spans[table[block].span];
    const bool known = with_op(pass, h, s, [&](const auto& op) {
      for (std::uint32_t t = 0; t < shape.block_threads; ++t) {
        per_thread[t] = grid_thread(op, spans.data(), table.data(), block, t, shape.block_threads, pa,
                                    trust.empty() ? nullptr : trust.data());
      }
    });
    STRATA_CHECK(known);
    partials[block] = grid_combine(per_thread.data(), shape.block_threads);
  }
  return detail::combine_grid_partials(table, partials, spans.size());
}

detail::PassRunner emulated_runner(const GridShape& shape) {
  return [shape](Pass pass, const Hyper& h, std::span<const Span> spans, const PassArgs& pa,
                 std::span<const float> trust) { return emulate_pass(shape, pass, h, spans, pa, trust); };
}

}  // namespace

Result<StepReport> grid_step_emulated(const StepArgs& args, const GridShape& shape) {
  STRATA_RETURN_IF_ERROR(validate_grid_shape(shape));
  return detail::run_step(emulated_runner(shape), args);
}

Result<GradStats> grid_grad_stats_emulated(std::span<const Span> spans, float grad_scale,
                                           const GridShape& shape) {
  STRATA_RETURN_IF_ERROR(validate_grid_shape(shape));
  std::vector<double> per_span(spans.size());
  return detail::run_grad_stats(emulated_runner(shape), spans, grad_scale, per_span);
}

}  // namespace strata::kernels
