// strata-probe --verify; see verify.hpp (Note [Verify on the sim device]).
#include "verify.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <vector>

#include "runtime_spec.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"
#include "strata/runtime/stores.hpp"

namespace strata::probe {
namespace {

namespace fs = std::filesystem;
using runtime::Access;
using runtime::StateKind;

using Clock = std::chrono::steady_clock;

// Note [Verify compute]: the synthetic layer's products, on one thread. Loops are
// ordered so W (h x n, streamed) is read once per call and the token rows (T x n)
// stay in cache; the inner loops are unit-stride so the compiler vectorises them.

// Y[t x n] = X[t x h] W[h x n]
void layer_forward(const float* w, const float* x, float* y, std::size_t t, std::size_t h, std::size_t n) {
  std::fill(y, y + t * n, 0.0f);
  for (std::size_t k = 0; k < h; ++k) {
    const float* wk = w + k * n;
    for (std::size_t i = 0; i < t; ++i) {
      const float a = x[i * h + k];
      float* yi = y + i * n;
      for (std::size_t j = 0; j < n; ++j) yi[j] += a * wk[j];
    }
  }
}

// dW[h x n] = X^T dY, dX[t x h] = dY W^T (dY: t x n)
void layer_backward(const float* w, const float* x, const float* dy, float* dw, float* dx, std::size_t t,
                    std::size_t h, std::size_t n) {
  constexpr std::size_t kLanes = 8;  // partial sums the compiler can keep in vector registers
  for (std::size_t k = 0; k < h; ++k) {
    const float* wk = w + k * n;
    float* dwk = dw + k * n;
    std::fill(dwk, dwk + n, 0.0f);
    for (std::size_t i = 0; i < t; ++i) {
      const float a = x[i * h + k];
      const float* dyi = dy + i * n;
      for (std::size_t j = 0; j < n; ++j) dwk[j] += a * dyi[j];
      float acc[kLanes] = {};
      std::size_t j = 0;
      for (; j + kLanes <= n; j += kLanes) {
        for (std::size_t u = 0; u < kLanes; ++u) acc[u] += dyi[j + u] * wk[j + u];
      }
      float sum = 0.0f;
      for (; j < n; ++j) sum += dyi[j] * wk[j];
      for (float v : acc) sum += v;
      dx[i * h + k] = sum;
    }
  }
}

// The verify model's layer shape (Note [Verify compute]): h x 12h weights.
struct LayerShape {
  std::size_t tokens, hidden, cols;
  explicit LayerShape(std::uint64_t t, std::uint64_t h) : tokens(t), hidden(h), cols(12 * h) {}
  double flops() const { return 3.0 * runtime::forward_flops(static_cast<double>(hidden * cols), tokens); }
};

// Scratch for the products: activations and, for a compute dtype other than
// fp32, the weights and their gradient.
struct LayerScratch {
  explicit LayerScratch(const LayerShape& s, bool own_weights)
      : x(s.tokens * s.hidden, 1e-2f),
        y(s.tokens * s.cols),
        dy(s.tokens * s.cols, 1e-3f),
        dx(s.tokens * s.hidden),
        w(own_weights ? s.hidden * s.cols : 0, 1e-2f),
        dw(own_weights ? s.hidden * s.cols : 0) {}
  std::vector<float> x, y, dy, dx, w, dw;
};

// Note [Verify host memory]
// A verify run takes host memory the probe's capacities do not show: the runtime's
// host budget is the probe's plus a 25 % reserve (Note [Verify budgets]), the host
// tier maps a pinned region a quarter larger again (Note [Host store arena]), the
// sim device's memory is host memory, and the products need their scratch. At
// 1.3x the probe's maximum (--verify-params 3.2B on a 23.5 GiB machine) that came
// to 27.6 GiB, and the run failed only when the pinned pool refused, after the
// measurements; a smaller excess would have been OOM-killed. So the sum is checked
// against the machine's RAM before anything is allocated, and a size that does
// not fit is refused like one the planner refuses (too_large, which names the
// largest verify model that fits both).
struct HostFootprint {
  std::uint64_t host_budget = 0, host_tier = 0, sim_gpu = 0, scratch = 0;
  std::uint64_t total() const { return host_tier + sim_gpu + scratch; }
};

// The runtime's host budget for the probe's: Note [Verify budgets].
std::uint64_t runtime_host_budget(std::uint64_t probe_host_bytes) {
  return probe_host_bytes + align_up(probe_host_bytes / 4, kMiB);
}

// The sim device's budget for the probe's GPU budget (it is host memory).
std::uint64_t sim_device_bytes(std::uint64_t probe_gpu_bytes) {
  return probe_gpu_bytes + 64 * kMiB;
}

HostFootprint host_footprint(const runtime::Budgets& probe, std::uint64_t hidden, std::uint64_t tokens) {
  HostFootprint f;
  f.host_budget = runtime_host_budget(probe.host_bytes);
  f.host_tier = runtime::host_store_region_bytes(f.host_budget);
  f.sim_gpu = sim_device_bytes(probe.gpu_bytes);
  // LayerScratch with its own weights (the compute-rate measurement always has them).
  f.scratch = sizeof(float) * (2 * tokens * hidden + 2 * tokens * 12 * hidden + 2 * 12 * hidden * hidden);
  return f;
}

Status fits_host_memory(const VerifyOptions& o, const TrainSpec& spec, std::uint64_t tokens) {
  if (o.host_memory_bytes == 0) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(runtime::Budgets b, tight_budgets(spec, o.placement, o.capacity, o.rates));
  const HostFootprint f = host_footprint(b, spec.shape.hidden, tokens);
  if (f.total() <= o.host_memory_bytes) return Status::Ok();
  return out_of_budget(
      "its run needs {} of host memory (a {} pinned host tier for host_budget {}, {} of sim GPU memory, {} "
      "of "
      "scratch), more than this machine's {} of RAM",
      format_bytes(f.total()), format_bytes(f.host_tier), format_bytes(f.host_budget),
      format_bytes(f.sim_gpu), format_bytes(f.scratch), format_bytes(o.host_memory_bytes));
}

// Note [Largest verify model]
// When the asked size does not fit, the message gives the largest *verify* model
// that does: the same 16 layers and vocabulary 12 * hidden, the hidden size
// bisected. (It once gave estimate()'s bisection over the layer count at the
// oversized model's hidden size, a different family of shapes: the probe refused
// 1.7B saying the placement "holds at most 567M params" just after verifying
// 1.69B on it.)
Status too_large(const VerifyOptions& o, const Status& why) {
  const std::uint64_t seq = o.spec.shape.seq, batch = o.spec.shape.batch;
  auto fits = [&](std::uint64_t hidden) {
    TrainSpec t = o.spec;
    t.shape = {.layers = 16, .hidden = hidden, .seq = seq, .batch = batch, .vocab = 12 * hidden};
    return shape_params(t.shape).ok() && plan_fits(t, o.placement, o.capacity).ok() &&
           fits_host_memory(o, t, 1).ok();
  };
  std::uint64_t lo = 0, hi = o.spec.shape.hidden / 64;  // in units of 64; hi does not fit
  while (hi - lo > 1) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    (fits(mid * 64) ? lo : hi) = mid;
  }
  const std::uint64_t params = 12 * 17 * (lo * 64) * (lo * 64);
  return out_of_budget(
      "--verify-params {}: the verify model (16 layers of hidden {}) does not fit placement {} here ({}); {}",
      format_count(shape_params(o.spec.shape).value()), o.spec.shape.hidden, placement_name(o.placement),
      why.message(),
      lo == 0 ? std::string("no verify model fits it")
              : fmt::format("the largest that fits has hidden {}: --verify-params {} or less", lo * 64,
                            format_count(params)));
}

// Tokens for the verify model (Note [Verify compute]): the compute about half the
// busiest other resource of the step at `rate`, 1 .. 1024.
Result<std::uint64_t> choose_tokens(const VerifyOptions& o, double rate) {
  VerifyOptions one = o;
  one.spec.shape.seq = 1;
  one.spec.shape.batch = 1;
  one.spec.device_flops_per_s = rate;
  if (Status fits = plan_fits(one.spec, o.placement, o.capacity); !fits.ok()) return too_large(one, fits);
  STRATA_ASSIGN_OR_RETURN(runtime::Budgets b, tight_budgets(one.spec, o.placement, o.capacity, o.rates));
  Capacity tight{b.gpu_bytes, b.host_bytes, b.nvme_bytes};
  STRATA_ASSIGN_OR_RETURN(Estimate e, estimate_at(one.spec, o.placement, tight, o.rates));
  const runtime::StepCost& c = e.cost;
  const double others = std::max({c.h2d_s, c.d2h_s, c.disk_read_s, c.disk_write_s, c.cpu_optim_s,
                                  c.gpu_optim_s, c.host_memory_s, c.disk_s});
  STRATA_ASSIGN_OR_RETURN(std::uint64_t params, shape_params(o.spec.shape));
  const double per_token_s = 6.0 * static_cast<double>(params) / rate;
  return std::clamp<std::uint64_t>(static_cast<std::uint64_t>(0.5 * others / per_token_s), 1, 1024);
}

}  // namespace

