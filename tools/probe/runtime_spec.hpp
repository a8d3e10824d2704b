#pragma once
// What the runtime makes of a TrainSpec: the RuntimeOptions a run of it gets and
// whether Runtime::create accepts them. The runtime's side of the probe, with
// --verify (verify.*) and the run (run.*): the model and the estimates
// (model.*, estimate.cpp, measure*) link strata_plan without strata_runtime.

#include "model.hpp"
#include "strata/common/status.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::probe {

//! The runtime settings a run of `spec` gets: compute and state dtypes, the
//! optimizer with its defaults (SGD with momentum 0.9, as --verify trains it).
//! Budgets are nominal (1 GiB each) and there is no NVMe tier: the caller sets them.
runtime::RuntimeOptions runtime_options(const TrainSpec& spec);

//! What Runtime::create would say about `spec`'s combination of optimizer and
//! dtypes (runtime::validate_options), naming the flags: the probe never plans
//! what the runtime refuses (SGD with bf16 states, fp16 states, ...).
Status check_supported(const TrainSpec& spec);

}  // namespace strata::probe
