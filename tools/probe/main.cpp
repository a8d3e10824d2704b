// strata-probe: measures this machine, then tells for each placement how large a
// model it can train and how fast, from the runtime's planner and cost model
// (Note [Probe placements] in model.hpp). --verify trains a synthetic model to
// check the prediction (Note [Verify on the sim device] in verify.hpp). The probe
// is the strata_probe library (this folder, README.md); this is its main.
#include "cli.hpp"

int main(int argc, char** argv) {
  return strata::probe::cli_main(argc, argv);
}
