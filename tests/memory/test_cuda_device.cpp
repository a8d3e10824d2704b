// The cuda backend on a real GPU (label `gpu`). Without a usable GPU every case skips with
// the factory's reason (no driver, no device, or built without CUDA).

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

#include "memory/test_util.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/memory/device_pool.hpp"
#include "strata/memory/pinned_host_pool.hpp"
#include "strata/memory/topology.hpp"

namespace strata::memory {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DeviceOptions options;
    options.kind = DeviceChoice::kCuda;
    options.budget_bytes = 256 * kMiB;
    auto device = make_device(options);
    if (!device.ok()) GTEST_SKIP() << "no usable GPU: " << device.status().message();
    device_ = std::move(device).value();
  }
  std::unique_ptr<Device> device_;
};

TEST_F(CudaDeviceTest, ReportsItself) {
  EXPECT_EQ(device_->kind(), DeviceKind::kCuda);
  EXPECT_NE(device_->name().find("cuda:0"), std::string::npos) << device_->name();
  EXPECT_FALSE(device_->pci_bus_id().empty());
  EXPECT_EQ(device_->memory_info().budget_bytes, 256 * kMiB);
}

TEST_F(CudaDeviceTest, CopiesAreByteExactAndCounted) {
  auto stream = device_->create_stream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  for (std::size_t bytes : {1ul, 7ul, 4096ul, 1000003ul, 64ul * kMiB}) {
    std::vector<std::uint8_t> src(bytes), back(bytes, 0);
    std::iota(src.begin(), src.end(), std::uint8_t{3});
    auto a = device_->allocate(bytes);
    auto b = device_->allocate(bytes);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_TRUE(device_->copy_async(*stream, a->data(), src.data(), bytes, CopyKind::kHostToDevice).ok());
    ASSERT_TRUE(device_->copy_async(*stream, b->data(), a->data(), bytes, CopyKind::kDeviceToDevice).ok());
    ASSERT_TRUE(device_->copy_async(*stream, back.data(), b->data(), bytes, CopyKind::kDeviceToHost).ok());
    ASSERT_TRUE(device_->synchronize(*stream).ok());
    EXPECT_EQ(std::memcmp(back.data(), src.data(), bytes), 0) << bytes;
  }
  ASSERT_TRUE(device_->synchronize().ok());
  CopyStats h2d = device_->copy_stats(CopyKind::kHostToDevice);
  EXPECT_EQ(h2d.copies, 5u);
  EXPECT_GT(h2d.busy_s, 0.0);
  EXPECT_GT(h2d.gib_per_s(), 0.1);
}

TEST_F(CudaDeviceTest, EventOrdersStreamsAndHostFunctionsRunInOrder) {
  auto a = device_->create_stream();
  auto b = device_->create_stream();
  auto event = device_->create_event();
  ASSERT_TRUE(a.ok() && b.ok() && event.ok());
  std::atomic<bool> gate{false};
  std::atomic<bool> a_done{false};
  std::atomic<bool> b_saw{false};
  ASSERT_TRUE(testing::launch_held(*device_, *a, gate, [&] { a_done.store(true); }).ok());
  ASSERT_TRUE(device_->record(*event, *a).ok());
  ASSERT_TRUE(device_->wait(*b, *event).ok());
  ASSERT_TRUE(device_->launch_host(*b, [&] { b_saw.store(a_done.load()); }).ok());
  auto pending = device_->query(*event);
  ASSERT_TRUE(pending.ok());
  EXPECT_FALSE(*pending);
  gate.store(true);
  ASSERT_TRUE(device_->synchronize(*b).ok());
  EXPECT_TRUE(b_saw.load());
}

// Note [Native streams]: a cudaStream_t strata does not own (here one it made, used only by
// its value, and the legacy default stream 0, torch's default) orders against strata's streams.
TEST_F(CudaDeviceTest, NativeStreamOrdersAgainstItsStreams) {
  auto own = device_->create_stream();
  auto other = device_->create_stream();
  auto event = device_->create_event();
  ASSERT_TRUE(own.ok() && other.ok() && event.ok());
  std::atomic<bool> gate{false};
  std::atomic<bool> own_done{false};
  std::atomic<bool> theirs_saw{false};
  ASSERT_TRUE(testing::launch_held(*device_, *own, gate, [&] { own_done.store(true); }).ok());
  ASSERT_TRUE(device_->record(*event, *own).ok());
  ASSERT_TRUE(device_->wait_native(NativeStream{other->native()}, *event).ok());
  ASSERT_TRUE(device_->launch_host(*other, [&] { theirs_saw.store(own_done.load()); }).ok());
  gate.store(true);
  ASSERT_TRUE(device_->synchronize(*other).ok());
  EXPECT_TRUE(theirs_saw.load());
  ASSERT_TRUE(device_->record_native(*event, NativeStream{0}).ok()) << "the legacy default stream";
  ASSERT_TRUE(device_->wait(*own, *event).ok());
  ASSERT_TRUE(device_->synchronize(*own).ok());
}

