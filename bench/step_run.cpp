// strata-bench step's runs (step_run.hpp).
//
// Note [Sim compute in the step benchmark]
// On the sim device the model's forward and backward are timed kernels: each
// layer's kernel sleeps for its FLOPs at a stated rate (2 x params x tokens
// forward, 4 x backward) and fills its gradient, so the host's two cores are
// left to what a real host does — optimizer steps, staging copies, I/O. The
// output says so. Everything else (copies throttled to a PCIe-like rate, the
// CPU optimizer, NVMe I/O) is real work.
#include "step_run.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/options.hpp"

namespace strata::bench::step {

using runtime::Runtime;

namespace {

//! The bound of Note [Rates lower bound] for one steady step `st` of `rt`.
void rates_bound(const Runtime& rt, const runtime::StepStats& st, const PeakRates& peaks, double compute_flop,
                 double flops, RunResult& r) {
  runtime::Rates rates = peaks.rates;
  rates.gpu_optim_params_per_s = rates.cpu_optim_params_per_s;  // sim: the same CPU kernel
  rates.copy_host_passes = 2.0;                                 // the sim device's copies are memcpy
  // Only the plan's work counts are used from the cost model, never its times.
  const runtime::StepCost work = rt.predict(rates);
  r.resources = {
      {"compute", compute_flop, "FLOP", flops, 0},
      {"h2d", double(st.bytes_h2d), "B", rates.h2d_bytes_per_s, 0},
      {"d2h", double(st.bytes_d2h), "B", rates.d2h_bytes_per_s, 0},
      {"disk_read", double(st.bytes_disk_read), "B", rates.disk_read_bytes_per_s, 0},
      {"disk_write", double(st.bytes_disk_write), "B", rates.disk_write_bytes_per_s, 0},
      {"disk_read_write", double(st.bytes_disk_read + st.bytes_disk_write), "B", rates.disk_mixed_bytes_per_s,
       0},
      {"cpu_optimizer", double(work.params_cpu_optim + work.params_gpu_optim), "params",
       rates.cpu_optim_params_per_s, 0},
      {"host_memory", double(work.bytes_host_memory), "B", rates.host_memory_bytes_per_s, 0},
  };
  r.bound_s = 0;
  for (Resource& res : r.resources) {
    res.seconds = res.work > 0 ? res.work / res.peak_per_s : 0.0;
    if (res.seconds > r.bound_s) {
      r.bound_s = res.seconds;
      r.bottleneck = res.name;
    }
  }
}

constexpr int kStepsMax = 1000, kRunsMax = 100;
constexpr std::size_t kLayersMax = 4096;

void sleep_for_s(double s) {
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

//! The sim device of Note [Sim compute in the step benchmark]: copies at --link.
Result<std::unique_ptr<memory::Device>> make_sim_device(const Checked& c) {
  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = c.gpu + 64 * kMiB;
  dopt.h2d_bytes_per_s = c.link;
  dopt.d2h_bytes_per_s = c.link;
  return memory::make_device(dopt);
}

//! The runtime of one run, with one tensor (one chunk family) a layer, into ids.
Result<std::unique_ptr<Runtime>> make_runtime(memory::Device& device, const StepOptions& o, const Checked& c,
                                              const ScratchDir& dir, bool prefetch,
                                              std::vector<runtime::TensorId>& ids) {
  runtime::RuntimeOptions ro;
  ro.hyper.optimizer = kernels::Optimizer::kAdamW;
  ro.budgets = {.gpu_bytes = c.gpu, .host_bytes = c.host, .nvme_bytes = 2 * c.states};
  ro.nvme_dirs = {dir.path().string()};
  ro.layout.chunk_elems = c.per_layer;
  ro.plan.prefetch = prefetch;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::create(device, ro));
  for (std::size_t l = 0; l < o.layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(
        runtime::TensorId id,
        rt->register_tensor({fmt::format("layer{}", l), {static_cast<std::int64_t>(c.per_layer)}}));
    ids.push_back(id);
  }
  return rt;
}

//! One training step's forward and backward as timed kernels (Note [Sim compute in
//! the step benchmark]); the optimizer step is the caller's rt.step().
Status train_step(Runtime& rt, const std::vector<runtime::TensorId>& ids, double fwd_s) {
  for (runtime::TensorId id : ids) {
    STRATA_ASSIGN_OR_RETURN(runtime::Lease p,
                            rt.acquire(id, runtime::StateKind::kParam, runtime::Access::kRead));
    STRATA_RETURN_IF_ERROR(rt.launch([fwd_s] { sleep_for_s(fwd_s); }));
  }
  for (std::size_t l = ids.size(); l-- > 0;) {
    STRATA_ASSIGN_OR_RETURN(runtime::Lease p,
                            rt.acquire(ids[l], runtime::StateKind::kParam, runtime::Access::kRead));
    STRATA_ASSIGN_OR_RETURN(runtime::Lease g,
                            rt.acquire(ids[l], runtime::StateKind::kGrad, runtime::Access::kWrite));
    float* grad = g.as<float>();
    const std::size_t n = g.numel();
    STRATA_RETURN_IF_ERROR(rt.launch([grad, n, fwd_s] {
      const auto t0 = std::chrono::steady_clock::now();
      std::memset(grad, 0, n * sizeof(float));  // the kernel's output: a (zero) gradient
      grad[n / 2] = 1e-3f;
      std::this_thread::sleep_until(t0 + std::chrono::duration<double>(2 * fwd_s));
    }));
  }
  return Status::Ok();
}

//! The steady steps' stats, after the overlap's steps (when given) and the trace.
Result<std::vector<runtime::StepStats>> train(Runtime& rt, const StepOptions& o,
                                              const std::vector<runtime::TensorId>& ids, double fwd_s,
                                              const std::string& trace_path, CheckpointOverlap* overlap) {
  std::vector<runtime::StepStats> steady;
  for (int s = 0; s < o.steps + 2; ++s) {
    STRATA_RETURN_IF_ERROR(train_step(rt, ids, fwd_s));
    STRATA_ASSIGN_OR_RETURN(runtime::StepStats st, rt.step());
    if (s >= 2) steady.push_back(st);  // step 1 traces, step 2 adopts the plan
  }
  // Note [Checkpoint overlap in the step benchmark]: after the steady steps.
  if (overlap != nullptr) overlap->set_steps_between(o.steps);
  while (overlap != nullptr && !overlap->done()) {
    STRATA_RETURN_IF_ERROR(overlap->before_step(rt));
    STRATA_RETURN_IF_ERROR(train_step(rt, ids, fwd_s));
    STRATA_RETURN_IF_ERROR(rt.step().status());
    STRATA_RETURN_IF_ERROR(overlap->after_step(rt));
  }
  if (!trace_path.empty()) STRATA_RETURN_IF_ERROR(rt.write_chrome_trace(trace_path));
  return steady;
}

}  // namespace

Result<Checked> check(const StepOptions& o) {
  Checked c;
  if (o.steps < 1 || o.steps > kStepsMax)
    return invalid_argument("--steps = {}: use 1 .. {} (the median steady step is reported)", o.steps,
                            kStepsMax);
  if (o.runs < 1 || o.runs > kRunsMax)
    return invalid_argument("--runs = {}: use 1 .. {} (the median run is reported)", o.runs, kRunsMax);
  if (o.layers < 1 || o.layers > kLayersMax)
    return invalid_argument("--layers = {}: use 1 .. {}", o.layers, kLayersMax);
  if (!(o.flops > 0 && o.flops <= 1e18))
    return invalid_argument("--flops = {}: use a rate in (0, 1e18]", o.flops);
  if (o.tokens == 0 || o.tokens > (std::uint64_t{1} << 40))
    return invalid_argument("--tokens = {}: use 1 .. 2^40", o.tokens);
  STRATA_ASSIGN_OR_RETURN(c.states, parse_bytes(o.states, "--states"));
  STRATA_ASSIGN_OR_RETURN(c.gpu, parse_bytes(o.gpu_budget, "--gpu-budget"));
  STRATA_ASSIGN_OR_RETURN(c.host, parse_bytes(o.host_budget, "--host-budget"));
  STRATA_ASSIGN_OR_RETURN(c.link, parse_bytes(o.link, "--link"));
  if (c.link < memory::kSimBandwidthMinBytesPerS) {
    return invalid_argument("--link = {}: give the sim copy rate per second, at least {} (e.g. 12GiB)",
                            o.link, format_bytes(memory::kSimBandwidthMinBytesPerS));
  }
  // fp32 AdamW: param (= master) + grad + exp_avg + exp_avg_sq = 16 bytes a parameter.
  const std::uint64_t layer_bytes = 16 * 4096;
  if (c.states / o.layers < layer_bytes || c.states > (std::uint64_t{1} << 50)) {
    return invalid_argument(
        "--states = {}: give at least {} for {} layers (16 B a param, 4096 params a layer) "
        "and at most 1PiB",
        o.states, format_bytes(layer_bytes * o.layers), o.layers);
  }
  c.per_layer = align_up(c.states / 16 / o.layers, 4096);
  // The layers sleep for their modelled compute (6 FLOPs a param a token): bound a
  // step's, or a mistyped --tokens or --flops is a run of hours that looks like a hang.
  const double compute_s =
      6.0 * static_cast<double>(c.per_layer * o.layers) * static_cast<double>(o.tokens) / o.flops;
  if (compute_s > 60.0) {
    return invalid_argument("--tokens {} at --flops {:g}: {:.0f} s of modelled compute a step; at most 60 s",
                            o.tokens, o.flops, compute_s);
  }
  return c;
}

Result<RunResult> run_once(const StepOptions& o, const Checked& c, const ScratchDir& dir, bool prefetch,
                           const std::string& trace_path, CheckpointOverlap* overlap) {
  const std::uint64_t per_layer = c.per_layer;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<memory::Device> device, make_sim_device(c));