std::vector<VerifyTerm> verify_terms(const VerifyResult& r) {
  const runtime::StepCost& c = r.predicted_cost;
  const runtime::StepStats& m = r.measured_stats;
  auto busy = [&](runtime::Track t) { return m.busy_s[static_cast<std::size_t>(t)]; };
  using runtime::Track;
  return {
      {"compute", c.compute_s, busy(Track::kCompute), 0, 0},
      {"h2d", c.h2d_s, busy(Track::kH2D), c.bytes_h2d, m.bytes_h2d},
      {"d2h", c.d2h_s, busy(Track::kD2H), c.bytes_d2h, m.bytes_d2h},
      {"disk_read", c.disk_read_s, busy(Track::kDiskRead), c.bytes_disk_read, m.bytes_disk_read},
      {"disk_write", c.disk_write_s, busy(Track::kDiskWrite), c.bytes_disk_write, m.bytes_disk_write},
      {"cpu_optimizer", c.cpu_optim_s, busy(Track::kCpuOptimizer), 0, 0},
  };
}

Result<double> measure_verify_compute(std::uint64_t hidden, std::uint64_t tokens, std::uint64_t layers) {
  if (hidden == 0 || tokens == 0 || layers == 0) {
    return invalid_argument("verify compute: hidden {}, tokens {} and layers {} must be >= 1", hidden, tokens,
                            layers);
  }
  const LayerShape s(tokens, hidden);
  LayerScratch m(s, /*own_weights=*/false);
  // Note [Verify compute]: distinct weights and gradients, as the run's layers.
  const std::uint64_t pair_bytes = 2 * sizeof(float) * s.hidden * s.cols;
  const std::size_t n =
      std::clamp<std::uint64_t>((kVerifyColdBytes + pair_bytes - 1) / pair_bytes, 1, layers);
  std::vector<std::vector<float>> w(n, std::vector<float>(s.hidden * s.cols, 1e-2f));
  std::vector<std::vector<float>> dw(n, std::vector<float>(s.hidden * s.cols));
  std::vector<double> rates;
  for (int i = 0; i < 4; ++i) {
    const auto start = Clock::now();
    for (std::size_t l = 0; l < n; ++l) {
      layer_forward(w[l].data(), m.x.data(), m.y.data(), s.tokens, s.hidden, s.cols);
      layer_backward(w[l].data(), m.x.data(), m.dy.data(), dw[l].data(), m.dx.data(), s.tokens, s.hidden,
                     s.cols);
    }
    const double t = std::chrono::duration<double>(Clock::now() - start).count();
    if (i > 0) rates.push_back(static_cast<double>(n) * s.flops() / t);  // the first pass warms up
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

namespace {

// The verify run's size and prediction, from set-up to the budgets the runtime
// gets: the compute rate measured over the tokens chosen for this run, the
// checks that the model fits, the bound on a step's compute (into `r`). Returns
// the options as the run uses them (shape and compute rate set).
Result<VerifyOptions> size_verify_run(const VerifyOptions& options, VerifyResult& r) {
  if (options.steps < 1 || options.steps > kVerifyStepsMax) {
    return invalid_argument("--verify-steps = {}: use 1 .. {} (the median of the timed steps is reported)",
                            options.steps, kVerifyStepsMax);
  }
  // Note [Verify compute]: the device compute rate is the measured rate of the
  // layer's products, over tokens chosen for this run.
  VerifyOptions o = options;
  // Its compute runs on the sim compute stream's host thread, beside the CPU
  // optimizer's threads (Note [Host cores as a resource]).
  o.rates.compute_host_threads = 1;
  o.spec.shape.seq = 1;  // the fewest activations: a size that does not fit then never will
  o.spec.shape.batch = 1;
  if (Status fits = plan_fits(o.spec, o.placement, o.capacity); !fits.ok()) return too_large(o, fits);
  // Note [Verify host memory]: up front, before the products' scratch is allocated.
  if (Status fits = fits_host_memory(o, o.spec, 1); !fits.ok()) return too_large(o, fits);
  constexpr std::uint64_t kProbeTokens = 16;
  const std::uint64_t layers = o.spec.shape.layers + 1;  // and the embedding, one layer's size
  STRATA_ASSIGN_OR_RETURN(double rate, measure_verify_compute(o.spec.shape.hidden, kProbeTokens, layers));
  std::uint64_t tokens = o.tokens;
  if (tokens == 0) {
    STRATA_ASSIGN_OR_RETURN(tokens, choose_tokens(o, rate));
  }
  STRATA_ASSIGN_OR_RETURN(r.compute_flops_per_s, measure_verify_compute(o.spec.shape.hidden, tokens, layers));
  o.spec.shape.seq = tokens;
  o.spec.shape.batch = 1;
  o.spec.device_flops_per_s = r.compute_flops_per_s;
  r.tokens = tokens;
  const TrainSpec& spec = o.spec;
  STRATA_ASSIGN_OR_RETURN(r.params, shape_params(spec.shape));
  if (Status fits = plan_fits(spec, o.placement, o.capacity); !fits.ok()) return too_large(o, fits);
  // Bound the compute of a step (a slow host with --verify-params in the
  // billions would run for hours and look like a hang).
  const double compute_s = 6.0 * static_cast<double>(r.params) * static_cast<double>(spec.shape.seq) *
                           static_cast<double>(spec.shape.batch) / spec.device_flops_per_s;
  if (!(compute_s <= kVerifyStepSecondsMax)) {
    return invalid_argument(
        "--verify: a step of the verify model computes for {:.0f} s here ({} params over {} tokens at the "
        "measured {:.1f} GFLOP/s); at most {:.0f} s: lower --verify-params",
        compute_s, format_count(r.params), tokens, spec.device_flops_per_s / 1e9, kVerifyStepSecondsMax);
  }
  STRATA_ASSIGN_OR_RETURN(Estimate predicted, estimate_at(spec, o.placement, o.capacity, o.rates));
  // Note [Verify budgets]: the runtime's host budget is the probe's plus a reserve
  // (PlanOptions::host_reserve_bytes, 25%) that its planner keeps free, so both
  // planners place the same states, and the runtime has room for what its plan
  // does not count (the pinned arena fragments; the warm-up step is unplanned). The
  // budgets_held check is against the runtime's budget. The GPU budget the runtime
  // gets leaves out the modelled activations, which this synthetic model does not
  // allocate (the runtime does not trace a non-chunk peak on the sim device), so
  // the runtime's plan sees the same free GPU bytes as the probe's.
  STRATA_ASSIGN_OR_RETURN(r.budgets, tight_budgets(spec, o.placement, o.capacity, o.rates));
  // The prediction at the budgets the runtime will get.
  Capacity tight{r.budgets.gpu_bytes, r.budgets.host_bytes, r.budgets.nvme_bytes};
  STRATA_ASSIGN_OR_RETURN(predicted, estimate_at(spec, o.placement, tight, o.rates));
  r.predicted_s = predicted.cost.step_s * o.prediction_scale;
  r.predicted_cost = predicted.cost;
  r.bottleneck = predicted.cost.bottleneck;
  if (Status fits = fits_host_memory(o, spec, tokens); !fits.ok()) return too_large(o, fits);
  return o;
}

// The runtime's options for the verify run (Note [Verify budgets], in
// size_verify_run): chunk budget without the modelled activations, the host
// budget with the planner's reserve, the NVMe directory when the plan needs one.
Result<runtime::RuntimeOptions> verify_runtime_options(const VerifyOptions& o, std::uint64_t activations,
                                                       VerifyResult& r) {
  const TrainSpec& spec = o.spec;
  runtime::RuntimeOptions ro = runtime_options(spec);
  ro.budgets = r.budgets;
  ro.budgets.gpu_bytes = r.budgets.gpu_bytes - activations;
  r.gpu_chunk_budget_bytes = ro.budgets.gpu_bytes;
  ro.budgets.host_bytes = runtime_host_budget(r.budgets.host_bytes);
  ro.plan.host_reserve_bytes = ro.budgets.host_bytes - r.budgets.host_bytes;
  r.host_budget_bytes = ro.budgets.host_bytes;
  // The probe's least NVMe budget already counts whole slots and the
  // copy-on-write room (Note [Copy-on-write NVMe slots]): no extra headroom.
  ro.budgets.nvme_bytes = r.budgets.nvme_bytes;
  if (r.budgets.nvme_bytes > 0) {
    // The swap files go straight into the directory (Note [Stable scratch layout]):
    // a crashed run's are found and reclaimed by the next.
    if (o.nvme_dir.empty())
      return invalid_argument("--verify at {}: needs --nvme DIR", placement_name(o.placement));
    ro.nvme_dirs = {o.nvme_dir};
  }
  const std::uint64_t per_layer = 12 * spec.shape.hidden * spec.shape.hidden;
  ro.layout.chunk_elems = align_up(per_layer, 4096);
  return ro;
}

// Registers the verify model: the embedding and one tensor per layer, every one
// a h x 12h family (the embedding too: vocabulary 12h).
Result<std::vector<runtime::TensorId>> register_verify_model(runtime::Runtime* rt, const TrainSpec& spec) {
  const std::uint64_t per_layer = 12 * spec.shape.hidden * spec.shape.hidden;
  std::vector<runtime::TensorId> ids;
  std::vector<std::uint64_t> numels;
  const auto embed = static_cast<std::int64_t>(spec.shape.vocab * spec.shape.hidden);
  STRATA_ASSIGN_OR_RETURN(runtime::TensorId e, rt->register_tensor({"embed", {embed}, spec.compute_dtype}));
  ids.push_back(e);
  numels.push_back(static_cast<std::uint64_t>(embed));
  for (std::uint64_t l = 0; l < spec.shape.layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(runtime::TensorId id, rt->register_tensor({fmt::format("layer{}", l),
                                                                       {static_cast<std::int64_t>(per_layer)},
                                                                       spec.compute_dtype}));
    ids.push_back(id);
    numels.push_back(per_layer);
  }
  STRATA_CHECK(std::all_of(numels.begin(), numels.end(), [&](std::uint64_t n) { return n == per_layer; }));
  return ids;
}

// The warm-up and timed steps: each layer's products forward, then backward
// with a gradient lease, then step(). Returns the timed steps' stats (high
// waters into `r`).
Result<std::vector<runtime::StepStats>> run_verify_steps(runtime::Runtime* rt, const VerifyOptions& o,
                                                         const std::vector<runtime::TensorId>& ids,
                                                         LayerScratch* m, const LayerShape& shape,
                                                         VerifyResult& r) {
  const bool f32 = o.spec.compute_dtype == runtime::DType::kF32;
  const std::uint64_t esize = runtime::dtype_bytes(o.spec.compute_dtype);
  std::vector<runtime::StepStats> steady;
  for (int s = 0; s < o.warmup_steps + o.steps; ++s) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p, rt->acquire(ids[i], StateKind::kParam, Access::kRead));
      const float* w = f32 ? static_cast<const float*>(p.data()) : m->w.data();
      STRATA_RETURN_IF_ERROR(rt->launch([w, m, shape] {
        layer_forward(w, m->x.data(), m->y.data(), shape.tokens, shape.hidden, shape.cols);
      }));
    }
    for (std::size_t i = ids.size(); i-- > 0;) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p, rt->acquire(ids[i], StateKind::kParam, Access::kRead));
      STRATA_ASSIGN_OR_RETURN(runtime::Lease g, rt->acquire(ids[i], StateKind::kGrad, Access::kWrite));
      const float* w = f32 ? static_cast<const float*>(p.data()) : m->w.data();
      auto* grad = static_cast<std::byte*>(g.data());
      const std::size_t bytes = g.numel() * esize;
      STRATA_RETURN_IF_ERROR(rt->launch([w, m, shape, grad, bytes, f32] {
        float* dw = f32 ? reinterpret_cast<float*>(grad) : m->dw.data();
        layer_backward(w, m->x.data(), m->dy.data(), dw, m->dx.data(), shape.tokens, shape.hidden,
                       shape.cols);
        if (!f32) std::memset(grad, 0, bytes);  // a (zero) gradient in the compute dtype
      }));
    }
    STRATA_ASSIGN_OR_RETURN(runtime::StepStats st, rt->step());
    if (s >= o.warmup_steps) {
      r.gpu_high_water_bytes = std::max(r.gpu_high_water_bytes, st.gpu_high_water_bytes);
      r.host_high_water_bytes = std::max(r.host_high_water_bytes, st.host_high_water_bytes);
      r.nvme_bytes = std::max(r.nvme_bytes, st.nvme_bytes);
      steady.push_back(st);
    }
  }
  return steady;
}

}  // namespace

