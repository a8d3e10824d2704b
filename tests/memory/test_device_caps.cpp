// Devices say what they can do (issue #26): the capability table the runtime asks
// instead of switching on Device::kind().
#include <gtest/gtest.h>

#include "strata/memory/device_caps.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::memory {
namespace {

TEST(DeviceCaps, SimIsHostMemoryAndRunsEveryOptimizerOnTheHost) {
  const DeviceCaps c = device_caps(DeviceKind::kSim);
  EXPECT_TRUE(c.host_addressable);
  EXPECT_FALSE(c.optimizer_kernels);
  EXPECT_TRUE(c.layerwise_optimizers);
  EXPECT_FALSE(c.cuda_memory);
}

TEST(DeviceCaps, CudaIsDeviceMemoryWithKernelsButNotLayerwiseOnes) {
  const DeviceCaps c = device_caps(DeviceKind::kCuda);
  EXPECT_FALSE(c.host_addressable);
  EXPECT_TRUE(c.optimizer_kernels);
  EXPECT_FALSE(c.layerwise_optimizers);
  EXPECT_TRUE(c.cuda_memory);
}

TEST(DeviceCaps, ADeviceAnswersForItsBackend) {
  DeviceOptions o;
  o.kind = DeviceChoice::kSim;
  o.budget_bytes = 16u << 20;
  auto d = make_device(o);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(device_caps(**d).host_addressable);
}

}  // namespace
}  // namespace strata::memory
