// CAME on the CPU: four passes over each whole tensor (Note [CAME passes]),
// threaded over fixed row blocks whose partial column sums are combined in
// block order, so results do not depend on the thread count.
#include "strata/kernels/rules/came.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "strata/common/thread_pool.hpp"
#include "strata/kernels/lanes.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::kernels {
namespace {

float grad_at(const CameTensor& t, std::size_t i) {
  switch (t.grad_dtype) {
    case DType::kBF16:
      return load<float, DType::kBF16>(t.grad, i);
    case DType::kF16:
      return load<float, DType::kF16>(t.grad, i);
    default:
      return load<float, DType::kF32>(t.grad, i);
  }
}

void store_param(const CameTensor& t, std::size_t i, float p) {
  switch (t.param_dtype) {
    case DType::kF32:
      store<float, DType::kF32>(t.param, i, p);
      break;
    case DType::kBF16:
      store<float, DType::kBF16>(t.param, i, p);
      break;
    case DType::kF16:
      store<float, DType::kF16>(t.param, i, p);
      break;
    case DType::kQ8:  // refused by validate_came
    case DType::kNone:
      break;
  }
}

bool factored(const CameTensor& t) {
  return t.rows > 1 && t.cols > 1;
}

//! Row blocks of about kPieceElems elements: the fixed unit of parallel work.
struct RowBlocks {
  std::size_t rows_per_block, count;
  RowBlocks(std::size_t rows, std::size_t cols)
      : rows_per_block(std::max<std::size_t>(1, kPieceElems / std::max<std::size_t>(1, cols))),
        count((rows + rows_per_block - 1) / rows_per_block) {}
};

void parallel_blocks(ThreadPool* pool, std::size_t count, const std::function<void(std::size_t)>& fn) {
  auto body = [&](std::size_t, std::size_t b, std::size_t e) {
    for (std::size_t k = b; k < e; ++k) fn(k);
  };
  if (pool == nullptr || count < 2) {
    body(0, 0, count);
  } else {
    pool->parallel_for(count, 0, body);
  }
}

//! Row means (exact per row) and column means (block partials combined in order) of f(i, j).
template <typename F>
void row_col_means(ThreadPool* pool, std::size_t rows, std::size_t cols, F f, std::vector<double>& row_mean,
                   std::vector<double>& col_mean) {
  const RowBlocks rb(rows, cols);
  std::vector<double> col_part(rb.count * cols, 0.0);
  row_mean.assign(rows, 0.0);
  parallel_blocks(pool, rb.count, [&](std::size_t blk) {
    double* cp = &col_part[blk * cols];
    const std::size_t r_end = std::min(rows, (blk + 1) * rb.rows_per_block);
    for (std::size_t r = blk * rb.rows_per_block; r < r_end; ++r) {
      double s = 0.0;
      for (std::size_t c = 0; c < cols; ++c) {
        const double v = f(r, c);
        s += v;
        cp[c] += v;
      }
      row_mean[r] = s / double(cols);
    }
  });
  col_mean.assign(cols, 0.0);
  for (std::size_t blk = 0; blk < rb.count; ++blk) {
    for (std::size_t c = 0; c < cols; ++c) col_mean[c] += col_part[blk * cols + c];
  }
  for (double& v : col_mean) v /= double(rows);
}

//! rsqrt(x_i / mean(x)) for the factored approximation.
std::vector<float> row_factors(const float* x, std::size_t n) {
  double mean = 0.0;
  for (std::size_t i = 0; i < n; ++i) mean += x[i];
  mean /= double(n);
  std::vector<float> f(n);
  for (std::size_t i = 0; i < n; ++i) f[i] = came_rsqrt(static_cast<float>(x[i] / mean));
  return f;
}

void ema(float* state, const std::vector<double>& mean, float beta) {
  for (std::size_t i = 0; i < mean.size(); ++i)
    state[i] = beta * state[i] + (1.0f - beta) * static_cast<float>(mean[i]);
}

void came_factored(const Hyper& h, float scale, const CameTensor& t, ThreadPool* pool) {
  const std::size_t rows = t.rows, cols = t.cols;
  auto g = [&](std::size_t r, std::size_t c) { return grad_at(t, r * cols + c) * scale; };
  std::vector<double> rm, cm;
  row_col_means(
      pool, rows, cols, [&](std::size_t r, std::size_t c) { return double{came_sq(g(r, c), h.eps)}; }, rm,
      cm);
  ema(t.row, rm, h.beta2);
  ema(t.col, cm, h.beta2);
  const std::vector<float> rf = row_factors(t.row, rows);
  std::vector<float> cf(cols);
  for (std::size_t c = 0; c < cols; ++c) cf[c] = came_rsqrt(t.col[c]);
  auto u = [&](std::size_t r, std::size_t c) { return g(r, c) * rf[r] * cf[c]; };
  // RMS(u): row sums are the row means times cols; add them in row order.
  row_col_means(
      pool, rows, cols,
      [&](std::size_t r, std::size_t c) {
        const double x = u(r, c);
        return x * x;
      },
      rm, cm);
  double sum_sq = 0.0;
  for (double v : rm) sum_sq += v * double(cols);
  const float clip =
      std::max(1.0f, static_cast<float>(std::sqrt(sum_sq / double(rows * cols)) / h.clip_threshold));
  // m and the instability U; each element is visited exactly once, so writing m here is safe.
  row_col_means(
      pool, rows, cols,
      [&](std::size_t r, std::size_t c) {
        float& m = t.exp_avg[r * cols + c];
        return double{came_momentum(m, u(r, c) / clip, h.beta1, h.eps2)};
      },
      rm, cm);
  ema(t.res_row, rm, h.beta3);
  ema(t.res_col, cm, h.beta3);
  const std::vector<float> rrf = row_factors(t.res_row, rows);
  std::vector<float> rcf(cols);
  for (std::size_t c = 0; c < cols; ++c) rcf[c] = came_rsqrt(t.res_col[c]);
  const float decay = static_cast<float>(1.0 - double{h.lr} * h.weight_decay);
  const RowBlocks rb(rows, cols);
  parallel_blocks(pool, rb.count, [&](std::size_t blk) {
    const std::size_t r_end = std::min(rows, (blk + 1) * rb.rows_per_block);
    for (std::size_t r = blk * rb.rows_per_block; r < r_end; ++r) {
      for (std::size_t c = 0; c < cols; ++c) {
        const std::size_t i = r * cols + c;
        came_apply(t.master[i], t.exp_avg[i], rrf[r] * rcf[c], h.lr, decay);
        store_param(t, i, t.master[i]);
      }
    }
  });
}

void came_vector(const Hyper& h, float scale, const CameTensor& t) {
  const std::size_t n = t.rows * t.cols;
  double sum_sq = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = grad_at(t, i) * scale;
    t.exp_avg_sq[i] = madd(h.beta2, t.exp_avg_sq[i], (1.0f - h.beta2) * came_sq(g, h.eps));
    const double u = double{g * came_rsqrt(t.exp_avg_sq[i])};
    sum_sq += u * u;
  }
  const float clip = std::max(1.0f, static_cast<float>(std::sqrt(sum_sq / double(n)) / h.clip_threshold));
  const float decay = static_cast<float>(1.0 - double{h.lr} * h.weight_decay);
  for (std::size_t i = 0; i < n; ++i) {
    const float u = grad_at(t, i) * scale * came_rsqrt(t.exp_avg_sq[i]) / clip;
    came_momentum(t.exp_avg[i], u, h.beta1, h.eps2);
    came_apply(t.master[i], t.exp_avg[i], 1.0f, h.lr, decay);
    store_param(t, i, t.master[i]);
  }
}

