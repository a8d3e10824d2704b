// The peaks behind strata-bench step's lower bound (Note [Rates lower bound]):
// every rate is measured and positive, the copy peaks respect the sim device's
// throttle, and the directory is left as it was.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "step_rates.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::bench {
namespace {

namespace fs = std::filesystem;

TEST(StepRates, MeasuresEveryPeakWithinTheThrottle) {
  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = 64 * kMiB;
  dopt.h2d_bytes_per_s = 2 * kGiB;
  dopt.d2h_bytes_per_s = 1 * kGiB;
  auto device = memory::make_device(dopt);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  auto dir = ScratchDir::create(fs::temp_directory_path(), "strata-test-step-rates");
  ASSERT_TRUE(dir.ok()) << dir.status().to_string();

  auto peaks = measure_peaks(**device, {.chunk_bytes = 4 * kMiB,
                                        .dir = dir->path(),
                                        .threads = 2,
                                        .repeats = 1,
                                        .disk_slots = 4,
                                        .disk_in_flight = 2});
  ASSERT_TRUE(peaks.ok()) << peaks.status().to_string();
  // The throttle can only slow copies down (a little over it: timer granularity).
  EXPECT_GT(peaks->rates.h2d_bytes_per_s, 0);
  EXPECT_LE(peaks->rates.h2d_bytes_per_s, 1.05 * 2 * kGiB);
  EXPECT_GT(peaks->rates.d2h_bytes_per_s, 0);
  EXPECT_LE(peaks->rates.d2h_bytes_per_s, 1.05 * 1 * kGiB);
  EXPECT_GT(peaks->rates.disk_read_bytes_per_s, 0);
  EXPECT_GT(peaks->rates.disk_write_bytes_per_s, 0);
  EXPECT_GT(peaks->rates.disk_mixed_bytes_per_s, 0);
  EXPECT_GT(peaks->rates.cpu_optim_params_per_s, 0);
  EXPECT_GT(peaks->rates.host_memory_bytes_per_s, 0);
  EXPECT_FALSE(peaks->disk.engine.empty());
  EXPECT_TRUE(fs::is_empty(dir->path())) << "the swap file was left behind";
}

TEST(StepRates, RejectsAnUnalignedChunk) {
  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = 16 * kMiB;
  auto device = memory::make_device(dopt);
  ASSERT_TRUE(device.ok());
  auto peaks = measure_peaks(**device, {.chunk_bytes = 1000, .dir = fs::temp_directory_path()});
  EXPECT_FALSE(peaks.ok());
}

}  // namespace
}  // namespace strata::bench
