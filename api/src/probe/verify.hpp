#pragma once
// strata-probe --verify: trains a synthetic GPT-like model through the chunk
// runtime on the sim device, with the budgets the probe's plan was made for
// (probe::tight_budgets), and compares the measured steady step with the
// predicted one.
//
// Note [Verify on the sim device]
// The model's forward and backward are timed kernels on the sim device's compute
// stream (each layer sleeps for its FLOPs at the stated device rate and writes a
// gradient), exactly as `strata-bench step` does; the copies (throttled to the
// stated link rate), the CPU optimizer and the NVMe I/O are real work. A CUDA
// verify would need device kernels for the synthetic layers; it is not built, so
// --verify runs on the sim device on every machine and says so.

#include <cstdint>
#include <string>

#include "model.hpp"
#include "strata/common/status.hpp"
#include "strata/runtime/cost_model.hpp"

namespace strata::probe {

//! Bound on --verify-steps.
inline constexpr int kVerifyStepsMax = 1000;
//! The check passes when measured / predicted is within 1 ± this and every
//! budget held (strata-probe exits 3 otherwise).
inline constexpr double kVerifyTolerance = 0.25;
//! Bound on the modelled compute of one verify step, seconds.
inline constexpr double kVerifyStepSecondsMax = 60.0;

//! What --verify runs.
struct VerifyOptions {
  TrainSpec spec;  //!< model (its own layer count), optimizer, dtypes, compute rate
  Placement placement = Placement::kOptimNvme;
  Capacity capacity;                   //!< where the budgets are cut from (host RAM share, NVMe free space)
  runtime::Rates rates;                //!< measured rates the prediction uses
  std::uint64_t link_bytes_per_s = 0;  //!< sim copy throttle per direction
  std::string nvme_dir;                //!< empty: no NVMe tier
  int warmup_steps = 2;                //!< step 1 traces, step 2 adopts the plan
  int steps = 3;                       //!< timed steps (median), 1 .. kVerifyStepsMax
  //! Test-only: the prediction is multiplied by this (strata-probe reads it from
  //! STRATA_PROBE_TEST_PREDICTION_SCALE and says so), so a test can make the
  //! check fail on purpose. 1 otherwise.
  double prediction_scale = 1.0;
};

//! What --verify found.
struct VerifyResult {
  std::uint64_t params = 0;
  runtime::Budgets budgets;                  //!< the probe's (gpu includes the modelled activations)
  std::uint64_t gpu_chunk_budget_bytes = 0;  //!< what the runtime got: budgets.gpu - activations
  std::uint64_t host_budget_bytes = 0;       //!< what the runtime got: budgets.host + its reserve
  std::string plan;                          //!< Plan::summary() of the plan the runtime ran
  bool plan_matches = false;                 //!< the runtime's plan is the placement asked for
  double predicted_s = 0;                    //!< the probe's prediction
  double runtime_predicted_s = 0;            //!< the runtime's own prediction from its traced step
  double measured_s = 0;                     //!< median steady step
  double ratio = 0;                          //!< measured / predicted
  std::string bottleneck;
  std::uint64_t gpu_high_water_bytes = 0, host_high_water_bytes = 0, nvme_bytes = 0;
  bool budgets_held = false;
  //! The check: ratio within 1 ± kVerifyTolerance, budgets held, the plan is the placement asked for.
  bool passed() const {
    return ratio > 1 - kVerifyTolerance && ratio < 1 + kVerifyTolerance && budgets_held && plan_matches;
  }
};

//! Runs the verification. Fails with InvalidArgument (steps out of range),
//! OutOfBudget (the size does not fit the placement: the message gives the
//! largest that does), or the runtime's Status. Its swap files go straight into
//! options.nvme_dir and are removed when it returns, with or without an error.
Result<VerifyResult> verify(const VerifyOptions& options);

}  // namespace strata::probe
