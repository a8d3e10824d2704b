// strata-probe's run: measure the machine, plan every placement from the
// measurements, run --verify when asked, print, and the exit code (cli.hpp).
#include "run.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/options.hpp"

namespace strata::probe {
namespace {

using Clock = std::chrono::steady_clock;

// A one-line bar on stderr, only when stderr is a terminal.
Progress progress_bar() {
  if (::isatty(STDERR_FILENO) == 0) return {};
  return [](std::string_view stage, double fraction) {
    const int width = 30;
    const int filled = static_cast<int>(fraction * width);
    std::fprintf(stderr, "\r  %-14.*s [%s%s] %3d%%", static_cast<int>(stage.size()), stage.data(),
                 std::string(static_cast<std::size_t>(filled), '#').c_str(),
                 std::string(static_cast<std::size_t>(width - filled), ' ').c_str(),
                 static_cast<int>(fraction * 100));
    if (fraction >= 1.0) std::fprintf(stderr, "\r%60s\r", "");
    std::fflush(stderr);
  };
}

int fail(const Status& status) {
  std::fprintf(stderr, "strata-probe: %s\n", status.to_string().c_str());
  return 1;
}

// Note [Probe host rounds]
// The host's rates move under the probe: on this project's VM the same 16M-param
// AdamW step ran at medians of 1.10 to 1.79 Gparams/s, and the 256 MiB parallel
// copy at 20 to 35 GB/s, in probe runs a few seconds apart (2026-12-07). Two
// things moved them. The disk's passes leave the machine slower for seconds
// after they end (a 2 GiB O_DIRECT write before an otherwise idle probe spread
// its host-memory rate over 30 %, against 3 % without it), so a probe measuring
// after its own disk test, or right after another probe's, measured that tail;
// and the machine itself drifts over seconds in both directions. More samples in
// one window did not help (they sample the same moment); spreading them does.
// So the optimizer and host-memory rates are measured in kHostRounds rounds:
// one before the disk's passes, the rest after them, and each rate is the median
// of its rounds' medians. A probe's prediction then rests on about 3 s of its
// run rather than one 0.3 s window (the probe takes ~10 s, ~6.5 s before). On this
// VM that did not make two runs agree better (docs/probe.md): a whole run is
// faster or slower than the next. The device's copies run once, first.
constexpr int kHostRounds = 3;

// One round of the host's rates: the CPU optimizer's and host memory's.
Result<std::pair<double, double>> host_round(rates::RateMeasurer& measurer, const Flags& flags,
                                             std::size_t threads, kernels::DType state_dtype) {
  STRATA_RETURN_IF_ERROR(measure_cpu_optimizer(measurer, flags.optimizer_params, threads, state_dtype));
  STRATA_RETURN_IF_ERROR(measure_host_memory(measurer, 256 * kMiB, threads));
  return std::pair{measurer.rates().cpu_optim_params_per_s, measurer.rates().host_memory_bytes_per_s};
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The probe's swap files go straight into --nvme (Note [Stable scratch layout]);
// a crashed run's are reported and reclaimed here, never read.
Result<Machine> measure_machine(const Settings& s, const Flags& flags, const Progress& progress) {
  Machine m;
  if (!s.nvme.empty()) {
    STRATA_ASSIGN_OR_RETURN(ScratchDir d, runtime::open_tool_nvme_dir(s.nvme, "--nvme", ""));
    m.nvme_dir = std::move(d);
  }
  STRATA_ASSIGN_OR_RETURN(m.host, measure_host());
  rates::RateMeasurer measurer(progress);
  memory::DeviceOptions dopt;
  STRATA_RETURN_IF_ERROR(dopt.set("kind", s.device));
  dopt.h2d_bytes_per_s = flags.link;
  dopt.d2h_bytes_per_s = flags.link;
  dopt.budget_bytes = flags.device_budget.value_or(0);
  STRATA_ASSIGN_OR_RETURN(m.device, measure_device(dopt, 64 * kMiB, measurer));
  m.threads = m.host.cores;  // as the runtime's pool (Topology: cores of a node)
  // Note [Probe host rounds]: one round before the disk's passes, the rest after.
  std::vector<double> optimizer, memory;
  // The kernel the runtime runs for these states (q8: step_q8; model_spec checked the name).
  const Result<runtime::DType> parsed = runtime::parse_dtype(s.state_dtype);
  const kernels::DType states = parsed.ok() ? *parsed : kernels::DType::kF32;
  for (int round = 0; round < kHostRounds; ++round) {
    if (round == 1 && !s.nvme.empty()) {
      STRATA_ASSIGN_OR_RETURN(
          m.nvme, measure_nvme(s.nvme, flags.nvme_bytes, flags.nvme_seconds, m.host.cores, measurer));
    }
    STRATA_ASSIGN_OR_RETURN(const auto rates, host_round(measurer, flags, m.threads, states));
    optimizer.push_back(rates.first);
    memory.push_back(rates.second);
  }
  STRATA_LOG_DEBUG("strata-probe: host rounds: optimizer {:.4g} params/s, host memory {:.4g} B/s",
                   fmt::join(optimizer, " "), fmt::join(memory, " "));
  m.rates = measurer.rates();
  m.rates.cpu_optim_params_per_s = median_of(optimizer);
  m.rates.host_memory_bytes_per_s = median_of(memory);
  m.sim = m.device.kind == "sim";
  return m;
}

// The measured rates, and the model of this device beside them.
runtime::Rates measured_rates(const Machine& m) {
  runtime::Rates rates = m.rates;
  if (m.sim)
    rates.gpu_optim_params_per_s =
        rates.cpu_optim_params_per_s;          // the sim device's "kernels" run on the host
  rates.copy_host_passes = m.sim ? 2.0 : 1.0;  // the sim device copies with memcpy
  // Note [Host cores as a resource]: on the sim device the trainer's compute runs on the
  // host, on every core (torch's CPU ops).
  if (m.sim) rates.compute_host_threads = static_cast<double>(m.threads);
  if (!m.nvme) {
    rates.disk_read_bytes_per_s = rates.disk_write_bytes_per_s = 0;
  }
  return rates;
}

Planned plan_placements(const Settings& s, const Flags& flags, const Machine& m, TrainSpec spec) {
  Planned p;
  Capacity cap;
  cap.gpu_bytes = m.device.budget_bytes;
  cap.host_bytes = m.host.ram_bytes / 4 * 3;
  if (flags.host_budget) cap.host_bytes = *flags.host_budget;
  if (m.nvme) cap.nvme_bytes = m.nvme->free_bytes / 10 * 9;
  // Data parallelism: the ranks on this node share its host RAM and NVMe; each
  // plans 1/ranks of the optimizer states (TrainSpec::ranks).
  p.ranks_per_node = s.ranks_per_node == 0 ? s.ranks : s.ranks_per_node;
  p.node_cap = cap;
  p.cap = per_rank_capacity(p.node_cap, p.ranks_per_node);
  TrainSpec one_rank = spec;
  one_rank.ranks = 1;
  // (the shape was checked by model_spec: these cannot fail)
  p.rank_bytes = rank_state_bytes(spec).value();
  p.single_bytes = rank_state_bytes(one_rank).value();
  // The all-gpu row only where the runtime runs optimizer steps on this device (q8
  // states: not on CUDA, which has no 8-bit kernel; Note [Q8 state chunks]).
  spec.gpu_optimizer = runtime::gpu_optimizer_supported(
                           m.sim ? memory::DeviceKind::kSim : memory::DeviceKind::kCuda, spec.optimizer) &&
                       (m.sim || spec.state_dtype != kernels::DType::kQ8);
  p.rates = measured_rates(m);
  for (Placement pl : kPlacements) p.rows.push_back(estimate(spec, pl, p.cap, p.rates));
  p.model_params = shape_params(spec.shape).value();
  // The caller's own model, where it fits: its step, not the largest model's.
  for (const Estimate& e : p.rows) {
    std::optional<runtime::StepCost> cost;
    if (e.feasible && e.layers >= spec.shape.layers) {
      auto at = estimate_at(spec, e.placement, p.cap, p.rates);
      if (at.ok()) cost = at->cost;
    }
    p.yours.push_back(std::move(cost));
  }
  // What your model needs per placement: the least budgets that give the
  // placement (tight_budgets against unbounded capacities).
  if (s.needs) {
    const Capacity unbounded{.gpu_bytes = 64 * kTiB, .host_bytes = 64 * kTiB, .nvme_bytes = 1024 * kTiB};
    for (Placement pl : kPlacements)
      p.needs.push_back({pl, tight_budgets(spec, pl, unbounded, p.rates, 0.0)});
  }
  p.spec = std::move(spec);
  return p;
}

}  // namespace

std::optional<Placement> fastest_for_model(const Planned& p) {
  std::optional<Placement> best;
  double best_s = 0;
  for (std::size_t i = 0; i < p.yours.size(); ++i) {
    if (p.yours[i] && (!best || p.yours[i]->step_s < best_s)) {
      best = p.rows[i].placement;
      best_s = p.yours[i]->step_s;
    }
  }
  return best;
}

namespace {

// The verify run's options: the placement asked for (or the default), its size
// (the placement's largest, capped so a few steps take seconds here).
Result<VerifyOptions> verify_options(const Settings& s, const Flags& flags, const Machine& m,
                                     const Planned& p) {
  VerifyOptions vo;
  std::string pname =
      s.verify_placement.empty() ? (m.nvme ? "optim-nvme" : "params-optim-host") : s.verify_placement;
  auto placement = parse_placement(pname);
  if (!placement.ok()) return placement.status().with_context("--verify-placement");
  if (m.nvme_dir && (*placement == Placement::kOptimNvme || *placement == Placement::kAllNvme)) {
    vo.nvme_dir = m.nvme_dir->path().string();
  }
  const Estimate& row = p.rows[static_cast<std::size_t>(*placement)];
  if (!row.feasible && s.verify_params.empty()) {
    return out_of_budget("--verify: placement {} cannot train any size here: {}", pname, row.why);
  }
  constexpr std::uint64_t kVerifyParamsMax = 64'000'000;
  std::uint64_t n = std::min(row.max_params, kVerifyParamsMax);
  if (!s.verify_params.empty()) {
    STRATA_ASSIGN_OR_RETURN(n, parse_count(s.verify_params, "--verify-params"));
  }
  vo.spec = p.spec;
  STRATA_ASSIGN_OR_RETURN(vo.spec.shape, shape_for_verify(n, s.seq, s.batch));
  vo.placement = *placement;
  vo.capacity = p.cap;
  vo.rates = p.rates;
  if (!m.sim) {  // Note [Verify on the sim device]: its links are the throttle
    vo.rates.h2d_bytes_per_s = vo.rates.d2h_bytes_per_s = static_cast<double>(flags.link);
    vo.rates.gpu_optim_params_per_s = m.rates.cpu_optim_params_per_s;
    vo.rates.copy_host_passes = 2.0;
    vo.capacity.gpu_bytes = std::min<std::uint64_t>(p.cap.gpu_bytes, m.host.ram_bytes / 8);
  }
  vo.link_bytes_per_s = flags.link;
  vo.host_memory_bytes = m.host.ram_bytes;  // Note [Verify host memory]
  vo.steps = s.verify_steps;
  return vo;
}

Result<Verified> run_verify(const Settings& s, const Flags& flags, const Machine& m, const Planned& p,
                            const Progress& progress) {
  Verified v;
  if (!s.verify) return v;
  STRATA_ASSIGN_OR_RETURN(v.options, verify_options(s, flags, m, p));
  if (const char* scale = std::getenv("STRATA_PROBE_TEST_PREDICTION_SCALE"); scale != nullptr) {
    v.options.prediction_scale = std::strtod(scale, nullptr);
    if (!(v.options.prediction_scale > 0)) {
      return invalid_argument("STRATA_PROBE_TEST_PREDICTION_SCALE = \"{}\": give a positive number", scale);
    }
    std::fprintf(stderr,
                 "strata-probe: the verify prediction is scaled by %g (STRATA_PROBE_TEST_PREDICTION_SCALE, "
                 "for tests)\n",
                 v.options.prediction_scale);
  }
  if (progress) progress("verify", 0.0);
  auto result = verify(v.options);
  if (progress) progress("verify", 1.0);
  if (!result.ok()) return result.status().with_context("--verify");
  v.result = *result;
  return v;
}

// Note [Verify exit code]: 0 the check passed, 1 an error (nothing was
// checked), 3 the check ran and failed — a ratio outside ±25 %, a budget
// exceeded, or a plan other than the placement asked for.
int exit_code(const Verified& v) {
  if (!v.result || v.result->passed()) return 0;
  const VerifyResult& r = *v.result;
  std::fprintf(stderr, "strata-probe: --verify failed: %s\n",
               fmt::format("ratio {:.2f} (measured {:.3f} s / predicted {:.3f} s, must be within 1 ± "
                           "{:.2f}); budgets {}; plan {}",
                           r.ratio, r.measured_s, r.predicted_s, kVerifyTolerance,
                           r.budgets_held ? "held" : "EXCEEDED",
                           r.plan_matches ? "as asked" : "NOT the placement asked for")
                   .c_str());
  return 3;
}

}  // namespace

int run(const Settings& s) {
  const auto start = Clock::now();
  auto flags = check_flags(s);
  if (!flags.ok()) return fail(flags.status());
  auto spec = model_spec(s);
  if (!spec.ok()) return fail(spec.status());
  const Progress progress = s.json ? Progress{} : progress_bar();
  auto machine = measure_machine(s, *flags, progress);
  if (!machine.ok()) return fail(machine.status());
  const Planned planned = plan_placements(s, *flags, *machine, *std::move(spec));
  auto verified = run_verify(s, *flags, *machine, planned, progress);
  if (!verified.ok()) return fail(verified.status());
  const double elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();
  if (s.json) {
    print_json(s, *flags, *machine, planned, *verified, elapsed_s);
  } else {
    print_text(s, *flags, *machine, planned, *verified, elapsed_s);
  }
  return exit_code(*verified);
}

}  // namespace strata::probe
