// strata-bench step: a synthetic model trained by the chunk runtime on the sim
// device, against a lower bound from each resource's work and its peak rate,
// measured in the same run before the step (Note [Rates lower bound]).
//
// Note [Sim compute in the step benchmark]
// On the sim device the model's forward and backward are timed kernels: each
// layer's kernel sleeps for its FLOPs at a stated rate (2 x params x tokens
// forward, 4 x backward) and fills its gradient, so the host's two cores are
// left to what a real host does — optimizer steps, staging copies, I/O. The
// output says so. Everything else (copies throttled to a PCIe-like rate, the
// CPU optimizer, NVMe I/O) is real work.
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "registry.hpp"
#include "step_checkpoint.hpp"
#include "step_exact.hpp"
#include "step_rates.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/options.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::bench {
namespace {

using runtime::Runtime;

struct StepOptions {
  std::string states = "2GiB";
  std::size_t layers = 24;
  std::string gpu_budget = "256MiB";
  std::string host_budget = "1GiB";
  std::string link = "12GiB";  // per direction, PCIe 4 x16 in practice
  // The default workload: a 134M-parameter model (2 GiB of fp32 AdamW state)
  // trained on 0.5M tokens a step (GPT-2 small's batch) by a GPU sustaining
  // 400 TFLOP/s (about 40% of an H100's dense bf16 peak): about 1 s of compute.
  double flops = 400e12;  // sim device compute rate, FLOP/s
  std::uint64_t tokens = 524288;
  std::string dir;
  int steps = 4;
  int runs = 3;
  bool json = false;
  std::string trace;
};

//! One resource of the bound: its work in a step, its peak and their quotient.
struct Resource {
  std::string name;
  double work = 0;  //!< bytes, parameters or FLOP
  std::string unit;
  double peak_per_s = 0;
  double seconds = 0;  //!< work / peak
};

struct RunResult {
  double step_s = 0, bound_s = 0;
  runtime::StepStats stats;
  std::string bottleneck;
  std::vector<Resource> resources;  //!< Note [Rates lower bound]
  PeakRates peaks;
  double timeline_busiest_s = 0;        //!< the busiest track of the timeline (information)
  std::uint64_t params_nvme_bytes = 0;  //!< fp32 params the plan homes on NVMe
};

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

// The flags, checked before anything runs (Note [One validation per input kind]
// in runtime/options.hpp). The runtime's own settings are checked by
// runtime::validate_options when run_once creates it, with the same messages.
struct Checked {
  std::uint64_t states = 0, gpu = 0, host = 0, link = 0;
  std::uint64_t per_layer = 0;  // params a layer (one chunk family each)
};

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
                           const std::string& trace_path, CheckpointOverlap* overlap = nullptr) {
  const std::uint64_t states = c.states, gpu = c.gpu, host = c.host, link = c.link;
  const std::uint64_t per_layer = c.per_layer;

  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = gpu + 64 * kMiB;
  dopt.h2d_bytes_per_s = link;
  dopt.d2h_bytes_per_s = link;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<memory::Device> device, memory::make_device(dopt));

  // The peaks, before the step, on the same device and in the same directory.
  STRATA_ASSIGN_OR_RETURN(
      PeakRates peaks,
      measure_peaks(*device, {.chunk_bytes = per_layer * 4,
                              .dir = dir.path(),
                              .threads = std::max(1u, std::thread::hardware_concurrency())}));

  runtime::RuntimeOptions ro;
  ro.hyper.optimizer = kernels::Optimizer::kAdamW;
  ro.budgets = {.gpu_bytes = gpu, .host_bytes = host, .nvme_bytes = 2 * states};
  ro.nvme_dirs = {dir.path().string()};
  ro.layout.chunk_elems = per_layer;
  ro.plan.prefetch = prefetch;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::create(*device, ro));
  std::vector<runtime::TensorId> ids;
  for (std::size_t l = 0; l < o.layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(
        runtime::TensorId id,
        rt->register_tensor({fmt::format("layer{}", l), {static_cast<std::int64_t>(per_layer)}}));
    ids.push_back(id);
  }
  const double fwd_s =
      runtime::forward_flops(static_cast<double>(per_layer), static_cast<double>(o.tokens)) / o.flops;
  STRATA_LOG_DEBUG("bench step: {} params a layer, forward {:.4f} s a layer", per_layer, fwd_s);
  auto sleep_for = [](double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); };

  std::vector<runtime::StepStats> steady;
  auto train_step = [&]() -> Status {
    for (runtime::TensorId id : ids) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p,
                              rt->acquire(id, runtime::StateKind::kParam, runtime::Access::kRead));
      STRATA_RETURN_IF_ERROR(rt->launch([&, fwd_s] { sleep_for(fwd_s); }));
    }
    for (std::size_t l = o.layers; l-- > 0;) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p,
                              rt->acquire(ids[l], runtime::StateKind::kParam, runtime::Access::kRead));
      STRATA_ASSIGN_OR_RETURN(runtime::Lease g,
                              rt->acquire(ids[l], runtime::StateKind::kGrad, runtime::Access::kWrite));
      float* grad = g.as<float>();
      const std::size_t n = g.numel();
      STRATA_RETURN_IF_ERROR(rt->launch([&, grad, n, fwd_s] {
        const auto t0 = std::chrono::steady_clock::now();
        std::memset(grad, 0, n * sizeof(float));  // the kernel's output: a (zero) gradient
        grad[n / 2] = 1e-3f;
        std::this_thread::sleep_until(t0 + std::chrono::duration<double>(2 * fwd_s));
      }));
    }
    return Status::Ok();
  };
  for (int s = 0; s < o.steps + 2; ++s) {
    STRATA_RETURN_IF_ERROR(train_step());
    STRATA_ASSIGN_OR_RETURN(runtime::StepStats st, rt->step());
    if (s >= 2) steady.push_back(st);  // step 1 traces, step 2 adopts the plan
  }
  // Note [Checkpoint overlap in the step benchmark]: after the steady steps.
  if (overlap != nullptr) overlap->set_steps_between(o.steps);
  while (overlap != nullptr && !overlap->done()) {
    STRATA_RETURN_IF_ERROR(overlap->before_step(*rt));
    STRATA_RETURN_IF_ERROR(train_step());
    STRATA_RETURN_IF_ERROR(rt->step().status());
    STRATA_RETURN_IF_ERROR(overlap->after_step(*rt));
  }
  if (!trace_path.empty()) STRATA_RETURN_IF_ERROR(rt->write_chrome_trace(trace_path));

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

