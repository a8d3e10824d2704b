// Topology (hwloc): this machine, synthetic multi-node machines, placement and hooks.

#include <gtest/gtest.h>

#include <atomic>

#include "memory/test_util.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/memory/topology.hpp"

namespace strata::memory {
namespace {

TEST(Topology, DiscoversThisMachine) {
  auto topo = Topology::discover();
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_GE((*topo)->numa_nodes().size(), 1u);
  EXPECT_GE((*topo)->cores(), 1u);
  EXPECT_GE((*topo)->pus(), (*topo)->cores());
  std::size_t cores = 0;
  for (const NumaNode& n : (*topo)->numa_nodes()) cores += n.cores;
  EXPECT_EQ(cores, (*topo)->cores());
  // hwloc reads per-node memory from sysfs, which need not add up to /proc/meminfo (this
  // sandbox reports 7.3 GiB for node 0 of a 23.5 GiB machine); it is never more.
  EXPECT_GT((*topo)->memory_bytes(), 0u);
  EXPECT_LE((*topo)->memory_bytes(), physical_memory_bytes() + physical_memory_bytes() / 10);
  EXPECT_NE((*topo)->summary().find("NUMA node"), std::string::npos) << (*topo)->summary();
}

TEST(Topology, OneNodeMeansNoOpBindersThatSaySo) {
  auto topo = Topology::discover();
  ASSERT_TRUE(topo.ok());
  if ((*topo)->numa_nodes().size() != 1) GTEST_SKIP() << "this machine has several NUMA nodes";
  testing::LogCapture log;
  Placement placement = (*topo)->place(nullptr);
  EXPECT_EQ(placement.numa_node, 0u);
  EXPECT_EQ(placement.worker_threads, (*topo)->cores());
  EXPECT_EQ(placement.reason, "one NUMA node");
  auto bind_worker = (*topo)->worker_binder(placement);
  auto bind_memory = (*topo)->memory_binder(placement);
  EXPECT_TRUE(log.contains("worker binding is a no-op (one NUMA node)")) << log.text();
  EXPECT_TRUE(log.contains("memory binding is a no-op (one NUMA node)")) << log.text();
  std::vector<char> buffer(4096);
  bind_memory(buffer.data(), buffer.size());  // callable, does nothing
  // The hooks plug into the ThreadPool sized by the placement.
  std::atomic<int> started{0};
  {
    auto pool =
        ThreadPool::create({.threads = placement.worker_threads, .on_worker_start = [&](std::size_t w) {
                              bind_worker(w);
                              started.fetch_add(1);
                            }});
    ASSERT_TRUE(pool.ok()) << pool.status();
  }
  EXPECT_EQ(started.load(), static_cast<int>(placement.worker_threads));
}

TEST(Topology, SyntheticTwoNodeMachine) {
  auto topo = Topology::synthetic("pack:2 [numa(memory=1073741824)] core:4 pu:2");
  ASSERT_TRUE(topo.ok()) << topo.status();
  ASSERT_EQ((*topo)->numa_nodes().size(), 2u);
  EXPECT_EQ((*topo)->cores(), 8u);
  EXPECT_EQ((*topo)->pus(), 16u);
  for (const NumaNode& n : (*topo)->numa_nodes()) {
    EXPECT_EQ(n.cores, 4u);
    EXPECT_EQ(n.pus, 8u);
    EXPECT_EQ(n.memory_bytes, kGiB);
  }
  testing::LogCapture log;
  Placement placement = (*topo)->place(nullptr);
  EXPECT_EQ(placement.numa_node, 0u);
  EXPECT_EQ(placement.worker_threads, 4u);
  EXPECT_NE(placement.reason.find("no GPU"), std::string::npos) << placement.reason;
  (*topo)->worker_binder(placement);
  EXPECT_TRUE(log.contains("worker binding is a no-op (synthetic topology)")) << log.text();
}

TEST(Topology, SimDeviceHasNoNodeToBeNear) {
  auto topo = Topology::synthetic("pack:2 [numa(memory=1073741824)] core:2 pu:1");
  ASSERT_TRUE(topo.ok());
  DeviceOptions options;
  options.kind = DeviceChoice::kSim;
  options.budget_bytes = kMiB;
  auto device = make_device(options);
  ASSERT_TRUE(device.ok());
  EXPECT_EQ((*device)->pci_bus_id(), "");
  Placement placement = (*topo)->place(device->get());
  EXPECT_EQ(placement.numa_node, 0u);
  EXPECT_EQ(placement.worker_threads, 2u);
}

TEST(Topology, UnknownPciDeviceIsUnknownWithAReason) {
  auto topo = Topology::discover();
  ASSERT_TRUE(topo.ok());
  std::string why;
  EXPECT_EQ((*topo)->numa_node_of_pci("0000:ff:1f.7", &why), std::nullopt);
  EXPECT_NE(why.find("0000:ff:1f.7"), std::string::npos) << why;
  EXPECT_EQ((*topo)->numa_node_of_pci("", &why), std::nullopt);
  EXPECT_NE(why.find("no PCI bus id"), std::string::npos) << why;
}

TEST(Topology, BadSyntheticDescriptionIsInvalidArgument) {
  auto topo = Topology::synthetic("pack:banana");
  ASSERT_FALSE(topo.ok());
  EXPECT_EQ(topo.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(topo.status().message().find("pack:banana"), std::string::npos) << topo.status();
}

}  // namespace
}  // namespace strata::memory