  // The peaks, before the step, on the same device and in the same directory.
  STRATA_ASSIGN_OR_RETURN(
      PeakRates peaks,
      measure_peaks(*device, {.chunk_bytes = per_layer * 4,
                              .dir = dir.path(),
                              .threads = std::max(1u, std::thread::hardware_concurrency())}));
  std::vector<runtime::TensorId> ids;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, make_runtime(*device, o, c, dir, prefetch, ids));
  const double fwd_s =
      runtime::forward_flops(static_cast<double>(per_layer), static_cast<double>(o.tokens)) / o.flops;
  STRATA_LOG_DEBUG("bench step: {} params a layer, forward {:.4f} s a layer", per_layer, fwd_s);
  STRATA_ASSIGN_OR_RETURN(std::vector<runtime::StepStats> steady,
                          train(*rt, o, ids, fwd_s, trace_path, overlap));

  // The median step, and its lower bound from the peaks (Note [Rates lower bound]).
  std::sort(steady.begin(), steady.end(), [](const auto& a, const auto& b) { return a.step_s < b.step_s; });
  RunResult r;
  r.stats = steady[steady.size() / 2];
  r.step_s = r.stats.step_s;
  r.peaks = peaks;
  const double compute_flop = 6.0 * double(per_layer) * double(o.layers) * double(o.tokens);  // 2 fwd + 4 bwd
  rates_bound(*rt, r.stats, peaks, compute_flop, o.flops, r);
  for (double busy : r.stats.busy_s) r.timeline_busiest_s = std::max(r.timeline_busiest_s, busy);
  for (runtime::FamilyId f = 0; f < rt->plan().families.size(); ++f) {
    if (rt->plan().families[f].param_home == runtime::Tier::kNvme)
      r.params_nvme_bytes += rt->layout().families[f].capacity_elems * sizeof(float);
  }
  return r;
}

}  // namespace strata::bench::step