int run(const StepOptions& o) {
  auto checked = check(o);
  if (!checked.ok()) {
    fmt::print(stderr, "strata-bench step: {}\n", checked.status().to_string());
    return 2;
  }
  // Swap files go straight into --dir, or the stable $TMPDIR/strata-bench-step
  // (Note [Stable scratch layout]); a crashed run's are reclaimed here.
  auto dir = runtime::open_tool_nvme_dir(o.dir, "--dir", "strata-bench-step");
  if (!dir.ok()) {
    fmt::print(stderr, "strata-bench step: {}\n", dir.status().to_string());
    return 2;
  }
  std::vector<double> step_s, bound_s, ratio, no_prefetch_s;
  nlohmann::json per_run = nlohmann::json::array();
  RunResult last;
  auto overlap = CheckpointOverlap::create();
  if (!overlap.ok()) {
    fmt::print(stderr, "strata-bench step: {}\n", overlap.status().to_string());
    return 1;
  }
  for (int i = 0; i < o.runs; ++i) {
    // The first run also measures checkpoint_overlap_slowdown, after its steady steps.
    auto with = run_once(o, *checked, *dir, true, i == 0 ? o.trace : "", i == 0 ? overlap->get() : nullptr);
    if (!with.ok()) {
      fmt::print(stderr, "strata-bench step: {}\n", with.status().to_string());
      return 1;
    }
    auto without = run_once(o, *checked, *dir, false, "");
    if (!without.ok()) {
      fmt::print(stderr, "strata-bench step (no prefetch): {}\n", without.status().to_string());
      return 1;
    }
    step_s.push_back(with->step_s);
    bound_s.push_back(with->bound_s);
    ratio.push_back(with->step_s / with->bound_s);
    per_run.push_back({{"step_s", with->step_s},
                       {"bound_s", with->bound_s},
                       {"ratio", with->step_s / with->bound_s},
                       {"bottleneck", with->bottleneck},
                       {"no_prefetch_step_s", without->step_s}});
    no_prefetch_s.push_back(without->step_s);
    last = *with;
    if (!o.json) {
      fmt::print(stderr, "run {}: step {:.3f} s, bound {:.3f} s ({}), ratio {:.3f}; no prefetch {:.3f} s\n",
                 i + 1, with->step_s, with->bound_s, with->bottleneck, with->step_s / with->bound_s,
                 without->step_s);
    }
  }
  // Note [Exactness in the step benchmark], in the same run: only when this model's
  // params spill to NVMe (otherwise there is nothing NVMe-homed to compare).
  std::optional<ExactResult> exact;
  if (last.params_nvme_bytes > 0) {
    auto checked_exact = check_bit_identical({.layers = o.layers,
                                              .params_per_layer = checked->per_layer,
                                              .host_budget_bytes = checked->host,
                                              .gpu_budget_bytes = checked->gpu},
                                             dir->path());
    if (!checked_exact.ok()) {
      fmt::print(stderr, "strata-bench step (exactness check): {}\n", checked_exact.status().to_string());
      return 1;
    }
    exact = std::move(checked_exact).value();
  }
  const std::string exact_skipped = fmt::format(
      "not checked: every param fits in host_budget {}, none lives on NVMe", format_bytes(checked->host));
  const auto& st = last.stats;
  const std::uint64_t gpu = checked->gpu, host = checked->host;
  nlohmann::json j = {
      {"backend", "sim"},
      {"compute",
       fmt::format("timed kernels at {:.1f} TFLOP/s, {} tokens per step", o.flops / 1e12, o.tokens)},
      {"states", o.states},
      {"layers", o.layers},
      {"step_s", median(step_s)},
      {"bound_source", "rates"},
      {"bound_s", median(bound_s)},
      {"ratio", median(ratio)},
      {"bottleneck", last.bottleneck},
      {"timeline_busiest_s", last.timeline_busiest_s},
      {"no_prefetch_step_s", median(no_prefetch_s)},
      {"prefetch_speedup", median(no_prefetch_s) / median(step_s)},
      {"checkpoint_overlap_slowdown", (*overlap)->slowdown()},
      {"checkpoint_overlap",
       {{"step_with_save_s", (*overlap)->with_save_s()},
        {"step_with_save_worst_s", (*overlap)->worst_with_save_s()},
        {"step_without_save_s", (*overlap)->without_save_s()},
        {"first_step_slowdown", (*overlap)->first_step_slowdown()},
        {"steps_with_save", (*overlap)->steps_with_save()},
        {"saves", CheckpointOverlap::kSaves},
        {"save_s", (*overlap)->save_s()},
        {"begin_checkpoint_s", (*overlap)->begin_s()},
        {"checkpoint_bytes", (*overlap)->checkpoint_bytes()},
        {"steps_between_saves", o.steps},
        {"how",
         "first run, after its steady steps: each save is begun just before a step (begin_checkpoint "
         "counted); "
         "every step begun while it is in flight counts as with; --steps steps without follow each save; "
         "mean of all with-steps over median of without-steps"}}},
      {"bytes_h2d", st.bytes_h2d},
      {"bytes_d2h", st.bytes_d2h},
      {"bytes_disk_read", st.bytes_disk_read},
      {"bytes_disk_write", st.bytes_disk_write},
      {"stall_s", st.stall_s},
      {"gpu_high_water_bytes", st.gpu_high_water_bytes},
      {"host_high_water_bytes", st.host_high_water_bytes},
      {"state_bytes", checked->states},
      {"params_nvme_bytes", last.params_nvme_bytes},
      {"gpu_budget_bytes", gpu},
      {"host_budget_bytes", host},
      {"bit_identical_to_host", exact ? nlohmann::json(exact->identical) : nlohmann::json(nullptr)},
      {"bit_identical_check", exact ? nlohmann::json{{"layers", exact->layers},
                                                     {"host_budget_bytes", exact->host_budget_bytes},
                                                     {"params_nvme_bytes", exact->params_nvme_bytes},
                                                     {"steps", exact->steps},
                                                     {"first_difference", exact->first_difference}}
                                    : nlohmann::json{{"skipped", exact_skipped}}},
      {"busy_s", nlohmann::json::object()},
      {"runs", o.runs},
      {"per_run", per_run},
      {"load_average_1m", load_average_1m()},
      {"timing", fmt::format("median of {} runs, each the median of {} steady steps; peaks best of 3", o.runs,
                             o.steps)},
  };
  // The breakdown of the last run: per resource its work, peak and bound, and the timeline's busy time.
  for (std::size_t t = 0; t < runtime::kTrackCount; ++t) {
    j["busy_s"][std::string(runtime::track_name(static_cast<runtime::Track>(t)))] = st.busy_s[t];
  }
  for (const Resource& res : last.resources) {
    j["resources"][res.name] = {
        {"work", res.work}, {"unit", res.unit}, {"peak_per_s", res.peak_per_s}, {"bound_s", res.seconds}};
  }
  j["disk_engine"] = last.peaks.disk.engine;
  j["disk_direct_io"] = last.peaks.disk.direct_io;
  if (o.json) {
    fmt::print("{}\n", j.dump(2));
  } else {
    fmt::print(
        "strata-bench step — sim device; compute modelled as timed kernels ({}); copies throttled to {}/s "
        "each way; real CPU optimizer (AdamW) and NVMe I/O in {}\n",
        j["compute"].get<std::string>(), o.link, dir->path().string());
    fmt::print("{:<28}{:>14}\n", "step time (median)", fmt::format("{:.3f} s", median(step_s)));
    fmt::print("{:<28}{:>14}\n", "lower bound (rates)",
               fmt::format("{:.3f} s ({})", median(bound_s), last.bottleneck));
    fmt::print("{:<28}{:>14}\n", "ratio", fmt::format("{:.3f}", median(ratio)));
    fmt::print("{:<28}{:>14}\n", "without prefetch", fmt::format("{:.3f} s", median(no_prefetch_s)));
    fmt::print("{:<28}{:>14}\n", "save in flight slowdown",
               fmt::format("{:.3f} ({:.3f} / {:.3f} s)", (*overlap)->slowdown(), (*overlap)->with_save_s(),
                           (*overlap)->without_save_s()));
    fmt::print("{:<28}{:>14}\n", "bytes h2d / d2h",
               fmt::format("{} / {}", format_bytes(st.bytes_h2d), format_bytes(st.bytes_d2h)));
    fmt::print("{:<28}{:>14}\n", "bytes disk read / write",
               fmt::format("{} / {}", format_bytes(st.bytes_disk_read), format_bytes(st.bytes_disk_write)));
    fmt::print("{:<28}{:>14}\n", "gpu high water / budget",
               fmt::format("{} / {}", format_bytes(st.gpu_high_water_bytes), format_bytes(gpu)));
    fmt::print("{:<28}{:>14}\n", "host high water / budget",
               fmt::format("{} / {}", format_bytes(st.host_high_water_bytes), format_bytes(host)));
    fmt::print(
        "{:<28}{:>14}\n", "bit-identical to host",
        exact ? fmt::format("{} ({} layers, host_budget {}, {} params on NVMe, {} steps){}",
                            exact->identical ? "yes" : "NO", exact->layers,
                            format_bytes(exact->host_budget_bytes), format_bytes(exact->params_nvme_bytes),
                            exact->steps, exact->identical ? "" : ": " + exact->first_difference)
              : exact_skipped);
    fmt::print(
        "\nlower bound per resource (last run; peaks measured before its steps; busy = its timeline):\n");
    fmt::print("  {:<14} {:>12} {:>7} {:>14} {:>9} {:>9}\n", "resource", "work", "unit", "peak /s", "bound s",
               "busy s");
    for (const Resource& res : last.resources) {
      const nlohmann::json& busy = j["busy_s"];
      fmt::print("  {:<14} {:>12.4g} {:>7} {:>14.4g} {:>9.3f} {:>9}\n", res.name, res.work, res.unit,
                 res.peak_per_s, res.seconds,
                 busy.contains(res.name) ? fmt::format("{:.3f}", busy[res.name].get<double>()) : "-");
    }
  }
  const bool budgets_held = st.gpu_high_water_bytes <= gpu && st.host_high_water_bytes <= host;
  if (!budgets_held) {
    fmt::print(stderr, "strata-bench step: a budget was exceeded\n");
    return 1;
  }
  if (exact && !exact->identical) {
    fmt::print(stderr, "strata-bench step: NVMe-homed training differs from all on host: {}\n",
               exact->first_difference);
    return 1;
  }
  return 0;
}