TEST_F(CudaDeviceTest, HostFunctionsReuseTheirRecords) {
  // launch_host carries each function in a pooled record, given back before the
  // function runs: 51 batches of 16 launches never need more than 16 records.
  auto stream = device_->create_stream();
  ASSERT_TRUE(stream.ok()) << stream.status();
  constexpr int kBatch = 16, kBatches = 51;
  std::atomic<int> ran{0};
  for (int b = 0; b < kBatches; ++b) {
    for (int i = 0; i < kBatch; ++i) {
      ASSERT_TRUE(device_->launch_host(*stream, [&ran] { ran.fetch_add(1); }).ok());
    }
    ASSERT_TRUE(device_->synchronize(*stream).ok());
  }
  EXPECT_EQ(ran.load(), kBatch * kBatches);
  EXPECT_GT(device_->host_function_records(), 0u);
  EXPECT_LE(device_->host_function_records(), static_cast<std::uint64_t>(kBatch));
}

TEST_F(CudaDeviceTest, PinnedPoolRegistersWithCudaAndDevicePoolCarvesOneAllocation) {
  PinnedHostPoolOptions pinned;
  pinned.budget_bytes = 64 * kMiB;
  pinned.slot_bytes = 8 * kMiB;
  pinned.arena_bytes = 16 * kMiB;
  auto host = PinnedHostPool::create(pinned, device_.get());
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ((*host)->pinning(), PinningMode::kCudaRegistered) << (*host)->pinning_reason();
  DevicePoolOptions dev;
  dev.budget_bytes = 64 * kMiB;
  dev.slot_bytes = 8 * kMiB;
  auto pool = DevicePool::create(*device_, dev);
  ASSERT_TRUE(pool.ok()) << pool.status();
  auto stream = device_->create_stream();
  auto host_slot = (*host)->acquire_slot();
  auto dev_slot = (*pool)->acquire_slot();
  ASSERT_TRUE(stream.ok() && host_slot.ok() && dev_slot.ok());
  std::memset(host_slot->data(), 0x42, 8 * kMiB);
  ASSERT_TRUE(
      device_->copy_async(*stream, dev_slot->data(), host_slot->data(), 8 * kMiB, CopyKind::kHostToDevice)
          .ok());
  std::memset(host_slot->data(), 0, 8 * kMiB);
  ASSERT_TRUE(device_->synchronize(*stream).ok());
  ASSERT_TRUE(
      device_->copy_async(*stream, host_slot->data(), dev_slot->data(), 8 * kMiB, CopyKind::kDeviceToHost)
          .ok());
  ASSERT_TRUE(device_->synchronize(*stream).ok());
  EXPECT_EQ(static_cast<int>(host_slot->data()[8 * kMiB - 1]), 0x42);
}

TEST_F(CudaDeviceTest, BudgetLargerThanTheGpuIsInvalidArgument) {
  DeviceOptions options;
  options.kind = DeviceChoice::kCuda;
  options.budget_bytes = 64 * kTiB;
  auto device = make_device(options);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(device.status().message().find("device.budget"), std::string::npos) << device.status();
}

TEST_F(CudaDeviceTest, TopologyFindsTheGpuNode) {
  auto topo = Topology::discover();
  ASSERT_TRUE(topo.ok());
  std::string why;
  auto node = (*topo)->numa_node_of_pci(device_->pci_bus_id(), &why);
  // hwloc may not list the GPU in a container; then the reason must name the bus id.
  if (!node) {
    EXPECT_NE(why.find(device_->pci_bus_id()), std::string::npos) << why;
  }
  Placement placement = (*topo)->place(device_.get());
  EXPECT_GE(placement.worker_threads, 1u);
}

}  // namespace
}  // namespace strata::memory
