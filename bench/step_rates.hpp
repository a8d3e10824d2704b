#pragma once
// The peaks behind `strata-bench step`'s lower bound, measured in the same run,
// before the step, on the same device and directory.
//
// Note [Rates lower bound]
// The bound of a step is the largest, over resources, of (the work the step
// gives that resource) / (the resource's peak). The work comes from the step's
// byte counters (h2d, d2h, disk read, disk write) and from the plan (parameters
// the optimizer updates, host memory traffic: Runtime::predict), never from the
// timeline's busy spans, so the runtime's own queueing cannot inflate it. The
// peaks are measured by the one rate measurer (rates::RateMeasurer, Note [One rate
// measurer] in runtime/rates/include/strata/rates/rate_measurer.hpp), each the
// best of a few runs of:
// - h2d, d2h: chunk-sized copies on the same sim device (its configured throttle);
// - disk read, disk write: chunk-sized slots through an IoEngine and SwapStore in
//   the same directory, several in flight (rewrites, after an untimed first write
//   of fresh extents, as the runtime rewrites its slots); and the disk as a whole,
//   reads and writes in flight together (even slots written, odd ones read), as
//   the pipeline's read-ahead and write-back share it: its work is read + write bytes;
// - CPU optimizer: kernels::step (fp32 AdamW, GradCheck::kCallerChecked: the
//   kernel alone) over one chunk with the runtime's thread count; on the sim
//   device the "device" optimizer is the same CPU kernel on the same cores, so
//   both families' parameters count against this one rate;
// - host memory: a parallel memcpy of one chunk with the same threads, read + write bytes;
// - compute: the modelled rate itself (the sim's timed kernels sleep for it).
// Taking the best run makes each peak high and so the bound low: a ratio below
// 1 would mean a peak was underestimated.

#include <cstdint>
#include <filesystem>

#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"
#include "strata/rates/rate_measurer.hpp"
#include "strata/runtime/cost_model.hpp"

namespace strata::bench {

//! The peaks, in the cost model's rates, and what the disk passes found beside them.
struct PeakRates {
  runtime::Rates rates;  //!< every rate of Note [Rates lower bound] but compute
  rates::DiskFacts disk;
};

//! How to measure them.
struct PeakOptions {
  std::uint64_t chunk_bytes = 0;  //!< one chunk (copies, disk slots, optimizer span = chunk_bytes / 4 params)
  std::filesystem::path dir;      //!< the NVMe directory the runtime will use
  std::size_t threads = 0;        //!< threads running the optimizer (the runtime's pool size)
  int repeats = 3;                //!< timed runs of each; the best is kept
  std::uint32_t disk_slots = 12;  //!< slots written then read per run
  std::uint32_t disk_in_flight = 8;
};

//! Measures every peak of Note [Rates lower bound] on `device` (its copy
//! throttle) and in options.dir. Blocks for a few seconds. Leaves no file
//! behind. Fails with the device's, the pool's or the swap store's Status.
Result<PeakRates> measure_peaks(memory::Device& device, const PeakOptions& options);

}  // namespace strata::bench
