#pragma once
// The cost model: a plan's step time, predicted from measured rates.
//
// Note [Step-time model]
// Each resource — device compute, host->device link, device->host link, disk read,
// disk write, CPU optimizer, GPU optimizer — is busy for (work / rate) per step.
// Reads and writes share one disk: with a measured mixed rate, the disk as a
// whole is one more resource, busy for (read + write bytes) / mixed rate, the
// rate taken at the plan's family size (Note [Disk rate by family size] in
// cost_model.cpp).
// With perfect overlap the step takes as long as the busiest resource (`bound_s`).
// What cannot overlap is added as a tail: the optimizer step of the family whose
// gradients complete last (it starts only when backward ends) and the upload of
// its param (the first thing the next forward needs); its NVMe states' write-back
// is not tail, it goes on after step() returns (Note [Write-back after step]).
// Byte counts come from replaying the traced sequence against the plan's GPU
// slots with the runtime's own slot choice — idle victims first, prefetch, a
// streamed param dropped when its update commits (Note [Cost model follows the
// runtime] in cost_model.cpp) — so they are exact for a step that follows the
// trace on a device that keeps up. strata-probe uses this same model.
//
// Note [Host memory as a resource]
// Copies, the CPU optimizer and disk DMA all move bytes through host memory, and
// on a host with few cores that, not any one link, can bound the step. With a
// measured host memory rate (Rates::host_memory_bytes_per_s, read + write bytes
// a second), the model counts the step's host memory traffic as one more
// resource: each copied byte once (DMA) or twice (the sim device, whose copies are
// memcpy: Rates::copy_host_passes), disk reads and writes once, the CPU
// optimizer's reads and writes (gradient, params, master and states), and the
// staging copy of an NVMe family's param.
//
// Note [Host cores as a resource]
// Whatever runs on the host's cores shares them. With Rates::cpu_threads set,
// the host's cores are one more resource, busy for the sum of each piece of host
// work's share of all cpu_threads cores:
//   - the CPU optimizer's time (its rate was measured on all cpu_threads);
//   - the device's compute where it runs on host threads (the sim device:
//     compute_s x compute_host_threads / cpu_threads), and its optimizer kernels
//     (gpu_optim_params_per_s is then the host's rate, measured on all cores).
//     strata-probe --verify sets 1 (its layers are real products on the sim
//     compute stream, Note [Verify compute]); the probe's table sets every core,
//     as a torch trainer's CPU ops take them all;
//   - copies that are memcpy (copy_host_passes > 1, the sim device): their host
//     memory traffic at the rate measured on all cores;
//   - the CPU time a disk byte costs: the CRC32C every swap-store read and write
//     computes, the I/O engine and the kernel's side of the transfer
//     (Rates::disk_cpu_seconds_per_byte, core-seconds; strata-probe measures the
//     process's CPU time over its timed NVMe passes).
// On two cores these pieces do not overlap one another. The 1.2 B GPT of
// bench/torch_scale.py (fp32, optim-nvme) measured it: its step took 12.0 s of
// wall time and 23.9 s of the process's CPU time, about 87 % of it work (the
// rest OpenBLAS's threads yielding), where its forward and backward alone took
// 8.5 s; this term predicted 10.5 s (docs/scale.md).

#include <cstdint>
#include <string>

#include "strata/runtime/planner.hpp"

namespace strata::runtime {

//! Measured (or assumed) rates. Bytes per second and params per second.
struct Rates {
  double h2d_bytes_per_s = 16e9;
  double d2h_bytes_per_s = 16e9;
  double disk_read_bytes_per_s = 2e9;
  double disk_write_bytes_per_s = 1.5e9;
  //! Reads and writes in flight together on one disk, bytes of both a second;
  //! 0 = not measured (reads and writes then overlap perfectly).
  double disk_mixed_bytes_per_s = 0;
  //! The state bytes a family read (and wrote) per hop when disk_mixed_bytes_per_s
  //! was measured; 0 = the mixed rate holds at every family size (Note [Disk rate by
  //! family size] in cost_model.cpp).
  double disk_mixed_family_bytes = 0;
  double cpu_optim_params_per_s = 400e6;
  double gpu_optim_params_per_s = 20e9;
  //! Host memory traffic a second (read + write bytes); 0 = not modelled.
  double host_memory_bytes_per_s = 0;
  //! Host memory passes per copied byte: 1 for DMA, 2 for the sim device's memcpy.
  double copy_host_passes = 1.0;
  //! Host threads the device's compute occupies (the sim device's compute stream:
  //! 1); 0 = the compute is not on the host (Note [Host cores as a resource]).
  double compute_host_threads = 0;
  //! Threads cpu_optim_params_per_s was measured on; 0 = not modelled.
  double cpu_threads = 0;
  //! Core-seconds of host CPU per disk byte read or written; 0 = not modelled.
  double disk_cpu_seconds_per_byte = 0;
};

//! Work and time per resource for one steady step.
struct StepCost {
  std::uint64_t bytes_h2d = 0;
  std::uint64_t bytes_d2h = 0;
  std::uint64_t bytes_disk_read = 0;
  std::uint64_t bytes_disk_write = 0;
  std::uint64_t params_cpu_optim = 0;
  std::uint64_t params_gpu_optim = 0;
  std::uint64_t bytes_host_memory = 0;  //!< Note [Host memory as a resource]
  double compute_s = 0, h2d_s = 0, d2h_s = 0, disk_read_s = 0, disk_write_s = 0, cpu_optim_s = 0,
         gpu_optim_s = 0, host_memory_s = 0, disk_s = 0;
  double host_cpu_s = 0;         //!< Note [Host cores as a resource]: the sum of the optimizer's
                                 //!< time and the three shares below
  double host_cpu_device_s = 0;  //!< the device's compute and kernels where they run on the host
  double host_cpu_copy_s = 0;    //!< memcpy copies
  double host_cpu_disk_s = 0;    //!< the CPU time of the disk's bytes
  double bound_s = 0;            //!< busiest resource
  double tail_s = 0;             //!< what cannot overlap
  double step_s = 0;             //!< predicted = bound_s + tail_s
  std::string bottleneck;        //!< name of the busiest resource
};

//! Forward FLOPs of a dense layer of `params` parameters over `tokens` tokens: a
//! multiply and an add per parameter per token. Backward costs twice as much.
//! The one place this formula lives (the probe's model, its verify run and the
//! step benchmark time their layers with it).
constexpr double forward_flops(double params, double tokens) {
  return 2.0 * params * tokens;
}

//! Predicts one steady step of `plan`. Never fails; zero rates count as infinite
//! time for any work on that resource (so a missing link shows as the bottleneck).
StepCost predict_step(const PlanInput& input, const Plan& plan, const Rates& rates);

//! Number of param chunk loads (host->device, on demand and prefetched) per steady
//! step when the traced sequence runs against the plan's GPU slots as the runtime
//! picks them (Note [Cost model follows the runtime]); their bytes in *fetch_bytes.
//! Exposed for tests.
std::uint64_t simulate_param_fetches(const PlanInput& input, const Plan& plan, std::uint64_t* fetch_bytes);

}  // namespace strata::runtime
