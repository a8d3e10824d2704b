#pragma once
// Topology: what hwloc sees of this machine (NUMA nodes, cores, memory per node, the node
// nearest a GPU) and where strata puts its CPU workers and its pinned region.
//
// Note [Placement near the GPU]
// Host-side work for a GPU (staging copies, CPU optimizer steps) runs fastest on the NUMA
// node the GPU's PCIe root hangs off: its DMA then crosses no socket link. Topology finds
// that node from the GPU's PCI bus id (from cudart; hwloc's cuda/nvml plugins may be
// absent, so the bus id is looked up among hwloc's PCI devices). The ThreadPool gets the
// node's core count and an on_worker_start hook that binds each worker to the node's
// cpuset; the pinned region gets a hook that binds its pages to the node
// (hwloc_set_area_membind) before they are touched. On a single-node machine both hooks
// are no-ops and the log says so; when the GPU's node is unknown, node 0 is used and the
// log says why.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"

namespace strata::memory {

//! One NUMA node as hwloc reports it.
struct NumaNode {
  unsigned os_index = 0;           //!< the kernel's node number
  std::uint64_t memory_bytes = 0;  //!< local memory (0 when hwloc does not know)
  std::size_t cores = 0;           //!< physical cores whose memory is this node
  std::size_t pus = 0;             //!< hardware threads (processing units)
};

//! Where workers and the pinned region go, and why.
struct Placement {
  unsigned numa_node = 0;          //!< index into Topology::numa_nodes()
  std::size_t worker_threads = 1;  //!< cores of that node (at least 1)
  std::string reason;              //!< e.g. "nearest cuda:0 (PCI 0000:3b:00.0)" or "one NUMA node"
};

//! Read-only after discovery; thread-safe. The hooks it returns capture the Topology,
//! which must outlive them (and the ThreadPool and PinnedHostPool using them).
class Topology {
 public:
  //! Loads this machine's topology (with PCI devices, to find GPUs). Fails (Unavailable)
  //! when hwloc cannot load it; the message says so.
  static Result<std::unique_ptr<Topology>> discover();
  //! A synthetic topology in hwloc's syntax, e.g. "pack:2 [numa(memory=1GB)] core:4 pu:2"
  //! (for tests: binding on it does nothing real). InvalidArgument for a bad description.
  static Result<std::unique_ptr<Topology>> synthetic(std::string_view description);
  ~Topology();
  Topology(const Topology&) = delete;
  Topology& operator=(const Topology&) = delete;

  const std::vector<NumaNode>& numa_nodes() const { return nodes_; }
  std::size_t cores() const { return cores_; }
  std::size_t pus() const { return pus_; }
  std::uint64_t memory_bytes() const;

  //! Index into numa_nodes() of the node nearest the PCI device `bus_id`
  //! ("0000:3b:00.0"), or nullopt when hwloc does not know the device; `why` (may be
  //! null) then says what failed.
  std::optional<unsigned> numa_node_of_pci(std::string_view bus_id, std::string* why = nullptr) const;

  //! The node for `device`'s host-side work (Note [Placement near the GPU]): the GPU's
  //! node when known, else node 0. Logs the choice and its reason once per call.
  Placement place(const Device* device) const;

  //! ThreadPool::Options::on_worker_start hook binding each worker to `placement`'s node.
  //! A logged no-op on one node; a failed bind is logged (warn) once, never fatal.
  std::function<void(std::size_t)> worker_binder(const Placement& placement) const;
  //! PinnedHostPoolOptions::bind_memory hook binding pages to `placement`'s node.
  //! A logged no-op on one node; a failed bind is logged (warn), never fatal.
  std::function<void(void*, std::size_t)> memory_binder(const Placement& placement) const;

  //! "1 NUMA node, 2 cores, 2 PUs, 23.4 GiB (node 0: 2 cores, 23.4 GiB)".
  std::string summary() const;

 private:
  struct Impl;
  explicit Topology(std::unique_ptr<Impl> impl);
  static Result<std::unique_ptr<Topology>> load(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::vector<NumaNode> nodes_;
  std::size_t cores_ = 0;
  std::size_t pus_ = 0;
};

}  // namespace strata::memory
