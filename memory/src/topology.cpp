#include "strata/memory/topology.hpp"

#include <hwloc.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::memory {

struct Topology::Impl {
  hwloc_topology_t topology = nullptr;
  bool this_system = true;  // false for synthetic topologies (binding is then skipped)
  ~Impl() {
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }
};

namespace {

std::size_t count_inside(hwloc_topology_t topology, hwloc_const_cpuset_t set, hwloc_obj_type_t type) {
  const int n = hwloc_get_nbobjs_inside_cpuset_by_type(topology, set, type);
  return n > 0 ? static_cast<std::size_t>(n) : 0;
}

hwloc_obj_t numa_object(hwloc_topology_t topology, unsigned index) {
  return hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, index);
}

}  // namespace

Topology::Topology(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Topology::~Topology() = default;

Result<std::unique_ptr<Topology>> Topology::discover() {
  auto impl = std::make_unique<Impl>();
  if (hwloc_topology_init(&impl->topology) != 0) {
    return unavailable("topology: hwloc_topology_init failed: {}", std::strerror(errno));
  }
  // PCI devices are needed to find the NUMA node of a GPU by its bus id.
  hwloc_topology_set_io_types_filter(impl->topology, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  return load(std::move(impl));
}

Result<std::unique_ptr<Topology>> Topology::synthetic(std::string_view description) {
  auto impl = std::make_unique<Impl>();
  if (hwloc_topology_init(&impl->topology) != 0) {
    return unavailable("topology: hwloc_topology_init failed: {}", std::strerror(errno));
  }
  const std::string text(description);
  if (hwloc_topology_set_synthetic(impl->topology, text.c_str()) != 0) {
    return invalid_argument(
        "topology: \"{}\" is not a valid hwloc synthetic description (e.g. \"pack:2 core:4 pu:2\")",
        description);
  }
  impl->this_system = false;
  return load(std::move(impl));
}

Result<std::unique_ptr<Topology>> Topology::load(std::unique_ptr<Impl> impl) {
  if (hwloc_topology_load(impl->topology) != 0) {
    return unavailable("topology: hwloc_topology_load failed: {}; strata cannot place threads and memory",
                       std::strerror(errno));
  }
  std::unique_ptr<Topology> topo(new Topology(std::move(impl)));
  hwloc_topology_t t = topo->impl_->topology;
  topo->cores_ = static_cast<std::size_t>(std::max(0, hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE)));
  topo->pus_ = static_cast<std::size_t>(std::max(0, hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU)));
  const int node_count = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < node_count; ++i) {
    hwloc_obj_t node = numa_object(t, static_cast<unsigned>(i));
    NumaNode info;
    info.os_index = node->os_index;
    info.memory_bytes = node->attr != nullptr ? node->attr->numanode.local_memory : 0;
    info.cores = count_inside(t, node->cpuset, HWLOC_OBJ_CORE);
    info.pus = count_inside(t, node->cpuset, HWLOC_OBJ_PU);
    topo->nodes_.push_back(info);
  }
  if (topo->nodes_.empty()) {  // hwloc always reports one; guard anyway
    topo->nodes_.push_back({0, 0, topo->cores_, topo->pus_});
  }
  return topo;
}

std::uint64_t Topology::memory_bytes() const {
  std::uint64_t total = 0;
  for (const NumaNode& n : nodes_) total += n.memory_bytes;
  return total;
}

std::optional<unsigned> Topology::numa_node_of_pci(std::string_view bus_id, std::string* why) const {
  auto fail = [&](std::string reason) -> std::optional<unsigned> {
    if (why != nullptr) *why = std::move(reason);
    return std::nullopt;
  };
  if (bus_id.empty()) return fail("the device has no PCI bus id");
  const std::string id(bus_id);
  hwloc_obj_t pci = hwloc_get_pcidev_by_busidstring(impl_->topology, id.c_str());
  if (pci == nullptr) return fail(fmt::format("hwloc lists no PCI device {}", bus_id));
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(impl_->topology, pci);
  if (ancestor == nullptr || ancestor->nodeset == nullptr) {
    return fail(fmt::format("PCI device {} has no CPU-side ancestor in hwloc", bus_id));
  }
  for (unsigned i = 0; i < nodes_.size(); ++i) {
    hwloc_obj_t node = numa_object(impl_->topology, i);
    if (node != nullptr && hwloc_bitmap_isincluded(node->nodeset, ancestor->nodeset)) return i;
  }
  return fail(fmt::format("PCI device {} is not below any NUMA node", bus_id));
}

