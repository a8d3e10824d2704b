#pragma once
// strata-contract: training one drawn model through strata::Runtime on the sim
// device, and the checks of one run (Note [Contract run] in contract_train.cpp).

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "contract_draw.hpp"

namespace strata::contract {

//! Where a run is: each call names the phase it enters (the parent shows the last
//! one when the run hangs or crashes).
using PhaseFn = std::function<void(const std::string&)>;

//! Test hooks that make a run fail on purpose, so the checks are seen to fail.
enum class Inject { kNone, kInexact, kHang, kCrash, kAbovePlan, kOverrun };

//! What one run found (one JSON object, sent to the parent through a pipe).
struct RunReport {
  std::uint64_t seed = 0;
  //! "refused" (at creation, with `reason`), "trained", "failed" (an error after
  //! acceptance), "bad_refusal" (a refusal without a message, or one whose suggested
  //! minimum is refused again for the same budget).
  std::string outcome;
  std::string reason;  //!< one line: the refusal or error message, or what a check found
  std::string phase;   //!< where an error happened
  bool budget_overrun = false, above_plan = false, inexact = false;
  std::string overrun_reason, above_plan_reason, inexact_reason;
  nlohmann::json details;  //!< budgets, sizes, plan, high waters
};

//! Runs the whole of run `d`: sizes the model, draws budgets, trains it under them
//! (seeking the suggested minimum when drawn so), then the all-resident reference,
//! and compares. `nvme_dir` exists and is empty. Never throws.
RunReport execute_run(const Draw& d, const std::string& nvme_dir, const PhaseFn& phase, Inject inject);

nlohmann::json to_json(const RunReport& r);

}  // namespace strata::contract