Result<VerifyResult> verify(const VerifyOptions& options) {
  VerifyResult r;
  STRATA_ASSIGN_OR_RETURN(const VerifyOptions o, size_verify_run(options, r));
  const TrainSpec& spec = o.spec;
  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  STRATA_ASSIGN_OR_RETURN(std::uint64_t activations, activation_peak_bytes(spec));
  dopt.budget_bytes = sim_device_bytes(r.budgets.gpu_bytes);
  dopt.h2d_bytes_per_s = o.link_bytes_per_s;
  dopt.d2h_bytes_per_s = o.link_bytes_per_s;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<memory::Device> device, memory::make_device(dopt));
  STRATA_ASSIGN_OR_RETURN(const runtime::RuntimeOptions ro, verify_runtime_options(o, activations, r));
  // Outlives the runtime, whose compute stream runs the products on it.
  const bool f32 = spec.compute_dtype == runtime::DType::kF32;
  const LayerShape shape(r.tokens, spec.shape.hidden);
  LayerScratch scratch(shape, /*own_weights=*/!f32);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<runtime::Runtime> rt, runtime::Runtime::create(*device, ro));
  STRATA_ASSIGN_OR_RETURN(const std::vector<runtime::TensorId> ids, register_verify_model(rt.get(), spec));
  STRATA_ASSIGN_OR_RETURN(std::vector<runtime::StepStats> steady,
                          run_verify_steps(rt.get(), o, ids, &scratch, shape, r));
  STRATA_CHECK(!steady.empty());  // steps >= 1, checked above
  std::sort(steady.begin(), steady.end(),
            [](const runtime::StepStats& a, const runtime::StepStats& b) { return a.step_s < b.step_s; });
  r.measured_stats = steady[steady.size() / 2];
  r.measured_s = r.measured_stats.step_s;
  const runtime::StepStats& last = r.measured_stats;
  r.ratio = r.measured_s / r.predicted_s;
  r.plan = rt->plan().summary();
  r.plan_matches = plan_matches(rt->plan(), o.placement);
  r.runtime_predicted_s = rt->predict(o.rates).step_s * o.prediction_scale;
  r.budgets_held = r.gpu_high_water_bytes <= ro.budgets.gpu_bytes &&
                   r.host_high_water_bytes <= ro.budgets.host_bytes &&
                   (ro.budgets.nvme_bytes == 0 || r.nvme_bytes <= ro.budgets.nvme_bytes);
  STRATA_LOG_DEBUG("probe verify: last step h2d {} d2h {} disk r/w {} / {}; busy s: {}", last.bytes_h2d,
                   last.bytes_d2h, last.bytes_disk_read, last.bytes_disk_write, fmt::join(last.busy_s, " "));
  STRATA_LOG_DEBUG("probe verify: stall {:.3f} s", last.stall_s);
  return r;
}

}  // namespace strata::probe
