#pragma once
// The one rate measurer (Note [One rate measurer]): the rates of runtime::Rates
// measured on this machine — the device's copies, a directory's disk, the CPU
// optimizer and host memory — for strata-probe and strata-bench step.
//
// Note [One rate measurer]
// strata-probe (tools/probe/) predicts steps from measured rates and strata-bench
// step bounds a step from measured peaks (Note [Rates lower bound] in
// bench/step_rates.hpp). Both measured the same rates — copies each way on the
// device, disk reads, writes and reads with writes through an IoEngine and a
// SwapStore, fp32 AdamW through kernels::step, a parallel memcpy — each with its
// own code and its own struct. Here each has one implementation, and each lands in
// the field of runtime::Rates that the cost model reads, so it has one name too.
//
// It returns runtime::Rates itself (RateMeasurer::rates()), not a struct to map:
// every peak the bench's PeakRates held is a field of runtime::Rates, and compute
// is measured by neither (the bench's sim device sleeps for its modelled rate, the
// probe takes --tflops). What is not a rate — the I/O engine's name, O_DIRECT, the
// bytes a pass wrote — comes back beside it as DiskFacts, which both callers print.
// Each measurement sets the fields it measured and leaves the rest at
// runtime::Rates' defaults. Of the fields PeakRates did not have, three are
// measured for both callers (cpu_threads, disk_cpu_seconds_per_byte,
// disk_mixed_family_bytes: 0 for the bench's interleaved pass) and the bench's
// bound reads none of them (it takes work counts from the cost model, never
// times); what models the device rather than measuring it (copy_host_passes,
// compute_host_threads, gpu_optim_params_per_s on the sim device) is the caller's
// to set.
//
// Where the two measured differently, the difference is a parameter and each caller
// keeps its own:
//   what                 strata-bench step (a peak: high)     strata-probe (a prediction: typical)
//   statistic            the best of 3 runs                   the median (Note [Probe disk rounds],
//                                                             Note [Probe optimizer samples])
//   copies               one chunk x 3, best of 3             64 MiB x 3, median of 5 to 25 runs
//   disk size            12 chunk-sized slots, 8 in flight    Note [Probe NVMe test size], each pass
//                                                             bounded by --nvme-seconds
//   disk warm-up         an untimed write, read and mixed     an untimed write pass
//   disk mixed pass      interleaved (MixedPass::kInterleaved) the pipeline pass (Note [Probe disk
//                                                             pipeline pass])
//   optimizer            one chunk, GradCheck::kCallerChecked --optimizer-params, kSeparatePass (the
//                        (the kernel alone), best of 3        runtime's check), median of 5 to 41
//   host memory          one chunk, best of 3                 256 MiB, median of 5 to 41; the probe
//                                                             takes the median of 3 rounds of the
//                                                             optimizer and this (Note [Probe host
//                                                             rounds] in tools/probe/run.cpp)
//   threads              the hardware's threads               the host's cores
// What changed for one of them in sharing the code (untimed work, or where a thread
// sits, not what a figure means):
// - the optimizer step and the host memory copy run on a pool of exactly `threads`
//   threads, started on one of its workers and timed there (as the runtime's
//   optimizer tasks run); the bench ran them from its own thread joined by
//   threads - 1 workers (ThreadPool::parallel_for): the same number of threads;
//   the probe timed its optimizer step around the post to the worker;
// - the disk passes run in rounds, a write, a read and a mixed pass each (Note
//   [Probe disk rounds]); the bench ran its write passes, then its reads, then its
//   mixed ones. Every pass also measures the process's CPU time per byte
//   (Rates::disk_cpu_seconds_per_byte), which the bench's bound does not read;
// - a copy's warm-up is one untimed run of three copies (the probe's was one copy);
// - the buffers are 2 MiB-aligned and huge-page hinted, as the runtime's pinned host
//   pool (the bench's were mmap'ed with the same hint).

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <string_view>

#include "strata/common/status.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/memory/device.hpp"
#include "strata/runtime/cost_model.hpp"