Registrar reg{
    "step", "chunk runtime: steady step time vs its resource lower bound (sim device)", [](CLI::App& app) {
      auto o = std::make_shared<StepOptions>();
      app.add_option("--states", o->states, "model-state bytes (fp32 AdamW: 16 B/param)")
          ->capture_default_str();
      app.add_option("--layers", o->layers, "layers (one chunk family each)")->capture_default_str();
      app.add_option("--gpu-budget", o->gpu_budget, "device chunk budget")->capture_default_str();
      app.add_option("--host-budget", o->host_budget, "host budget")->capture_default_str();
      app.add_option("--link", o->link, "sim copy bandwidth per direction, per second")
          ->capture_default_str();
      app.add_option("--flops", o->flops, "sim compute rate, FLOP/s")->capture_default_str();
      app.add_option("--tokens", o->tokens, "tokens per step")->capture_default_str();
      app.add_option("--dir", o->dir, "NVMe directory (default: the temp dir)");
      app.add_option("--steps", o->steps, "steady steps per run")->capture_default_str();
      app.add_option("--runs", o->runs, "runs (median reported)")->capture_default_str();
      app.add_option("--trace", o->trace, "write the first run's Chrome trace here");
      app.add_flag("--json", o->json, "print one JSON object");
      return [o] { return run(*o); };
    }};

}  // namespace
}  // namespace strata::bench
