// strata-probe's measurements of the host, the device, host memory and the CPU
// optimizer (measure.hpp); the NVMe directory's is measure_nvme.cpp. The rates are
// the one rate measurer's (Note [One rate measurer] in rate_measurer.hpp); what is
// here is the probe's choice of how.
#include "measure.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <memory>

#include "strata/common/bytes.hpp"
#include "strata/memory/topology.hpp"

namespace strata::probe {

Result<HostInfo> measure_host() {
  HostInfo h;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<memory::Topology> topo, memory::Topology::discover());
  h.cores = topo->cores();
  h.pus = topo->pus();
  h.numa_nodes = topo->numa_nodes().size();
  h.topology = topo->summary();
  h.ram_bytes = memory::physical_memory_bytes();
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return errno_status(errno, "getrlimit(RLIMIT_MEMLOCK)");
  h.memlock_bytes = lim.rlim_cur == RLIM_INFINITY ? UINT64_MAX : static_cast<std::uint64_t>(lim.rlim_cur);
  return h;
}

Result<DeviceInfo> measure_device(memory::DeviceOptions options, std::uint64_t copy_bytes,
                                  rates::RateMeasurer& measurer) {
  DeviceInfo info;
  std::unique_ptr<memory::Device> device;
  if (options.budget_bytes == 0) {
    // Find the largest budget cuda accepts; sim gets 4 GiB.
    memory::DeviceOptions first = options;
    first.budget_bytes = std::max<std::uint64_t>(copy_bytes + 64 * kMiB, kGiB);
    STRATA_ASSIGN_OR_RETURN(device, memory::make_device(first, &info.why));
    if (device->kind() == memory::DeviceKind::kCuda) {
      std::uint64_t lo = first.budget_bytes, hi = 4 * kTiB;
      for (int i = 0; i < 8 && hi - lo > kGiB; ++i) {
        memory::DeviceOptions t = options;
        t.kind = memory::DeviceChoice::kCuda;
        t.budget_bytes = lo + (hi - lo) / 2;
        std::string ignored;
        (memory::make_device(t, &ignored).ok() ? lo : hi) = t.budget_bytes;
      }
      info.budget_bytes = lo;
    } else {
      info.budget_bytes = 4 * kGiB;
    }
  } else {
    STRATA_ASSIGN_OR_RETURN(device, memory::make_device(options, &info.why));
    info.budget_bytes = options.budget_bytes;
  }
  info.kind = std::string(memory::device_kind_name(device->kind()));
  info.name = device->name();
  info.throttled = device->kind() == memory::DeviceKind::kSim && options.h2d_bytes_per_s > 0;

  // Runs of three copies each way after one untimed run: 5 to 25, until 0.3 s; the median.
  STRATA_RETURN_IF_ERROR(measurer.measure_copies(
      *device,
      {.bytes = copy_bytes,
       .sampling = {
           .statistic = rates::Statistic::kMedian, .runs_min = 5, .runs_max = 25, .seconds_min = 0.3}}));
  return info;
}

Status measure_host_memory(rates::RateMeasurer& measurer, std::uint64_t bytes, std::size_t threads) {
  return measurer.measure_host_memory(
      {.bytes = bytes,
       .threads = threads,
       .sampling = {
           .statistic = rates::Statistic::kMedian, .runs_min = 5, .runs_max = 41, .seconds_min = 0.3}});
}

// Note [Probe optimizer samples]
// A warm-up step, then at least 5 timed steps and more, up to 41, until they have
// run 0.4 s; the median (3 to 15 and 0.3 s until the twentieth session). Three steps of the tests' 2M params
// took ~10 ms each, and one stretched by the scheduler on a loaded 2-core machine moved the median 2x between
// identical probe runs (a verify at optim-nvme then predicted a 1.18 s step for one that took 0.77 s, ratio
// 0.66).
Status measure_cpu_optimizer(rates::RateMeasurer& measurer, std::uint64_t params, std::size_t threads,
                             kernels::DType state_dtype) {
  return measurer.measure_cpu_optimizer(
      {.params = params,
       .threads = threads,
       .check = kernels::GradCheck::kSeparatePass,  // the runtime's own check, as it steps
       .sampling =
           {.statistic = rates::Statistic::kMedian, .runs_min = 5, .runs_max = 41, .seconds_min = 0.4},
       .state_dtype = state_dtype});
}

}  // namespace strata::probe
