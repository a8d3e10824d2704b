#pragma once
// strata-probe's measurements of this machine: topology, RAM, memlock, the
// device and its copy rates, the NVMe directory's read/write bandwidth through
// strata's own IoEngine + SwapStore, and the CPU optimizer rate through
// kernels::step. Each measurement is bounded in bytes and seconds.

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::probe {

//! Called with a stage name and its completed fraction in [0, 1]; may be empty.
using Progress = std::function<void(std::string_view stage, double fraction)>;

//! The device the probe measured.
struct DeviceInfo {
  std::string kind;                //!< "sim" or "cuda"
  std::string name;                //!< Device::name()
  std::string why;                 //!< the factory's reason (e.g. why there is no GPU)
  std::uint64_t budget_bytes = 0;  //!< device memory the placements may use
  double h2d_bytes_per_s = 0;      //!< measured
  double d2h_bytes_per_s = 0;      //!< measured
  bool throttled = false;          //!< sim: the rates are its configured throttle
};

//! What `--nvme DIR` sustained.
struct NvmeInfo {
  std::string path;
  std::string engine;  //!< "uring" or "posix"
  bool direct_io = false;
  std::uint64_t free_bytes = 0;
  std::uint64_t bytes_tested = 0;
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
  //! Reads and writes as the optimizer pipeline does them (Note [Probe disk
  //! pipeline pass] in measure_nvme.cpp): bytes of both a second.
  double mixed_bytes_per_s = 0;
  //! The state bytes each family of that pass read and wrote per hop.
  std::uint64_t mixed_family_bytes = 0;
  //! The process's CPU time (user and system) per byte of the timed write and read
  //! passes: checksums, the I/O engine and the kernel's side of the transfers.
  double cpu_seconds_per_byte = 0;
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
//! `copy_bytes` each way a few times. For cuda with budget 0, the budget becomes
//! the largest that opens (bisection, 8 tries). Fails with the factory's Status.
Result<DeviceInfo> measure_device(memory::DeviceOptions options, std::uint64_t copy_bytes,
                                  const Progress& progress);

//! Writes (a warm-up pass, then a timed one), then reads up to `bytes_max` (at most
//! `seconds_max` per pass) in 16 MiB
//! slots through a SwapStore on `dir`, then runs the pipeline pass (Note [Probe
//! disk pipeline pass] in measure_nvme.cpp; its optimizer kernels on a pool of
//! `optimizer_threads`, none when 0); the swap file is removed before returning.
//! Fails: NotFound (missing dir), PermissionDenied / IoError (read-only), NoSpace
//! (less than 64 MiB free), with the path in the message.
Result<NvmeInfo> measure_nvme(const std::string& dir, std::uint64_t bytes_max, double seconds_max,
                              std::size_t optimizer_threads, const Progress& progress);

//! Host memory traffic (read + write bytes a second) of a parallel copy of
//! `bytes` over exactly `threads` threads, median of 3 (Note [Host memory as a resource]).
Result<double> measure_host_memory(std::uint64_t bytes, std::size_t threads, const Progress& progress);
//! fp32 AdamW over `params` elements (about 16 bytes each) on exactly `threads`
//! threads (a pool of that many, the step started on one of them, as the
//! runtime's optimizer tasks run), the median of 3 to 15 timed steps after a
//! warm-up, as many as run 0.3 s (Note [Probe optimizer samples]): parameters per second.
Result<double> measure_cpu_optimizer(std::uint64_t params, std::size_t threads, const Progress& progress);

}  // namespace strata::probe
