// strata-probe: measures this machine, then tells for each placement how large a
// model it can train and how fast, from the runtime's planner and cost model
// (Note [Probe placements] in model.hpp). --verify trains a synthetic model to
// check the prediction (Note [Verify on the sim device] in verify.hpp).
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "measure.hpp"
#include "model.hpp"
#include "report.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/duration.hpp"
#include "strata/common/log.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/options.hpp"
#include "verify.hpp"

namespace {

using namespace strata;
using namespace strata::probe;
using Clock = std::chrono::steady_clock;

constexpr const char* kAllNvmeNote =
    "params that do not fit on host live on NVMe with their optimizer states, read ahead through a "
    "bounded pool of staging buffers counted in the host budget";

struct Settings {
  std::string nvme;
  bool json = false;
  std::string params;
  std::uint64_t layers = 0, hidden = 0, seq = 1024, batch = 4, vocab = 50257;
  bool layers_given = false, hidden_given = false;  // an explicit 0 is an error, not "no shape"
  std::string optimizer = "adamw";
  std::string precision = "fp32";
  std::string state_dtype = "fp32";
  std::string device = "auto";
  std::string device_budget = "auto";
  std::string host_budget = "auto";
  std::string link = "12GiB";
  double tflops = 400;
  std::string nvme_bytes = "1GiB";
  std::string nvme_seconds = "3s";
  std::string optimizer_params = "16M";
  bool verify = false;
  std::string verify_placement;
  std::string verify_params;
  int verify_steps = 3;
  bool needs = false;
  bool verbose = false;
  std::uint32_t ranks = 1;           // data-parallel ranks (Note [Sharded step])
  std::uint32_t ranks_per_node = 0;  // ranks sharing this machine's host RAM and NVMe (0: all of them)
};

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

Result<kernels::Optimizer> parse_optimizer(std::string_view name) {
  using kernels::Optimizer;
  for (Optimizer o : {Optimizer::kAdam, Optimizer::kAdamW, Optimizer::kLamb, Optimizer::kLars,
                      Optimizer::kSgd, Optimizer::kLion, Optimizer::kAdagrad}) {
    if (kernels::optimizer_name(o) == name) return o;
  }
  return invalid_argument("--optimizer \"{}\": use adamw, adam, lamb, lars, sgd, lion or adagrad", name);
}

double gib(double bytes_per_s) {
  return bytes_per_s / static_cast<double>(kGiB);
}

Result<TrainSpec> model_spec(const Settings& s) {
  TrainSpec spec;
  STRATA_ASSIGN_OR_RETURN(spec.optimizer, parse_optimizer(s.optimizer));
  auto compute = runtime::parse_dtype(s.precision);
  if (!compute.ok()) return invalid_argument("--precision \"{}\": use fp32, bf16 or fp16", s.precision);
  spec.compute_dtype = *compute;
  auto states = runtime::parse_dtype(s.state_dtype);
  if (!states.ok()) return invalid_argument("--state-dtype \"{}\": use fp32 or bf16", s.state_dtype);
  spec.state_dtype = *states;
  if (!(s.tflops >= 1 && s.tflops <= 1e6)) return invalid_argument("--tflops = {}: use 1 .. 1e6", s.tflops);
  spec.device_flops_per_s = s.tflops * 1e12;
  spec.ranks = s.ranks;
  const bool shape_given = s.layers_given || s.hidden_given;
  if (shape_given && !s.params.empty()) {
    return invalid_argument("give either --params or a shape (--layers and --hidden), not both");
  }
  if (shape_given && !(s.layers_given && s.hidden_given)) {
    return invalid_argument("--layers and --hidden go together (a GPT shape); give both, or --params");
  }
  if (shape_given) {
    spec.shape = {s.layers, s.hidden, s.seq, s.batch, s.vocab};
    STRATA_RETURN_IF_ERROR(shape_params(spec.shape).status());
  } else {
    STRATA_ASSIGN_OR_RETURN(std::uint64_t n, parse_count(s.params.empty() ? "1.3B" : s.params));
    STRATA_ASSIGN_OR_RETURN(spec.shape, shape_for_params(n, s.seq, s.batch, s.vocab));
  }
  STRATA_RETURN_IF_ERROR(check_supported(spec));
  return spec;
}

int fail(const Status& status) {
  std::fprintf(stderr, "strata-probe: %s\n", status.to_string().c_str());
  return 1;
}

// A size flag that may be "auto"; 0 (like any size too small to mean anything) is an error.
Result<std::optional<std::uint64_t>> budget_flag(std::string_view flag, const std::string& text) {
  if (text == "auto") return std::optional<std::uint64_t>{};
  STRATA_ASSIGN_OR_RETURN(std::uint64_t bytes, parse_bytes(text, flag));
  if (bytes < kMiB) return invalid_argument("{} = {}: give at least 1MiB, or auto", flag, text);
  return std::optional<std::uint64_t>{bytes};
}

// Every flag checked before anything is measured (Note [One validation per input
// kind] in runtime/options.hpp): a bad flag fails in milliseconds, naming itself.
struct Flags {
  std::uint64_t link = 0, nvme_bytes = 0, optimizer_params = 0;
  double nvme_seconds = 0;
  std::optional<std::uint64_t> device_budget, host_budget;
};

Result<Flags> check_flags(const Settings& s) {
  Flags f;
  STRATA_ASSIGN_OR_RETURN(f.link, parse_bytes(s.link, "--link"));
  if (f.link < memory::kSimBandwidthMinBytesPerS) {
    return invalid_argument("--link = {}: give the sim copy rate per second, at least {} (e.g. 12GiB)",
                            s.link, format_bytes(memory::kSimBandwidthMinBytesPerS));
  }
  STRATA_ASSIGN_OR_RETURN(f.nvme_bytes, parse_bytes(s.nvme_bytes, "--nvme-bytes"));
  if (f.nvme_bytes < kMiB) return invalid_argument("--nvme-bytes = {}: give at least 1MiB", s.nvme_bytes);
  STRATA_ASSIGN_OR_RETURN(f.optimizer_params, parse_count(s.optimizer_params, "--optimizer-params"));
  const std::uint64_t ram = memory::physical_memory_bytes();
  if (ram != 0 && f.optimizer_params > ram / 4 / 16) {  // fp32 AdamW: 16 B a param
    return invalid_argument(
        "--optimizer-params = {}: at most {} on this machine (16 B a param, a quarter of RAM)",
        s.optimizer_params, format_count(ram / 4 / 16));
  }
  STRATA_ASSIGN_OR_RETURN(f.nvme_seconds, parse_seconds(s.nvme_seconds, "--nvme-seconds"));
  if (!(f.nvme_seconds >= 0.01 && f.nvme_seconds <= 600))
    return invalid_argument("--nvme-seconds = {}: use 10ms .. 600s", s.nvme_seconds);
  if (s.ranks < 1 || s.ranks > 65536) return invalid_argument("--ranks = {}: use 1 .. 65536", s.ranks);
  if (s.ranks_per_node > s.ranks) {
    return invalid_argument("--ranks-per-node = {} is more than --ranks = {}: give at most the ranks",
                            s.ranks_per_node, s.ranks);
  }
  if (s.verify && s.ranks > 1) {
    return invalid_argument(
        "--verify with --ranks {}: the verify run trains one process; drop --ranks (or --verify) to check a "
        "data-parallel plan",
        s.ranks);
  }
  if (s.verify_steps < 1 || s.verify_steps > kVerifyStepsMax)
    return invalid_argument("--verify-steps = {}: use 1 .. {}", s.verify_steps, kVerifyStepsMax);
  if (!s.verify_placement.empty()) {
    STRATA_RETURN_IF_ERROR(parse_placement(s.verify_placement).status().with_context("--verify-placement"));
  }
  if (!s.verify_params.empty())
    STRATA_RETURN_IF_ERROR(parse_count(s.verify_params, "--verify-params").status());
  STRATA_ASSIGN_OR_RETURN(f.device_budget, budget_flag("--device-budget", s.device_budget));
  STRATA_ASSIGN_OR_RETURN(f.host_budget, budget_flag("--host-budget", s.host_budget));
  if (!s.nvme.empty()) STRATA_RETURN_IF_ERROR(runtime::validate_nvme_dir(s.nvme, "--nvme"));
  return f;
}

// Long on purpose (issue #11's 80-line rule): the probe's measurements and
// report in the order they print, one block per section, sharing the
// measurements; split, a dozen locals would travel between the pieces.
int run(const Settings& s) {
  const auto start = Clock::now();
  auto flags = check_flags(s);
  if (!flags.ok()) return fail(flags.status());
  auto spec = model_spec(s);
  if (!spec.ok()) return fail(spec.status());
  const std::uint64_t link = flags->link;
  // The probe's swap files go straight into --nvme (Note [Stable scratch layout]);
  // a crashed run's are reported and reclaimed here, never read.
  std::optional<ScratchDir> nvme_dir;
  if (!s.nvme.empty()) {
    auto d = runtime::open_tool_nvme_dir(s.nvme, "--nvme", "");
    if (!d.ok()) return fail(d.status());
    nvme_dir = std::move(d).value();
  }
  const Progress progress = s.json ? Progress{} : progress_bar();

  auto host = measure_host();
  if (!host.ok()) return fail(host.status());
  std::optional<NvmeInfo> nvme;
  if (!s.nvme.empty()) {
    auto n = measure_nvme(s.nvme, flags->nvme_bytes, flags->nvme_seconds, progress);
    if (!n.ok()) return fail(n.status());
    nvme = *n;
  }
  memory::DeviceOptions dopt;
  if (Status st = dopt.set("kind", s.device); !st.ok()) return fail(st);
  dopt.h2d_bytes_per_s = link;
  dopt.d2h_bytes_per_s = link;
  dopt.budget_bytes = flags->device_budget.value_or(0);
  auto device = measure_device(dopt, 64 * kMiB, progress);
  if (!device.ok()) return fail(device.status());
  const std::size_t threads = host->cores;  // as the runtime's pool (Topology: cores of a node)
  auto cpu = measure_cpu_optimizer(flags->optimizer_params, threads, progress);
  if (!cpu.ok()) return fail(cpu.status());
  auto memory_rate = measure_host_memory(256 * kMiB, threads, progress);
  if (!memory_rate.ok()) return fail(memory_rate.status());

  Capacity cap;
  cap.gpu_bytes = device->budget_bytes;
  cap.host_bytes = host->ram_bytes / 4 * 3;
  if (flags->host_budget) cap.host_bytes = *flags->host_budget;
  if (nvme) cap.nvme_bytes = nvme->free_bytes / 10 * 9;
  // Data parallelism: the ranks on this node share its host RAM and NVMe; each
  // plans 1/ranks of the optimizer states (TrainSpec::ranks).
  const std::uint32_t ranks_per_node = s.ranks_per_node == 0 ? s.ranks : s.ranks_per_node;
  const Capacity node_cap = cap;
  cap = per_rank_capacity(node_cap, ranks_per_node);
  TrainSpec one_rank = *spec;
  one_rank.ranks = 1;
  // (the shape was checked by model_spec: these cannot fail)
  const std::uint64_t rank_bytes = rank_state_bytes(*spec).value(),
                      single_bytes = rank_state_bytes(one_rank).value();
  const bool sim = device->kind == "sim";
  // The all-gpu row only where the runtime runs optimizer steps on this device.
  spec->gpu_optimizer = runtime::gpu_optimizer_supported(
      sim ? memory::DeviceKind::kSim : memory::DeviceKind::kCuda, spec->optimizer);
  runtime::Rates rates;
  rates.h2d_bytes_per_s = device->h2d_bytes_per_s;
  rates.d2h_bytes_per_s = device->d2h_bytes_per_s;
  rates.cpu_optim_params_per_s = *cpu;
  rates.cpu_threads = static_cast<double>(threads);
  if (sim) rates.gpu_optim_params_per_s = *cpu;  // the sim device's "kernels" run on the host
  rates.host_memory_bytes_per_s = *memory_rate;
  rates.copy_host_passes = sim ? 2.0 : 1.0;  // the sim device copies with memcpy
  if (nvme) {
    rates.disk_read_bytes_per_s = nvme->read_bytes_per_s;
    rates.disk_write_bytes_per_s = nvme->write_bytes_per_s;
    rates.disk_mixed_bytes_per_s = nvme->mixed_bytes_per_s;
  } else {
    rates.disk_read_bytes_per_s = rates.disk_write_bytes_per_s = 0;
  }
  std::vector<Estimate> rows;
  for (Placement p : kPlacements) rows.push_back(estimate(*spec, p, cap, rates));
  const std::uint64_t model_params = shape_params(spec->shape).value();

  // What your model needs per placement: the least budgets that give the
  // placement (tight_budgets against unbounded capacities).
  struct Need {
    Placement placement;
    Result<runtime::Budgets> budgets;
  };
  std::vector<Need> needs;
  if (s.needs) {
    const Capacity unbounded{.gpu_bytes = 64 * kTiB, .host_bytes = 64 * kTiB, .nvme_bytes = 1024 * kTiB};
    for (Placement p : kPlacements) needs.push_back({p, tight_budgets(*spec, p, unbounded, rates, 0.0)});
  }

  std::optional<VerifyResult> checked;
  VerifyOptions vo;
  if (s.verify) {
    std::string pname =
        s.verify_placement.empty() ? (nvme ? "optim-nvme" : "params-optim-host") : s.verify_placement;
    auto placement = parse_placement(pname);
    if (!placement.ok()) return fail(placement.status().with_context("--verify-placement"));
    if (nvme_dir && (*placement == Placement::kOptimNvme || *placement == Placement::kAllNvme)) {
      vo.nvme_dir = nvme_dir->path().string();
    }
    const Estimate& row = rows[static_cast<std::size_t>(*placement)];
    if (!row.feasible && s.verify_params.empty()) {
      return fail(out_of_budget("--verify: placement {} cannot train any size here: {}", pname, row.why));
    }
    // Recommended size: the placement's largest, capped so a few steps take seconds here.
    constexpr std::uint64_t kVerifyParamsMax = 64'000'000;
    std::uint64_t n = std::min(row.max_params, kVerifyParamsMax);
    if (!s.verify_params.empty()) {
      auto v = parse_count(s.verify_params, "--verify-params");
      if (!v.ok()) return fail(v.status());
      n = *v;
    }
    vo.spec = *spec;
    auto vshape = shape_for_verify(n, s.seq, s.batch);
    if (!vshape.ok()) return fail(vshape.status());
    vo.spec.shape = *vshape;
    vo.placement = *placement;
    vo.capacity = cap;
    vo.rates = rates;
    if (!sim) {  // Note [Verify on the sim device]: its links are the throttle
      vo.rates.h2d_bytes_per_s = vo.rates.d2h_bytes_per_s = static_cast<double>(link);
      vo.rates.gpu_optim_params_per_s = *cpu;
      vo.rates.copy_host_passes = 2.0;
      vo.capacity.gpu_bytes = std::min<std::uint64_t>(cap.gpu_bytes, host->ram_bytes / 8);
    }
    vo.link_bytes_per_s = link;
    vo.host_memory_bytes = host->ram_bytes;  // Note [Verify host memory]
    vo.steps = s.verify_steps;
    if (const char* scale = std::getenv("STRATA_PROBE_TEST_PREDICTION_SCALE"); scale != nullptr) {
      vo.prediction_scale = std::strtod(scale, nullptr);
      if (!(vo.prediction_scale > 0)) {
        return fail(
            invalid_argument("STRATA_PROBE_TEST_PREDICTION_SCALE = \"{}\": give a positive number", scale));
      }
      std::fprintf(stderr,
                   "strata-probe: the verify prediction is scaled by %g (STRATA_PROBE_TEST_PREDICTION_SCALE, "
                   "for tests)\n",
                   vo.prediction_scale);
    }
    if (progress) progress("verify", 0.0);
    auto v = verify(vo);
    if (progress) progress("verify", 1.0);
    if (!v.ok()) return fail(v.status().with_context("--verify"));
    checked = *v;
  }
  const double elapsed_s = std::chrono::duration<double>(Clock::now() - start).count();

  nlohmann::json j;
  nlohmann::json gpus = nlohmann::json::array();
  if (!sim) {
    gpus.push_back({{"name", device->name},
                    {"memory_bytes", device->budget_bytes},
                    {"h2d_gib_s", gib(device->h2d_bytes_per_s)},
                    {"d2h_gib_s", gib(device->d2h_bytes_per_s)}});
  }
  j["machine"] = {
      {"cores", host->cores},
      {"numa_nodes", host->numa_nodes},
      {"ram_bytes", host->ram_bytes},
      {"memlock_bytes",
       host->memlock_bytes == UINT64_MAX ? nlohmann::json(nullptr) : nlohmann::json(host->memlock_bytes)},
      {"topology", host->topology},
      {"gpus", gpus},
      {"device",
       {{"kind", device->kind},
        {"name", device->name},
        {"why", device->why},
        {"budget_bytes", device->budget_bytes},
        {"h2d_gib_s", gib(device->h2d_bytes_per_s)},
        {"d2h_gib_s", gib(device->d2h_bytes_per_s)},
        {"throttled", device->throttled}}},
      {"nvme", nvme ? nlohmann::json{{"path", nvme->path},
                                     {"engine", nvme->engine},
                                     {"direct_io", nvme->direct_io},
                                     {"free_bytes", nvme->free_bytes},
                                     {"bytes_tested", nvme->bytes_tested},
                                     {"read_gib_s", gib(nvme->read_bytes_per_s)},
                                     {"write_gib_s", gib(nvme->write_bytes_per_s)},
                                     {"mixed_gib_s", gib(nvme->mixed_bytes_per_s)}}
                    : nlohmann::json(nullptr)},
      {"cpu_optimizer_mparams_per_s", *cpu / 1e6},
      {"cpu_optimizer_threads", threads},
      {"host_memory_gib_s", *memory_rate / static_cast<double>(kGiB)},
  };
  j["model"] = {{"params", model_params},
                {"layers", spec->shape.layers},
                {"hidden", spec->shape.hidden},
                {"seq", spec->shape.seq},
                {"batch", spec->shape.batch},
                {"vocab", spec->shape.vocab},
                {"optimizer", s.optimizer},
                {"precision", s.precision},
                {"state_dtype", s.state_dtype},
                {"device_tflops_assumed", s.tflops},
                {"state_bytes_per_param", state_bytes_per_param(*spec)}};
  j["capacity"] = {
      {"gpu_bytes", cap.gpu_bytes}, {"host_bytes", cap.host_bytes}, {"nvme_bytes", cap.nvme_bytes}};
  {
    j["data_parallel"] = {
        {"ranks", s.ranks},
        {"ranks_per_node", ranks_per_node},
        {"node_host_bytes", node_cap.host_bytes},
        {"node_nvme_bytes", node_cap.nvme_bytes},
        {"host_bytes_per_rank", cap.host_bytes},
        {"nvme_bytes_per_rank", cap.nvme_bytes},
        {"gpu_bytes_per_rank", cap.gpu_bytes},
        {"state_bytes_per_rank", rank_bytes},
        {"state_bytes_single_rank", single_bytes},
        {"note",
         "capacity and placements are per rank: each rank keeps its 1/ranks shard of every family's masters "
         "and optimizer states and whole params and gradients; the ranks_per_node ranks share this node's "
         "host RAM and NVMe, each has its own GPU"}};
  }
  j["placements"] = nlohmann::json::array();
  for (const Estimate& e : rows) {
    nlohmann::json row = {
        {"name", placement_name(e.placement)},
        {"feasible", e.feasible},
        {"max_params", e.max_params},
        {"max_params_is_lower_bound", e.capped},
        {"layers", e.layers},
        {"predicted_step_s", e.feasible ? nlohmann::json(e.cost.step_s) : nlohmann::json(nullptr)}};
    if (e.feasible) {
      row["bottleneck"] = e.cost.bottleneck;
      row["plan"] = e.plan.summary();
      std::uint64_t homes[3] = {0, 0, 0};  // families whose param lives on gpu / host / nvme
      for (const runtime::FamilyPlan& f : e.plan.families) ++homes[static_cast<int>(f.param_home)];
      row["param_home_families"] = {{"gpu", homes[0]}, {"host", homes[1]}, {"nvme", homes[2]}};
    } else {
      row["reason"] = e.reason;
      row["why"] = e.why;
    }
    if (e.placement == Placement::kAllNvme) row["note"] = kAllNvmeNote;
    j["placements"].push_back(row);
  }
  if (s.needs) {
    j["needs"] = nlohmann::json::array();
    for (const Need& n : needs) {
      nlohmann::json row = {{"name", placement_name(n.placement)}};
      if (n.budgets.ok()) {
        row["gpu_bytes"] = n.budgets->gpu_bytes;
        row["host_bytes"] = n.budgets->host_bytes;
        row["nvme_bytes"] = n.budgets->nvme_bytes;
      } else {
        row["why"] = n.budgets.status().message();
      }
      j["needs"].push_back(row);
    }
  }
  if (checked) {
    j["verify"] = {
        {"placement", placement_name(vo.placement)},
        {"params", checked->params},
        {"device", "sim (Note [Verify on the sim device])"},
        {"plan", checked->plan},
        {"plan_matches", checked->plan_matches},
        {"predicted_step_s", checked->predicted_s},
        {"runtime_predicted_step_s", checked->runtime_predicted_s},
        {"measured_step_s", checked->measured_s},
        {"ratio", checked->ratio},
        {"within_25_percent", checked->ratio > 1 - kVerifyTolerance && checked->ratio < 1 + kVerifyTolerance},
        {"passed", checked->passed()},
        {"budgets_held", checked->budgets_held},
        {"gpu_budget_bytes", checked->budgets.gpu_bytes},
        {"gpu_chunk_budget_bytes", checked->gpu_chunk_budget_bytes},
        {"gpu_high_water_bytes", checked->gpu_high_water_bytes},
        {"host_budget_bytes", checked->host_budget_bytes},
        {"host_high_water_bytes", checked->host_high_water_bytes},
        {"nvme_budget_bytes", checked->budgets.nvme_bytes},
        {"nvme_bytes", checked->nvme_bytes},
        {"tokens", checked->tokens},
        {"compute_gflops_measured", checked->compute_flops_per_s / 1e9}};
    nlohmann::json terms = nlohmann::json::array();
    for (const VerifyTerm& t : verify_terms(*checked)) {
      terms.push_back({{"name", t.name},
                       {"predicted_s", t.predicted_s},
                       {"measured_busy_s", t.measured_s},
                       {"predicted_bytes", t.predicted_bytes},
                       {"measured_bytes", t.measured_bytes}});
    }
    j["verify"]["terms"] = terms;
  }
  j["elapsed_s"] = elapsed_s;
  if (s.json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    fmt::print("strata-probe — this machine\n");
    fmt::print(
        "  host      {}; memlock {}\n",
        host_line(*host, node_cap.host_bytes,
                  flags->host_budget ? HostCapacitySource::kHostBudget : HostCapacitySource::kRamShare),
        host->memlock_bytes == UINT64_MAX ? "unlimited" : format_bytes(host->memlock_bytes));
    if (sim) {
      fmt::print("  GPU       none: {}\n", device->why);
      fmt::print(
          "            placements below are for the sim device: budget {}, copies {} at {:.1f} GiB/s h2d, "
          "{:.1f} GiB/s d2h\n",
          format_bytes(device->budget_bytes), device->throttled ? "throttled" : "memcpy",
          gib(device->h2d_bytes_per_s), gib(device->d2h_bytes_per_s));
    } else {
      fmt::print(
          "  GPU       {}: h2d {:.1f} GiB/s, d2h {:.1f} GiB/s (measured); optimizer rate assumed {:.0f} "
          "Gparams/s\n",
          device->name, gib(device->h2d_bytes_per_s), gib(device->d2h_bytes_per_s),
          rates.gpu_optim_params_per_s / 1e9);
    }
    if (nvme) {
      fmt::print(
          "  NVMe      {}: write {:.2f} GiB/s, read {:.2f} GiB/s ({} through SwapStore, {}, {}); {} free\n",
          nvme->path, gib(nvme->write_bytes_per_s), gib(nvme->read_bytes_per_s),
          format_bytes(nvme->bytes_tested), nvme->engine, nvme->direct_io ? "O_DIRECT" : "buffered",
          format_bytes(nvme->free_bytes));
    } else {
      fmt::print("  NVMe      not measured (give --nvme DIR)\n");
    }
    fmt::print("  CPU opt   {:.0f} Mparams/s (fp32 AdamW, {} threads)\n", *cpu / 1e6, threads);
    fmt::print("  memory    {:.1f} GiB/s of host memory traffic (parallel copy, read + write)\n",
               *memory_rate / static_cast<double>(kGiB));
    fmt::print(
        "\nModel: GPT-like, hidden {}, seq {}, batch {}, vocab {}; {} {} (states {}), {} B of state a "
        "param; device compute assumed {:.0f} TFLOP/s\n",
        spec->shape.hidden, spec->shape.seq, spec->shape.batch, spec->shape.vocab, s.optimizer, s.precision,
        s.state_dtype, state_bytes_per_param(*spec), s.tflops);
    fmt::print("Your model: {} params ({} layers). Capacity: gpu {}, host {}, nvme {}\n\n",
               format_count(model_params), spec->shape.layers, format_bytes(cap.gpu_bytes),
               format_bytes(cap.host_bytes), cap.nvme_bytes ? format_bytes(cap.nvme_bytes) : "none");
    if (s.ranks > 1) {
      fmt::print(
          "Data parallel: {} ranks, {} on this node sharing its host and NVMe: capacity and placements are "
          "per "
          "rank; each rank keeps {} of masters and optimizer states (one rank alone: {})\n\n",
          s.ranks, ranks_per_node, format_bytes(rank_bytes), format_bytes(single_bytes));
    }
    fmt::print("{:<20}{:>12}{:>9}{:>14}  {:<14}{}\n", "placement", "max params", "layers", "step (pred.)",
               "bottleneck", "fits your model");
    for (const Estimate& e : rows) {
      if (!e.feasible) {
        fmt::print("{:<20}{:>12}{:>9}{:>14}  {}\n", placement_name(e.placement), "-", "-", "-", e.reason);
        continue;
      }
      fmt::print("{:<20}{:>12}{:>9}{:>14}  {:<14}{}\n", placement_name(e.placement),
                 (e.capped ? ">= " : "") + format_count(e.max_params), e.layers,
                 fmt::format("{:.3f} s", e.cost.step_s), e.cost.bottleneck,
                 e.max_params >= model_params ? "yes" : "no");
    }
    fmt::print("(all-nvme: {})\n", kAllNvmeNote);
    if (s.verbose) {
      fmt::print("\nPer placement (--verbose):\n");
      for (const Estimate& e : rows) {
        fmt::print("  {:<18}  {}\n", placement_name(e.placement), e.feasible ? e.plan.summary() : e.why);
      }
    } else {
      fmt::print("(--verbose: each placement's plan, or the planner's full reason)\n");
    }
    if (s.needs) {
      fmt::print("\nWhat your model ({} params) needs per placement (least budgets the planner accepts):\n",
                 format_count(model_params));
      fmt::print("{:<20}{:>12}{:>12}{:>12}\n", "placement", "gpu", "host", "nvme");
      for (const Need& n : needs) {
        if (!n.budgets.ok()) {
          fmt::print("{:<20}  {}\n", placement_name(n.placement), n.budgets.status().message());
          continue;
        }
        fmt::print("{:<20}{:>12}{:>12}{:>12}\n", placement_name(n.placement),
                   format_bytes(n.budgets->gpu_bytes), format_bytes(n.budgets->host_bytes),
                   format_bytes(n.budgets->nvme_bytes));
      }
    }
    if (checked) {
      const auto& v = *checked;
      fmt::print(
          "\nverify ({}, {} params, sim device): measured {:.3f} s vs predicted {:.3f} s (ratio {:.2f}, {}); "
          "runtime's own prediction {:.3f} s\n",
          placement_name(vo.placement), format_count(v.params), v.measured_s, v.predicted_s, v.ratio,
          v.ratio > 1 - kVerifyTolerance && v.ratio < 1 + kVerifyTolerance ? "within 25%" : "OUTSIDE 25%",
          v.runtime_predicted_s);
      fmt::print(
          "  compute: real products over {} tokens at the {:.1f} GFLOP/s measured before the run (Note "
          "[Verify "
          "compute]); predicted bottleneck {} ({:.3f} s) + tail {:.3f} s\n",
          v.tokens, v.compute_flops_per_s / 1e9, v.predicted_cost.bottleneck, v.predicted_cost.bound_s,
          v.predicted_cost.tail_s);
      fmt::print("  {:<14}{:>12}{:>12}{:>8}{:>14}{:>14}\n", "term", "pred. s", "busy s", "ratio",
                 "pred. bytes", "bytes");
      for (const VerifyTerm& t : verify_terms(v)) {
        fmt::print("  {:<14}{:>12.3f}{:>12.3f}{:>8}{:>14}{:>14}\n", t.name, t.predicted_s, t.measured_s,
                   t.predicted_s > 0 ? fmt::format("{:.2f}", t.measured_s / t.predicted_s) : "-",
                   t.predicted_bytes + t.measured_bytes > 0 ? format_bytes(t.predicted_bytes) : "-",
                   t.predicted_bytes + t.measured_bytes > 0 ? format_bytes(t.measured_bytes) : "-");
      }
      if (s.verbose || !v.plan_matches) {
        fmt::print("  plan: {}{}\n", v.plan, v.plan_matches ? "" : "  (NOT the placement asked for)");
      }
      fmt::print(
          "  budgets {} (high water / budget): gpu chunks {} / {} (+ {} modelled activations), host {} / {}, "
          "nvme {} / {}\n",
          v.budgets_held ? "held" : "EXCEEDED", format_bytes(v.gpu_high_water_bytes),
          format_bytes(v.gpu_chunk_budget_bytes),
          format_bytes(v.budgets.gpu_bytes - v.gpu_chunk_budget_bytes), format_bytes(v.host_high_water_bytes),
          format_bytes(v.host_budget_bytes), format_bytes(v.nvme_bytes), format_bytes(v.budgets.nvme_bytes));
    }
    fmt::print("\n(probe took {:.1f} s)\n", elapsed_s);
  }
  if (checked && !checked->passed()) {
    // Note [Verify exit code]: 0 the check passed, 1 an error (nothing was
    // checked), 3 the check ran and failed — a ratio outside ±25 %, a budget
    // exceeded, or a plan other than the placement asked for.
    std::fprintf(stderr, "strata-probe: --verify failed: %s\n",
                 fmt::format("ratio {:.2f} (measured {:.3f} s / predicted {:.3f} s, must be within 1 ± "
                             "{:.2f}); budgets {}; plan {}",
                             checked->ratio, checked->measured_s, checked->predicted_s, kVerifyTolerance,
                             checked->budgets_held ? "held" : "EXCEEDED",
                             checked->plan_matches ? "as asked" : "NOT the placement asked for")
                     .c_str());
    return 3;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata-probe: measure this machine and predict how large a model it trains, and how fast"};
  Settings s;
  app.add_option("--nvme", s.nvme, "directory on the NVMe drive to measure and plan with");
  app.add_flag("--json", s.json, "print one JSON object");
  app.add_option("--params", s.params, "model size, e.g. 1.3B (default 1.3B unless a shape is given)");
  CLI::Option* layers_opt = app.add_option("--layers", s.layers, "GPT shape: layers");
  CLI::Option* hidden_opt = app.add_option("--hidden", s.hidden, "GPT shape: hidden size");
  app.add_option("--seq", s.seq, "sequence length")->capture_default_str();
  app.add_option("--batch", s.batch, "micro-batch size")->capture_default_str();
  app.add_option("--vocab", s.vocab, "vocabulary size")->capture_default_str();
  app.add_option("--optimizer", s.optimizer, "adamw, adam, lamb, lars, sgd, lion, adagrad")
      ->capture_default_str();
  app.add_option("--precision", s.precision, "compute dtype: fp32, bf16, fp16")->capture_default_str();
  app.add_option("--state-dtype", s.state_dtype, "optimizer state dtype: fp32, bf16")->capture_default_str();
  app.add_option("--device", s.device, "auto, sim or cuda")->capture_default_str();
  app.add_option("--device-budget", s.device_budget,
                 "device memory to plan with (auto: sim 4GiB, cuda: free)")
      ->capture_default_str();
  app.add_option("--host-budget", s.host_budget, "host memory to plan with (auto: 3/4 of RAM)")
      ->capture_default_str();
  app.add_option("--link", s.link, "sim copy throttle per direction, per second")->capture_default_str();
  app.add_option("--tflops", s.tflops, "sustained device compute, TFLOP/s (assumed, not measured)")
      ->capture_default_str();
  app.add_option("--nvme-bytes", s.nvme_bytes, "NVMe test size at most")->capture_default_str();
  app.add_option("--nvme-seconds", s.nvme_seconds, "NVMe test time per pass at most (e.g. 3s, 500ms)")
      ->capture_default_str();
  app.add_option("--optimizer-params", s.optimizer_params, "CPU optimizer test size")->capture_default_str();
  app.add_flag("--verify", s.verify,
               "train a few steps of a synthetic model and compare with the prediction; exit 3 when "
               "measured/predicted is outside 1 +- 0.25 or a budget was exceeded");
  app.add_option("--verify-placement", s.verify_placement,
                 "placement to verify (default optim-nvme with --nvme)");
  app.add_option("--verify-params", s.verify_params, "size to verify (default: recommended, at most 64M)");
  app.add_option("--verify-steps", s.verify_steps, "timed steps")->capture_default_str();
  app.add_option("--ranks", s.ranks, "data-parallel ranks: plan one rank's share of the states")
      ->capture_default_str();
  app.add_option("--ranks-per-node", s.ranks_per_node,
                 "ranks sharing this machine's host RAM and NVMe (default: all --ranks)");
  app.add_flag("--verbose", s.verbose, "also print each placement's plan (or the planner's full reason)");
  app.add_flag("--needs", s.needs,
               "also print the least gpu/host/nvme budgets your model needs per placement");
  // One line on a bad command line, as every other refusal (the fuzz test checks it).
  app.failure_message([](const CLI::App*, const CLI::Error& e) {
    return fmt::format("strata-probe: {} (see --help)\n", e.what());
  });
  CLI11_PARSE(app, argc, argv);
  s.layers_given = layers_opt->count() > 0;
  s.hidden_given = hidden_opt->count() > 0;
  // The probe prints what ran (device and why, I/O engine, O_DIRECT); the log's
  // info lines would repeat it, so it shows warnings unless STRATA_LOG_LEVEL asks.
  if (std::getenv("STRATA_LOG_LEVEL") == nullptr) strata::set_log_level("warn");
  return run(s);
}
