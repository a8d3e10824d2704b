// strata-probe's command line: the options, and every flag checked before
// anything is measured (cli.hpp).
#include "cli.hpp"

#include <CLI/CLI.hpp>
#include <cstdlib>

#include "measure.hpp"
#include "runtime_spec.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/duration.hpp"
#include "strata/common/log.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/options.hpp"
#include "verify.hpp"

namespace strata::probe {
namespace {

// The probe sizes every optimizer but CAME, which the chunk runtime refuses.
Result<kernels::Optimizer> parse_optimizer(std::string_view name) {
  auto o = kernels::parse_optimizer(name);
  if (!o.ok() || *o == kernels::Optimizer::kCame)
    return invalid_argument("--optimizer \"{}\": use adamw, adam, lamb, lars, sgd, lion or adagrad", name);
  return o;
}

// A size flag that may be "auto"; 0 (like any size too small to mean anything) is an error.
Result<std::optional<std::uint64_t>> budget_flag(std::string_view flag, const std::string& text) {
  if (text == "auto") return std::optional<std::uint64_t>{};
  STRATA_ASSIGN_OR_RETURN(std::uint64_t bytes, parse_bytes(text, flag));
  if (bytes < kMiB) return invalid_argument("{} = {}: give at least 1MiB, or auto", flag, text);
  return std::optional<std::uint64_t>{bytes};
}

}  // namespace

Result<TrainSpec> model_spec(const Settings& s) {
  TrainSpec spec;
  STRATA_ASSIGN_OR_RETURN(spec.optimizer, parse_optimizer(s.optimizer));
  auto compute = runtime::parse_dtype(s.precision);
  if (!compute.ok() || *compute == runtime::DType::kQ8)
    return invalid_argument("--precision \"{}\": use fp32, bf16 or fp16", s.precision);
  spec.compute_dtype = *compute;
  auto states = runtime::parse_dtype(s.state_dtype);
  if (!states.ok())
    return invalid_argument("--state-dtype \"{}\": use fp32, bf16 or q8 (q8: adamw and adam)", s.state_dtype);
  spec.state_dtype = *states;
  // From 0.01: the sim device computes on the host CPU, at tens of GFLOP/s (docs/scale.md).
  if (!(s.tflops >= 0.01 && s.tflops <= 1e6))
    return invalid_argument("--tflops = {}: use 0.01 .. 1e6", s.tflops);
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
  spec.deferred_updates = s.deferred_updates;
  if (!s.chunk_elems.empty()) {
    STRATA_ASSIGN_OR_RETURN(spec.chunk_elems, parse_count(s.chunk_elems, "--chunk-elems"));
    // The larger of a layer and the embedding: both are split alike (Note [Probe chunk size]).
    const std::uint64_t largest =
        std::max(12 * spec.shape.hidden * spec.shape.hidden, spec.shape.vocab * spec.shape.hidden);
    const std::uint64_t k = families_of(spec, largest);
    if (k > kFamiliesPerLayerMax) {
      return invalid_argument(
          "--chunk-elems {} splits {} elements (a layer, or the embedding) into {} chunk families; the probe "
          "plans at most {} a layer (Note [Probe chunk size]): give at least {}",
          s.chunk_elems, format_count(largest), k, kFamiliesPerLayerMax,
          format_count((largest + kFamiliesPerLayerMax - 1) / kFamiliesPerLayerMax));
    }
  }
  STRATA_RETURN_IF_ERROR(check_supported(spec));
  return spec;
}

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

int cli_main(int argc, char** argv) {
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
  app.add_option("--state-dtype,--states", s.state_dtype,
                 "optimizer state dtype: fp32, bf16, q8 (8-bit adamw/adam states)")
      ->capture_default_str();
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
  app.add_option("--chunk-elems", s.chunk_elems,
                 "the runtime's chunk size in elements, as a trainer's layout search chose it (e.g. 26M): "
                 "layers split into families of at most this size (default: one family per layer)");
  app.add_option("--deferred-updates", s.deferred_updates,
                 "the trainer's plan.deferred_updates: NVMe families whose update runs in the next forward")
      ->check(CLI::Range(0u, runtime::kDeferredUpdatesMax));
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

}  // namespace strata::probe
