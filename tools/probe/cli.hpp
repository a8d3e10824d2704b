#pragma once
// strata-probe's command line: the settings as parsed, every flag checked before
// anything is measured, and the run they drive (run.cpp). main.cpp calls cli_main.

#include <cstdint>
#include <optional>
#include <string>

#include "model.hpp"
#include "strata/common/status.hpp"

namespace strata::probe {

//! The command line as given (CLI11 fills it; nothing is checked yet).
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
  std::uint32_t ranks = 1;             // data-parallel ranks (Note [Sharded step])
  std::uint32_t ranks_per_node = 0;    // ranks sharing this machine's host RAM and NVMe (0: all of them)
  std::string chunk_elems;             // the runtime's chunk size in elements (empty: a family per layer)
  std::uint32_t deferred_updates = 0;  // the trainer's plan.deferred_updates
};

//! The flags' values once checked (Note [One validation per input kind] in
//! runtime/options.hpp): a bad flag fails in milliseconds, naming itself.
struct Flags {
  std::uint64_t link = 0, nvme_bytes = 0, optimizer_params = 0;
  double nvme_seconds = 0;
  std::optional<std::uint64_t> device_budget, host_budget;
};

//! Checks every flag but the model's; InvalidArgument (or the NVMe directory's
//! error) naming the flag, its value and what is allowed. Measures nothing.
Result<Flags> check_flags(const Settings& s);
//! The model to plan from --params or --layers/--hidden and the dtype, optimizer
//! and compute flags; InvalidArgument naming the flag.
Result<TrainSpec> model_spec(const Settings& s);

//! Measures, plans and prints (run.cpp). Exit code: 0, 1 on an error (printed as
//! one "strata-probe: ..." line), 3 when --verify ran and failed (Note [Verify exit code]).
int run(const Settings& s);
//! Parses the command line (one line on a bad one) and runs; strata-probe's main.
int cli_main(int argc, char** argv);

}  // namespace strata::probe