namespace strata::rates {

//! Called with a stage name and its completed fraction in [0, 1]; may be empty.
using Progress = std::function<void(std::string_view stage, double fraction)>;

//! How a rate's timed runs become one figure.
enum class Statistic : std::uint8_t {
  kBest,    //!< the highest rate: a peak
  kMedian,  //!< the upper median: what a run typically gets
};

//! One untimed warm-up run, then at least runs_min timed runs and more, up to
//! runs_max, until the timed runs took seconds_min in all; their rates reduced by
//! `statistic`.
struct Sampling {
  Statistic statistic = Statistic::kBest;
  int runs_min = 3;  //!< >= 1
  int runs_max = 3;  //!< >= runs_min
  double seconds_min = 0;
};

//! Copies each way on a device: a run is three copies of `bytes`.
struct CopyOptions {
  std::uint64_t bytes = 0;  //!< > 0
  Sampling sampling;
};

//! How the disk's reads and writes are measured together (Rates::disk_mixed_bytes_per_s).
enum class MixedPass : std::uint8_t {
  kInterleaved,  //!< even slots written, odd ones read, in_flight at all times: a peak
  kPipeline,     //!< the optimizer pipeline's shape (Note [Probe disk pipeline pass])
};

//! What runs untimed before the disk's rounds.
enum class DiskWarmUp : std::uint8_t {
  kWrite,  //!< a write pass over every slot: fresh extents (the runtime rewrites its slots)
  kRound,  //!< that, then a read pass and a mixed pass: every pass warmed once
};

//! Disk passes through an IoEngine and a SwapStore in `dir` (Note [Probe disk rounds]).
struct DiskOptions {
  std::filesystem::path dir;
  std::uint64_t slot_bytes = 0;  //!< a positive multiple of 4096
  std::uint32_t slots = 0;       //!< >= 1; >= 2 for MixedPass::kPipeline
  std::uint32_t in_flight = 0;   //!< transfers (and buffers) in flight, 1 to slots
  Statistic statistic = Statistic::kBest;
  int rounds = 3;  //!< >= 1
  DiskWarmUp warm_up = DiskWarmUp::kWrite;
  MixedPass mixed = MixedPass::kInterleaved;
  //! A pass issues no transfer after this many seconds (it issues at least one).
  double pass_seconds_max = std::numeric_limits<double>::infinity();
  std::size_t pipeline_threads = 0;  //!< kPipeline: threads of its AdamW kernels; 0 = no kernels
  std::string context;               //!< what every error names (e.g. "--nvme DIR")
};

//! What the disk passes found that is not a rate.
struct DiskFacts {
  std::string engine;  //!< IoEngine::name()
  bool direct_io = false;
  std::uint64_t bytes_tested = 0;  //!< bytes the first timed write pass wrote
};

//! fp32 AdamW through kernels::step over one span of `params`.
struct OptimizerOptions {
  std::uint64_t params = 0;  //!< > 0
  std::size_t threads = 1;   //!< >= 1
  kernels::GradCheck check = kernels::GradCheck::kSeparatePass;
  Sampling sampling;
  //! fp32 (or bf16: timed as fp32) runs kernels::step; q8 runs kernels::step_q8 on
  //! 8-bit states (Note [Q8 state chunks] in runtime/src/pipeline/q8_states.cpp).
  kernels::DType state_dtype = kernels::DType::kF32;
};

//! A parallel memcpy from one buffer of `bytes` to another; read + write bytes.
struct HostMemoryOptions {
  std::uint64_t bytes = 0;  //!< a positive multiple of 4096
  std::size_t threads = 1;  //!< >= 1
  Sampling sampling;
};

//! Measures rates into one runtime::Rates. Each call blocks for its measurement
//! (from milliseconds to a few seconds), allocates its buffers for that time only,
//! and reports its stages to the Progress. Not thread-safe: one measurement at a time.
class RateMeasurer {
 public:
  explicit RateMeasurer(Progress progress = {}) : progress_(std::move(progress)) {}

  //! h2d_bytes_per_s and d2h_bytes_per_s on `device` (its throttle, on the sim
  //! device), stage "device". Fails with the device's Status.
  Status measure_copies(memory::Device& device, const CopyOptions& options);

  //! disk_write_bytes_per_s, disk_read_bytes_per_s, disk_mixed_bytes_per_s,
  //! disk_mixed_family_bytes (0 for kInterleaved: the rate holds at every family
  //! size) and disk_cpu_seconds_per_byte (the process's CPU time over the timed
  //! write and read passes), stages "nvme warm-up", "nvme write", "nvme read" and
  //! "nvme pipeline". Removes its swap file before returning. Fails with
  //! InvalidArgument (options), the engine's or the swap store's Status, each with
  //! options.context.
  Result<DiskFacts> measure_disk(const DiskOptions& options);

  //! cpu_optim_params_per_s and cpu_threads, stage "cpu optimizer". Fails with the
  //! pool's or the kernel's Status, or Internal when a finite step was not applied.
  Status measure_cpu_optimizer(const OptimizerOptions& options);

  //! host_memory_bytes_per_s, stage "host memory". Fails with InvalidArgument
  //! (options), OutOfMemory, or the pool's Status.
  Status measure_host_memory(const HostMemoryOptions& options);

  //! What was measured so far; the fields not measured hold runtime::Rates' defaults.
  const runtime::Rates& rates() const { return rates_; }

 private:
  Progress progress_;
  runtime::Rates rates_;
};

}  // namespace strata::rates
