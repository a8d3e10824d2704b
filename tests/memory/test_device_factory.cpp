// make_device(): backend choice, its logged reason, and option validation.

#include <gtest/gtest.h>

#include "memory/test_util.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::memory {
namespace {

TEST(DeviceFactory, AutoPicksSimHereAndLogsWhy) {
  testing::LogCapture log;
  DeviceOptions options;  // kind = auto
  options.budget_bytes = 64 * kMiB;
  std::string why;
  auto device = make_device(options, &why);
  ASSERT_TRUE(device.ok()) << device.status();
  if ((*device)->kind() == DeviceKind::kCuda) GTEST_SKIP() << "a usable GPU is present; auto picked cuda";
  EXPECT_EQ(why.rfind("no usable GPU: ", 0), 0u) << why;
  EXPECT_EQ((*device)->kind(), DeviceKind::kSim);
  const std::string text = log.text();
  EXPECT_NE(text.find("device: sim (no usable GPU: "), std::string::npos) << text;
  // The reason comes from the cuda backend: no driver, no device, or not built with CUDA.
  const bool has_reason = text.find("CUDA") != std::string::npos || text.find("cuda") != std::string::npos;
  EXPECT_TRUE(has_reason) << text;
}

TEST(DeviceFactory, ForcedSimLogsThatItWasAskedFor) {
  testing::LogCapture log;
  DeviceOptions options;
  ASSERT_TRUE(options.set("kind", "sim").ok());
  ASSERT_TRUE(options.set("budget", "32MiB").ok());
  auto device = make_device(options);
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ((*device)->kind(), DeviceKind::kSim);
  EXPECT_EQ((*device)->memory_info().budget_bytes, 32 * kMiB);
  EXPECT_TRUE(log.contains("device.kind=sim was asked for")) << log.text();
}

TEST(DeviceFactory, ForcedCudaWithoutGpuIsUnavailableAndSaysWhatToDo) {
  DeviceOptions options;
  options.kind = DeviceChoice::kCuda;
  options.budget_bytes = 64 * kMiB;
  auto device = make_device(options);
  if (device.ok()) GTEST_SKIP() << "a usable GPU is present: " << (*device)->name();
  EXPECT_EQ(device.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(device.status().message().find("device.kind=sim"), std::string::npos) << device.status();
  EXPECT_NE(device.status().message().find("driver"), std::string::npos) << device.status();
}

TEST(DeviceFactory, ZeroBudgetNamesTheSetting) {
  DeviceOptions options;
  options.kind = DeviceChoice::kSim;
  options.budget_bytes = 0;
  auto device = make_device(options);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(device.status().message().find("device.budget = 0"), std::string::npos) << device.status();
}

TEST(DeviceFactory, BudgetLargerThanTheMachineIsRefused) {
  DeviceOptions options;
  ASSERT_TRUE(options.set("kind", "sim").ok());
  ASSERT_TRUE(options.set("budget", "64TiB").ok());
  auto device = make_device(options);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(device.status().message().find("device.budget = 64.00 TiB"), std::string::npos)
      << device.status();
  EXPECT_NE(device.status().message().find("RAM"), std::string::npos) << device.status();
}

TEST(DeviceFactory, MalformedSizesAndUnknownSettingsNameTheSetting) {
  DeviceOptions options;
  Status s = options.set("budget", "12XB");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("device.budget"), std::string::npos) << s;
  EXPECT_NE(s.message().find("12XB"), std::string::npos) << s;
  s = options.set("h2d_bandwidth", "fast");
  EXPECT_NE(s.message().find("device.h2d_bandwidth"), std::string::npos) << s;
  s = options.set("kind", "tpu");
  EXPECT_NE(s.message().find("auto, sim or cuda"), std::string::npos) << s;
  s = options.set("budgte", "1GiB");
  EXPECT_NE(s.message().find("device.budgte"), std::string::npos) << s;
  s = options.set("stream_queue_depth", "-3");
  EXPECT_NE(s.message().find("device.stream_queue_depth"), std::string::npos) << s;
  ASSERT_TRUE(options.set("stream_queue_depth", "0").ok());
  s = options.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("device.stream_queue_depth = 0"), std::string::npos) << s;
}

// Issue 16: a throttle of 1 KiB/s made one chunk's copy take hours (a hang to the user).
TEST(DeviceFactory, CopyThrottleIsZeroOrAtLeastTheMinimum) {
  DeviceOptions options;
  options.kind = DeviceChoice::kSim;
  options.budget_bytes = 64 * kMiB;
  ASSERT_TRUE(options.set("d2h_bandwidth", "1k").ok());
  Status s = options.validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("device.d2h_bandwidth"), std::string::npos) << s;
  options.d2h_bytes_per_s = 0;  // unthrottled
  EXPECT_TRUE(options.validate().ok());
  options.d2h_bytes_per_s = kSimBandwidthMinBytesPerS;
  EXPECT_TRUE(options.validate().ok());
}

TEST(DeviceFactory, SetParsesEverySetting) {
  DeviceOptions options;
  ASSERT_TRUE(options.set("kind", "auto").ok());
  ASSERT_TRUE(options.set("budget", "1.5GiB").ok());
  ASSERT_TRUE(options.set("h2d_bandwidth", "16GiB").ok());
  ASSERT_TRUE(options.set("d2h_bandwidth", "12GiB").ok());
  ASSERT_TRUE(options.set("d2d_bandwidth", "0").ok());
  ASSERT_TRUE(options.set("stream_queue_depth", "8").ok());
  ASSERT_TRUE(options.set("streams_max", "3").ok());
  ASSERT_TRUE(options.set("cuda_ordinal", "1").ok());
  EXPECT_EQ(options.budget_bytes, 3 * kGiB / 2);
  EXPECT_EQ(options.h2d_bytes_per_s, 16 * kGiB);
  EXPECT_EQ(options.d2h_bytes_per_s, 12 * kGiB);
  EXPECT_EQ(options.d2d_bytes_per_s, 0u);
  EXPECT_EQ(options.stream_queue_depth, 8u);
  EXPECT_EQ(options.streams_max, 3u);
  EXPECT_EQ(options.cuda_ordinal, 1);
  EXPECT_TRUE(options.validate().ok());
}

}  // namespace
}  // namespace strata::memory
