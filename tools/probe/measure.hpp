#pragma once
// strata-probe's measurements of this machine: topology, RAM, memlock, the
// device, and its rates through the one rate measurer (Note [One rate measurer]
// in rate_measurer.hpp) with the probe's parameters: the device's copy rates, the
// NVMe directory's read/write bandwidth through strata's own IoEngine + SwapStore,
// the CPU optimizer rate through kernels::step, host memory. Each measurement is
// bounded in bytes and seconds.

#include <cstdint>
#include <string>

#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/rates/rate_measurer.hpp"

namespace strata::probe {

//! Called with a stage name and its completed fraction in [0, 1]; may be empty.
using Progress = rates::Progress;

//! The device the probe measured.
struct DeviceInfo {
  std::string kind;                //!< "sim" or "cuda"
  std::string name;                //!< Device::name()
  std::string why;                 //!< the factory's reason (e.g. why there is no GPU)
  std::uint64_t budget_bytes = 0;  //!< device memory the placements may use
  bool throttled = false;          //!< sim: the copy rates are its configured throttle
};

//! The `--nvme DIR` the probe measured; its rates are the measurer's (disk_*).
struct NvmeInfo {
  std::string path;
  std::string engine;  //!< "uring" or "posix"
  bool direct_io = false;
  std::uint64_t free_bytes = 0;
  std::uint64_t bytes_tested = 0;
};

//! Host facts.
struct HostInfo {
  std::size_t cores = 0;
  std::size_t pus = 0;  //!< hardware threads
  std::size_t numa_nodes = 0;
  std::uint64_t ram_bytes = 0;
  std::uint64_t memlock_bytes = 0;  //!< RLIMIT_MEMLOCK soft limit; UINT64_MAX = unlimited
  std::string topology;             //!< Topology::summary()
};

//! Topology (hwloc), RAM, memlock. Fails when hwloc cannot load the topology.
Result<HostInfo> measure_host();

//! Creates the device `options` ask for (auto: cuda when usable, else sim) and times
//! `copy_bytes` each way (one run of three copies) into `measurer`. For cuda with
//! budget 0, the budget becomes the largest that opens (bisection, 8 tries). Fails
//! with the factory's Status.
Result<DeviceInfo> measure_device(memory::DeviceOptions options, std::uint64_t copy_bytes,
                                  rates::RateMeasurer& measurer);

//! Writes (a warm-up pass, then timed ones), then reads up to `bytes_max` (at most
//! `seconds_max` per pass) in slots of up to 16 MiB through a SwapStore on `dir`
//! (Note [Probe NVMe test size]), then runs the pipeline pass (Note [Probe disk
//! pipeline pass]; its optimizer kernels on a pool of `optimizer_threads`, none
//! when 0), in three rounds (Note [Probe disk rounds]), into `measurer`; the swap
//! file is removed before returning. Fails: NotFound (missing dir),
//! PermissionDenied / IoError (read-only), NoSpace (less than 64 MiB free), with
//! the path in the message.
Result<NvmeInfo> measure_nvme(const std::string& dir, std::uint64_t bytes_max, double seconds_max,
                              std::size_t optimizer_threads, rates::RateMeasurer& measurer);

//! Host memory traffic (read + write bytes a second) of a parallel copy of
//! `bytes` over exactly `threads` threads, the median of 5 to 41 copies after a
//! warm-up, as many as run 0.3 s (Note [Host memory as a resource]), into
//! `measurer`. run.cpp calls it once per round (Note [Probe host rounds]).
Status measure_host_memory(rates::RateMeasurer& measurer, std::uint64_t bytes, std::size_t threads);
//! AdamW over `params` elements (fp32 states, about 16 bytes each; q8 states with
//! state_dtype q8, kernels::step_q8) on exactly `threads`
//! threads (a pool of that many, the step started on one of them, as the
//! runtime's optimizer tasks run), the median of 5 to 41 timed steps after a
//! warm-up, as many as run 0.4 s (Note [Probe optimizer samples]): parameters per
//! second, into `measurer`. run.cpp calls it once per round (Note [Probe host rounds]).
Status measure_cpu_optimizer(rates::RateMeasurer& measurer, std::uint64_t params, std::size_t threads,
                             kernels::DType state_dtype = kernels::DType::kF32);

}  // namespace strata::probe