Status validate_came(const CameTensor& t, std::size_t i) {
  if (t.rows == 0 || t.cols == 0) return Status::Ok();  // empty: nothing is touched
  if (t.rows > (std::size_t{1} << 40) / t.cols) {
    return invalid_argument("came: tensor {} is {} x {}, too large", i, t.rows, t.cols);
  }
  if (t.master == nullptr || t.grad == nullptr || t.exp_avg == nullptr) {
    return invalid_argument("came: tensor {} lacks master, grad or exp_avg", i);
  }
  if (t.grad_dtype == DType::kNone || t.grad_dtype == DType::kQ8 || t.param_dtype == DType::kQ8 ||
      (t.param == nullptr) != (t.param_dtype == DType::kNone)) {
    return invalid_argument("came: tensor {} has a bad grad dtype or a param pointer/dtype mismatch", i);
  }
  if (factored(t) && (t.row == nullptr || t.col == nullptr || t.res_row == nullptr || t.res_col == nullptr)) {
    return invalid_argument("came: tensor {} is 2-D ({} x {}) and needs row, col, res_row and res_col", i,
                            t.rows, t.cols);
  }
  if (!factored(t) && t.exp_avg_sq == nullptr) {
    return invalid_argument("came: tensor {} is 1-D and needs exp_avg_sq", i);
  }
  return Status::Ok();
}

}  // namespace

Result<StepReport> came_step(const Hyper& hyper, std::int64_t step_number, float grad_scale,
                             std::span<const CameTensor> tensors, ThreadPool* pool) {
  Hyper h = hyper;
  h.optimizer = Optimizer::kCame;
  STRATA_RETURN_IF_ERROR(validate_hyper(h));
  if (step_number < 1) return invalid_argument("came: step = {} must be >= 1", step_number);
  if (!std::isfinite(grad_scale)) return invalid_argument("came: grad_scale = {} is not finite", grad_scale);
  std::vector<Span> grads;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    STRATA_RETURN_IF_ERROR(validate_came(tensors[i], i));
    grads.push_back(Span{.grad = tensors[i].grad,
                         .grad_dtype = tensors[i].grad_dtype,
                         .n = tensors[i].rows * tensors[i].cols});
  }
  STRATA_ASSIGN_OR_RETURN(GradStats stats, grad_stats(grads, grad_scale, pool));
  if (!stats.finite) return StepReport{.grads_finite = false, .applied = false};
  for (const CameTensor& t : tensors) {
    if (t.rows == 0 || t.cols == 0) continue;
    if (factored(t)) {
      came_factored(h, grad_scale, t, pool);
    } else {
      came_vector(h, grad_scale, t);
    }
  }
  return StepReport{.grads_finite = true, .applied = true};
}

}  // namespace strata::kernels
