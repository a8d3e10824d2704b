#pragma once
// strata-probe's run, private to run.cpp and output.cpp: what the probe measured
// (Machine), what it planned from it (Planned) and the --verify run (Verified),
// handed from the measuring steps to the two printers (JSON and text).

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "cli.hpp"
#include "measure.hpp"
#include "model.hpp"
#include "strata/common/scratch_dir.hpp"
#include "verify.hpp"

namespace strata::probe {

//! What was measured on this machine.
struct Machine {
  HostInfo host;
  std::optional<NvmeInfo> nvme;
  DeviceInfo device;
  //! What the one rate measurer measured (Note [One rate measurer] in
  //! rate_measurer.hpp): copies, the CPU optimizer, host memory, and the disk's
  //! rates with --nvme (without it, their defaults: measured_rates in run.cpp zeroes them).
  runtime::Rates rates;
  std::size_t threads = 0;             //!< the CPU optimizer's threads (the host's cores)
  bool sim = false;                    //!< the device is the sim device
  std::optional<ScratchDir> nvme_dir;  //!< --nvme, opened for the probe's swap files
};

//! The least budgets that give a placement for the caller's model (--needs).
struct Need {
  Placement placement;
  Result<runtime::Budgets> budgets;
};

//! The placements planned from the measurements.
struct Planned {
  TrainSpec spec;
  Capacity cap;       //!< one rank's capacity
  Capacity node_cap;  //!< this node's, shared by ranks_per_node ranks
  std::uint32_t ranks_per_node = 1;
  std::uint64_t rank_bytes = 0, single_bytes = 0;  //!< state bytes of one rank, and of a single rank alone
  std::uint64_t model_params = 0;
  runtime::Rates rates;
  std::vector<Estimate> rows;  //!< one per placement, in kPlacements order
  //! Per placement (kPlacements order): the caller's model's own predicted step, or
  //! none where it does not fit that placement.
  std::vector<std::optional<runtime::StepCost>> yours;
  std::vector<Need> needs;  //!< empty without --needs
};

//! The --verify run, when asked for.
struct Verified {
  VerifyOptions options;
  std::optional<VerifyResult> result;
};

//! The placement the caller's model trains fastest with (the least predicted step of
//! Planned::yours), or none where it fits no placement.
std::optional<Placement> fastest_for_model(const Planned& p);

//! The all-nvme row's note, printed in both outputs.
inline constexpr const char* kAllNvmeNote =
    "params that do not fit on host live on NVMe with their optimizer states, read ahead through a "
    "bounded pool of staging buffers counted in the host budget";

//! The report as one JSON object on stdout (--json).
void print_json(const Settings& s, const Flags& f, const Machine& m, const Planned& p, const Verified& v,
                double elapsed_s);
//! The report as text on stdout.
void print_text(const Settings& s, const Flags& f, const Machine& m, const Planned& p, const Verified& v,
                double elapsed_s);

}  // namespace strata::probe