Placement Topology::place(const Device* device) const {
  Placement placement;
  if (nodes_.size() == 1) {
    placement.reason = "one NUMA node";
  } else if (device == nullptr || device->kind() == DeviceKind::kSim) {
    placement.reason = fmt::format("{} NUMA nodes, no GPU to be near: node 0", nodes_.size());
  } else {
    std::string why;
    std::optional<unsigned> node = numa_node_of_pci(device->pci_bus_id(), &why);
    if (node) {
      placement.numa_node = *node;
      placement.reason = fmt::format("nearest {} (PCI {})", device->name(), device->pci_bus_id());
    } else {
      placement.reason = fmt::format("NUMA node of {} unknown ({}): node 0", device->name(), why);
    }
  }
  placement.worker_threads = std::max<std::size_t>(1, nodes_[placement.numa_node].cores);
  STRATA_LOG_INFO("topology: {}; workers and pinned memory on NUMA node {} ({} threads): {}", summary(),
                  nodes_[placement.numa_node].os_index, placement.worker_threads, placement.reason);
  return placement;
}

std::function<void(std::size_t)> Topology::worker_binder(const Placement& placement) const {
  if (nodes_.size() == 1 || !impl_->this_system) {
    STRATA_LOG_INFO("topology: worker binding is a no-op ({})",
                    nodes_.size() == 1 ? "one NUMA node" : "synthetic topology");
    return [](std::size_t) {};
  }
  hwloc_obj_t node = numa_object(impl_->topology, placement.numa_node);
  auto warned = std::make_shared<std::atomic<bool>>(false);
  return [topology = impl_->topology, cpuset = node->cpuset, os_index = node->os_index,
          warned](std::size_t worker) {
    if (hwloc_set_cpubind(topology, cpuset, HWLOC_CPUBIND_THREAD) != 0 && !warned->exchange(true)) {
      STRATA_LOG_WARN("topology: binding worker {} to NUMA node {} failed ({}); workers run unbound", worker,
                      os_index, std::strerror(errno));
    }
  };
}

std::function<void(void*, std::size_t)> Topology::memory_binder(const Placement& placement) const {
  if (nodes_.size() == 1 || !impl_->this_system) {
    STRATA_LOG_INFO("topology: memory binding is a no-op ({})",
                    nodes_.size() == 1 ? "one NUMA node" : "synthetic topology");
    return [](void*, std::size_t) {};
  }
  hwloc_obj_t node = numa_object(impl_->topology, placement.numa_node);
  return [topology = impl_->topology, nodeset = node->nodeset, os_index = node->os_index](void* data,
                                                                                          std::size_t bytes) {
    if (hwloc_set_area_membind(topology, data, bytes, nodeset, HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) !=
        0) {
      STRATA_LOG_WARN("topology: binding {} to NUMA node {} failed ({}); the kernel places it",
                      format_bytes(bytes), os_index, std::strerror(errno));
    } else {
      STRATA_LOG_INFO("topology: {} bound to NUMA node {}", format_bytes(bytes), os_index);
    }
  };
}

std::string Topology::summary() const {
  std::string nodes;
  for (const NumaNode& n : nodes_) {
    if (!nodes.empty()) nodes += ", ";
    nodes += fmt::format("node {}: {} cores, {}", n.os_index, n.cores, format_bytes(n.memory_bytes));
  }
  return fmt::format("{} NUMA node{}, {} cores, {} PUs, {} ({})", nodes_.size(),
                     nodes_.size() == 1 ? "" : "s", cores_, pus_, format_bytes(memory_bytes()), nodes);
}

}  // namespace strata::memory
