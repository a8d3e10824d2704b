#pragma once
// strata-bench step's exactness check: a smaller copy of the step's model trained
// all on host and with params and states on NVMe, compared byte for byte
// (Note [Exactness in the step benchmark] in step_exact.cpp).

#include <cstdint>
#include <filesystem>
#include <string>

#include "strata/common/status.hpp"

namespace strata::bench {

//! The model the step benchmark trains: `layers` layers of `params_per_layer` fp32
//! params (one chunk family each) under a host budget.
struct StepModel {
  std::size_t layers = 0;
  std::uint64_t params_per_layer = 0;
  std::uint64_t host_budget_bytes = 0;
  std::uint64_t gpu_budget_bytes = 0;
};

//! What the check trained and found.
struct ExactResult {
  bool identical = false;
  std::size_t layers = 0;               //!< the smaller copy's layers
  std::uint64_t host_budget_bytes = 0;  //!< its NVMe run's host budget
  std::uint64_t params_nvme_bytes = 0;  //!< params its NVMe run homed on NVMe (> 0)
  int steps = 0;                        //!< steps each run trained
  std::string first_difference;         //!< "layer 3 exp_avg byte 128", empty when identical
};

//! The smaller copy of `full` the check trains: the same layer shape, fewer layers,
//! and the host budget scaled with them (at least the NVMe pipeline's staging and one
//! param), so that its params still spill to NVMe.
StepModel exact_check_model(const StepModel& full);

//! Trains exact_check_model(full) twice on fresh sim devices, all on host and with
//! params and states on NVMe in `dir`, and compares every layer's param and optimizer
//! states. Blocks; takes about twice the smaller copy's state in host memory. Fails
//! (Status of the runtime) when either run fails, and FailedPrecondition when the NVMe
//! run's plan homes no param on NVMe (the check would not test what it claims).
Result<ExactResult> check_bit_identical(const StepModel& full, const std::filesystem::path& dir);

}  // namespace strata::bench
