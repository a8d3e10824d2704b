// strata-bench step: a synthetic model trained by the chunk runtime on the sim
// device, against a lower bound from each resource's work and its peak rate,
// measured in the same run before the step (Note [Rates lower bound]).// The runs themselves, and how the sim
// device models compute: step_run.cpp.
#include <nlohmann/json.hpp>
#include <optional>

#include "registry.hpp"
#include "step_checkpoint.hpp"
#include "step_exact.hpp"
#include "step_run.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/runtime/options.hpp"

namespace strata::bench {
namespace {

using step::Checked;
using step::Resource;
using step::RunResult;
using step::StepOptions;

//! Every run's figures, and the last run (whose breakdown is reported).
struct Runs {
  std::vector<double> step_s, bound_s, ratio, no_prefetch_s;
  nlohmann::json per_run = nlohmann::json::array();
  RunResult last;
};

//! --runs runs with prefetch and without, into runs; false (having said why) when one fails.
bool run_all(const StepOptions& o, const Checked& checked, const ScratchDir& dir, CheckpointOverlap& overlap,
             Runs& runs) {
  for (int i = 0; i < o.runs; ++i) {
    // The first run also measures checkpoint_overlap_slowdown, after its steady steps.
    auto with = step::run_once(o, checked, dir, true, i == 0 ? o.trace : "", i == 0 ? &overlap : nullptr);
    if (!with.ok()) {
      fmt::print(stderr, "strata-bench step: {}\n", with.status().to_string());
      return false;
    }
    auto without = step::run_once(o, checked, dir, false, "");
    if (!without.ok()) {
      fmt::print(stderr, "strata-bench step (no prefetch): {}\n", without.status().to_string());
      return false;
    }
    runs.step_s.push_back(with->step_s);
    runs.bound_s.push_back(with->bound_s);
    runs.ratio.push_back(with->step_s / with->bound_s);
    runs.per_run.push_back({{"step_s", with->step_s},
                            {"bound_s", with->bound_s},
                            {"ratio", with->step_s / with->bound_s},
                            {"bottleneck", with->bottleneck},
                            {"no_prefetch_step_s", without->step_s}});
    runs.no_prefetch_s.push_back(without->step_s);
    runs.last = *with;
    if (!o.json) {
      fmt::print(stderr, "run {}: step {:.3f} s, bound {:.3f} s ({}), ratio {:.3f}; no prefetch {:.3f} s\n",
                 i + 1, with->step_s, with->bound_s, with->bottleneck, with->step_s / with->bound_s,
                 without->step_s);
    }
  }
  return true;
}

//! checkpoint_overlap's object: Note [Checkpoint overlap in the step benchmark].
nlohmann::json overlap_json(const CheckpointOverlap& overlap, int steps) {
  return {{"step_with_save_s", overlap.with_save_s()},
          {"step_with_save_worst_s", overlap.worst_with_save_s()},
          {"step_without_save_s", overlap.without_save_s()},
          {"first_step_slowdown", overlap.first_step_slowdown()},
          {"steps_with_save", overlap.steps_with_save()},
          {"saves", CheckpointOverlap::kSaves},
          {"save_s", overlap.save_s()},
          {"begin_checkpoint_s", overlap.begin_s()},
          {"checkpoint_bytes", overlap.checkpoint_bytes()},
          {"steps_between_saves", steps},
          {"how",
           "first run, after its steady steps: each save is begun just before a step (begin_checkpoint "
           "counted); "
           "every step begun while it is in flight counts as with; --steps steps without follow each save; "
           "mean of all with-steps over median of without-steps"}};
}

//! bit_identical_check's object: the check's figures, or why it was skipped.
nlohmann::json exact_json(const std::optional<ExactResult>& exact, const std::string& exact_skipped) {
  return exact ? nlohmann::json{{"layers", exact->layers},
                                {"host_budget_bytes", exact->host_budget_bytes},
                                {"params_nvme_bytes", exact->params_nvme_bytes},
                                {"steps", exact->steps},
                                {"first_difference", exact->first_difference}}
               : nlohmann::json{{"skipped", exact_skipped}};
}

//! The bench's JSON object (the text output prints from it too).
nlohmann::json report(const StepOptions& o, const Checked& checked, const Runs& runs,
                      const CheckpointOverlap& overlap, const std::optional<ExactResult>& exact,
                      const std::string& exact_skipped) {
  const RunResult& last = runs.last;
  const auto& st = last.stats;
  nlohmann::json j = {
      {"backend", "sim"},
      {"compute",
       fmt::format("timed kernels at {:.1f} TFLOP/s, {} tokens per step", o.flops / 1e12, o.tokens)},
      {"states", o.states},
      {"layers", o.layers},
      {"step_s", median(runs.step_s)},
      {"bound_source", "rates"},
      {"bound_s", median(runs.bound_s)},
      {"ratio", median(runs.ratio)},
      {"bottleneck", last.bottleneck},
      {"timeline_busiest_s", last.timeline_busiest_s},
      {"no_prefetch_step_s", median(runs.no_prefetch_s)},
      {"prefetch_speedup", median(runs.no_prefetch_s) / median(runs.step_s)},
      {"checkpoint_overlap_slowdown", overlap.slowdown()},
      {"checkpoint_overlap", overlap_json(overlap, o.steps)},
      {"bytes_h2d", st.bytes_h2d},
      {"bytes_d2h", st.bytes_d2h},
      {"bytes_disk_read", st.bytes_disk_read},
      {"bytes_disk_write", st.bytes_disk_write},
      {"stall_s", st.stall_s},
      {"gpu_high_water_bytes", st.gpu_high_water_bytes},
      {"host_high_water_bytes", st.host_high_water_bytes},
      {"state_bytes", checked.states},
      {"params_nvme_bytes", last.params_nvme_bytes},
      {"gpu_budget_bytes", checked.gpu},
      {"host_budget_bytes", checked.host},
      {"bit_identical_to_host", exact ? nlohmann::json(exact->identical) : nlohmann::json(nullptr)},
      {"bit_identical_check", exact_json(exact, exact_skipped)},
      {"busy_s", nlohmann::json::object()},
      {"runs", o.runs},
      {"per_run", runs.per_run},
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
  return j;
}

//! The bench's text: the medians, the last run's bytes and budgets, and its bound per resource.
void print_text(const StepOptions& o, const Checked& checked, const Runs& runs,
                const CheckpointOverlap& overlap, const std::optional<ExactResult>& exact,
                const std::string& exact_skipped, const ScratchDir& dir, const nlohmann::json& j) {
  const RunResult& last = runs.last;
  const auto& st = last.stats;
  const std::uint64_t gpu = checked.gpu, host = checked.host;
  fmt::print(
      "strata-bench step — sim device; compute modelled as timed kernels ({}); copies throttled to {}/s "
      "each way; real CPU optimizer (AdamW) and NVMe I/O in {}\n",
      j["compute"].get<std::string>(), o.link, dir.path().string());
  fmt::print("{:<28}{:>14}\n", "step time (median)", fmt::format("{:.3f} s", median(runs.step_s)));
  fmt::print("{:<28}{:>14}\n", "lower bound (rates)",
             fmt::format("{:.3f} s ({})", median(runs.bound_s), last.bottleneck));
  fmt::print("{:<28}{:>14}\n", "ratio", fmt::format("{:.3f}", median(runs.ratio)));
  fmt::print("{:<28}{:>14}\n", "without prefetch", fmt::format("{:.3f} s", median(runs.no_prefetch_s)));
  fmt::print("{:<28}{:>14}\n", "save in flight slowdown",
             fmt::format("{:.3f} ({:.3f} / {:.3f} s)", overlap.slowdown(), overlap.with_save_s(),
                         overlap.without_save_s()));
  fmt::print("{:<28}{:>14}\n", "bytes h2d / d2h",
             fmt::format("{} / {}", format_bytes(st.bytes_h2d), format_bytes(st.bytes_d2h)));
  fmt::print("{:<28}{:>14}\n", "bytes disk read / write",
             fmt::format("{} / {}", format_bytes(st.bytes_disk_read), format_bytes(st.bytes_disk_write)));
  fmt::print("{:<28}{:>14}\n", "gpu high water / budget",
             fmt::format("{} / {}", format_bytes(st.gpu_high_water_bytes), format_bytes(gpu)));
  fmt::print("{:<28}{:>14}\n", "host high water / budget",
             fmt::format("{} / {}", format_bytes(st.host_high_water_bytes), format_bytes(host)));
  fmt::print("{:<28}{:>14}\n", "bit-identical to host",
             exact
                 ? fmt::format("{} ({} layers, host_budget {}, {} params on NVMe, {} steps){}",
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

//! Note [Exactness in the step benchmark], in the same run: only when this model's
//! params spill to NVMe (otherwise there is nothing NVMe-homed to compare).
//! nullopt in *exact when skipped; false (having said why) when the check fails to run.
bool check_exact(const StepOptions& o, const Checked& checked, const ScratchDir& dir, const RunResult& last,
                 std::optional<ExactResult>* exact) {
  if (last.params_nvme_bytes == 0) return true;
  auto checked_exact = check_bit_identical({.layers = o.layers,
                                            .params_per_layer = checked.per_layer,
                                            .host_budget_bytes = checked.host,
                                            .gpu_budget_bytes = checked.gpu},
                                           dir.path());
  if (!checked_exact.ok()) {
    fmt::print(stderr, "strata-bench step (exactness check): {}\n", checked_exact.status().to_string());
    return false;
  }
  *exact = std::move(checked_exact).value();
  return true;
}

int run(const StepOptions& o) {
  auto checked = step::check(o);
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
  auto overlap = CheckpointOverlap::create();
  if (!overlap.ok()) {
    fmt::print(stderr, "strata-bench step: {}\n", overlap.status().to_string());
    return 1;
  }
  Runs runs;
  if (!run_all(o, *checked, *dir, **overlap, runs)) return 1;
  std::optional<ExactResult> exact;
  if (!check_exact(o, *checked, *dir, runs.last, &exact)) return 1;
  const std::string exact_skipped = fmt::format(
      "not checked: every param fits in host_budget {}, none lives on NVMe", format_bytes(checked->host));
  const nlohmann::json j = report(o, *checked, runs, **overlap, exact, exact_skipped);
  if (o.json) {
    fmt::print("{}\n", j.dump(2));
  } else {
    print_text(o, *checked, runs, **overlap, exact, exact_skipped, *dir, j);
  }
  const auto& st = runs.last.stats;
  const bool budgets_held =
      st.gpu_high_water_bytes <= checked->gpu && st.host_high_water_bytes <= checked->host;
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
