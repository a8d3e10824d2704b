// Note [Rates lower bound]: the peaks, each the best of a few timed runs of the one
// rate measurer (Note [One rate measurer] in rate_measurer.hpp) with the bench's
// parameters.
#include "step_rates.hpp"

#include <algorithm>

namespace strata::bench {

Result<PeakRates> measure_peaks(memory::Device& device, const PeakOptions& o) {
  if (o.chunk_bytes == 0 || o.chunk_bytes % 4096 != 0) {
    return invalid_argument("rates: chunk_bytes = {} must be a positive multiple of 4096", o.chunk_bytes);
  }
  const rates::Sampling best{
      .statistic = rates::Statistic::kBest, .runs_min = o.repeats, .runs_max = o.repeats};
  const std::size_t threads = std::max<std::size_t>(o.threads, 1);
  rates::RateMeasurer measurer;
  PeakRates out;
  STRATA_RETURN_IF_ERROR(measurer.measure_copies(device, {.bytes = o.chunk_bytes, .sampling = best}));
  STRATA_ASSIGN_OR_RETURN(out.disk, measurer.measure_disk({.dir = o.dir,
                                                           .slot_bytes = o.chunk_bytes,
                                                           .slots = o.disk_slots,
                                                           .in_flight = o.disk_in_flight,
                                                           .statistic = rates::Statistic::kBest,
                                                           .rounds = o.repeats,
                                                           .warm_up = rates::DiskWarmUp::kRound,
                                                           .mixed = rates::MixedPass::kInterleaved,
                                                           .context = "rates: disk in " + o.dir.string()}));
  STRATA_RETURN_IF_ERROR(measurer.measure_cpu_optimizer({.params = o.chunk_bytes / 4,
                                                         .threads = threads,
                                                         .check = kernels::GradCheck::kCallerChecked,
                                                         .sampling = best}));
  STRATA_RETURN_IF_ERROR(
      measurer.measure_host_memory({.bytes = o.chunk_bytes, .threads = threads, .sampling = best}));
  out.rates = measurer.rates();
  return out;
}

}  // namespace strata::bench
