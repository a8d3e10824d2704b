// strata-probe's NVMe measurement (measure_nvme in measure.hpp): the --nvme
// directory's checks, the test size, and the one rate measurer's disk passes
// (Note [One rate measurer] in rate_measurer.hpp) with the probe's parameters.
#include <fmt/format.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "measure.hpp"
#include "strata/common/bytes.hpp"

namespace strata::probe {

namespace fs = std::filesystem;

// Note [Probe NVMe test size]
// The probe writes min(--nvme-bytes, half the free space) (whole MiB), in up to
// 16 slots of up to 16 MiB in flight: smaller slots (down to 1 MiB) and fewer in
// flight when that is less than 256 MiB, so --nvme-bytes is honoured as given
// and the size checked up front is the size used (it once wrote at least 256
// MiB whatever --nvme-bytes said, and a disk with 64-256 MiB free passed the
// first check, then failed creating the swap file). Below kNvmeTestMin (or
// --nvme-bytes, when smaller) there is too little to measure: NoSpace up front.
struct NvmeTestSize {
  std::uint64_t slot_bytes = 0;
  std::uint32_t slots = 0;
  std::size_t in_flight = 0;
};
constexpr std::uint64_t kNvmeTestMin = 16 * kMiB;

Result<NvmeTestSize> nvme_test_size(const std::string& dir, std::uint64_t bytes_max,
                                    std::uint64_t free_bytes) {
  constexpr std::uint64_t kSlotMax = 16 * kMiB;
  constexpr std::size_t kInFlightMax = 16;
  const std::uint64_t bytes = align_down(std::min(bytes_max, free_bytes / 2), kMiB);
  const std::uint64_t needed = std::min(align_down(bytes_max, kMiB), kNvmeTestMin);
  if (bytes < needed || bytes == 0) {
    return no_space(
        "--nvme {}: only {} free; the probe writes min(--nvme-bytes, half the free space) and needs at least "
        "{} of it to measure (twice that free): free space, name another directory, or lower --nvme-bytes",
        dir, format_bytes(free_bytes), format_bytes(std::max(needed, kMiB)));
  }
  NvmeTestSize t;
  t.slot_bytes = std::clamp(align_down(bytes / kInFlightMax, kMiB), kMiB, kSlotMax);
  t.slots = static_cast<std::uint32_t>(bytes / t.slot_bytes);
  t.in_flight = std::min<std::size_t>(kInFlightMax, t.slots);
  return t;
}

namespace {

// The --nvme directory's checks before anything is written: it exists, is a
// writable directory on a writable file system. Returns its free bytes.
Result<std::uint64_t> nvme_free_bytes(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return not_found("--nvme {}: no such directory; create it or name another", dir);
  if (!fs::is_directory(dir, ec)) return invalid_argument("--nvme {}: not a directory", dir);
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return errno_status(errno, fmt::format("--nvme {}: statvfs", dir));
  if ((vfs.f_flag & ST_RDONLY) != 0) {
    return permission_denied("--nvme {}: the file system is mounted read-only; name a writable directory",
                             dir);
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    return permission_denied("--nvme {}: not writable by this user; name a writable directory", dir);
  }
  return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

}  // namespace

// Note [Probe disk rounds]: the rounds each NVMe rate is the median of.
constexpr int kDiskRounds = 3;

Result<NvmeInfo> measure_nvme(const std::string& dir, std::uint64_t bytes_max, double seconds_max,
                              std::size_t optimizer_threads, rates::RateMeasurer& measurer) {
  NvmeInfo info;
  info.path = dir;
  STRATA_ASSIGN_OR_RETURN(info.free_bytes, nvme_free_bytes(dir));
  // Note [Probe NVMe test size]: what is checked here is what is written.
  STRATA_ASSIGN_OR_RETURN(const NvmeTestSize size, nvme_test_size(dir, bytes_max, info.free_bytes));
  STRATA_ASSIGN_OR_RETURN(const rates::DiskFacts facts,
                          measurer.measure_disk({.dir = fs::path(dir),
                                                 .slot_bytes = size.slot_bytes,
                                                 .slots = size.slots,
                                                 .in_flight = static_cast<std::uint32_t>(size.in_flight),
                                                 .statistic = rates::Statistic::kMedian,
                                                 .rounds = kDiskRounds,
                                                 .warm_up = rates::DiskWarmUp::kWrite,
                                                 .mixed = rates::MixedPass::kPipeline,
                                                 .pass_seconds_max = seconds_max,
                                                 .pipeline_threads = optimizer_threads,
                                                 .context = fmt::format("--nvme {}", dir)}));
  info.engine = facts.engine;
  info.direct_io = facts.direct_io;
  info.bytes_tested = facts.bytes_tested;
  return info;
}

}  // namespace strata::probe
