#pragma once
// strata-bench step's runs: its flags checked, one run of the synthetic model on the
// sim device (Note [Sim compute in the step benchmark] in step_run.cpp) and the lower
// bound of its median step (Note [Rates lower bound]). bench_step.cpp runs them and
// reports.

#include <cstdint>
#include <string>
#include <vector>

#include "step_checkpoint.hpp"
#include "step_rates.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/common/status.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::bench::step {

//! `strata-bench step`'s command line.
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

//! One run's median steady step, its lower bound and the bound's breakdown.
struct RunResult {
  double step_s = 0, bound_s = 0;
  runtime::StepStats stats;
  std::string bottleneck;
  std::vector<Resource> resources;  //!< Note [Rates lower bound]
  PeakRates peaks;
  double timeline_busiest_s = 0;        //!< the busiest track of the timeline (information)
  std::uint64_t params_nvme_bytes = 0;  //!< fp32 params the plan homes on NVMe
};

// The flags, checked before anything runs (Note [One validation per input kind]
// in runtime/options.hpp). The runtime's own settings are checked by
// runtime::validate_options when run_once creates it, with the same messages.
struct Checked {
  std::uint64_t states = 0, gpu = 0, host = 0, link = 0;
  std::uint64_t per_layer = 0;  // params a layer (one chunk family each)
};

//! The flags' values, or a refusal naming the flag and what to use.
Result<Checked> check(const StepOptions& o);

//! One run: peaks measured on a fresh sim device, then --steps steady steps (two
//! more first: one traces, one adopts the plan), then, with `overlap`, its steps with
//! a save in flight; the median steady step and its bound. Blocks; writes swap files
//! (and the trace, when trace_path is not empty) under dir.
Result<RunResult> run_once(const StepOptions& o, const Checked& c, const ScratchDir& dir, bool prefetch,
                           const std::string& trace_path, CheckpointOverlap* overlap = nullptr);

}  // namespace strata::bench::step
