#pragma once
// strata-probe's report lines that must agree with what the probe measured and
// planned with: the host line (the RAM the host capacity is cut from). main.cpp prints them; tests check
// them.

#include <string>

#include "measure.hpp"
#include "model.hpp"

namespace strata::probe {

//! Where the host capacity came from.
enum class HostCapacitySource : std::uint8_t {
  kRamShare,    //!< 3/4 of the RAM the kernel reports (the default)
  kHostBudget,  //!< --host-budget
};

//! The host line: NUMA nodes, cores and hardware threads, the RAM the probe
//! read (sysconf, the figure the capacity is cut from) and the host capacity
//! the placements use, with where it came from. hwloc's per-node memory is not
//! printed: on some machines it is a fraction of RAM (a node's free memory, or a
//! container's share) and disagrees with the capacity.
std::string host_line(const HostInfo& host, std::uint64_t host_capacity_bytes, HostCapacitySource source);

}  // namespace strata::probe
