// strata-probe's report lines; see report.hpp.
#include "report.hpp"

#include <fmt/format.h>

#include "strata/common/bytes.hpp"

namespace strata::probe {

std::string host_line(const HostInfo& host, std::uint64_t host_capacity_bytes, HostCapacitySource source) {
  return fmt::format("{} NUMA node{}, {} cores, {} PUs; RAM {}, placements plan with {} ({})",
                     host.numa_nodes, host.numa_nodes == 1 ? "" : "s", host.cores, host.pus,
                     format_bytes(host.ram_bytes), format_bytes(host_capacity_bytes),
                     source == HostCapacitySource::kHostBudget ? "--host-budget" : "3/4 of RAM");
}

}  // namespace strata::probe
