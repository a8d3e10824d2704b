#pragma once
// Observability: per-link counters, acquire stall time, and the step timeline as
// Chrome trace JSON (opens in Perfetto or chrome://tracing).
//
// Note [Busy time]
// Spans on one track may overlap (several NVMe requests in flight, two families'
// optimizer steps at once). A resource's busy time is the union of its spans,
// not their sum, so each track keeps a watermark: a span adds only the part that
// ends after the latest end seen so far.
//
// Each resource is one track: compute, h2d, d2h, cpu optimizer, disk read, disk
// write. Spans are recorded with start/end in microseconds since the timeline's
// creation. The buffer is bounded (events_max); once full, further spans are
// counted as dropped and the export says so.

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "strata/common/status.hpp"

namespace strata::runtime {

//! Resources with their own track and busy-time counter.
enum class Track : std::uint8_t {
  kCompute,
  kH2D,
  kD2H,
  kCpuOptimizer,
  kGpuOptimizer,
  kDiskRead,
  kDiskWrite,
  kCount
};
inline constexpr std::size_t kTrackCount = static_cast<std::size_t>(Track::kCount);

//! "compute", "h2d", "d2h", "cpu_optimizer", "gpu_optimizer", "disk_read", "disk_write".
std::string_view track_name(Track track);

//! Counters of one track.
struct TrackStats {
  std::uint64_t bytes = 0;  //!< bytes moved (links, disk) or elements updated (optimizers)
  double busy_s = 0.0;      //!< time the resource was busy: the union of its spans (Note [Busy time])
  std::uint64_t spans = 0;
};

//! Thread-safe recorder. Cheap: one mutex-protected append per span.
class Timeline {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Timeline(std::size_t events_max = 1u << 20);

  //! Microseconds since creation.
  double now_us() const;
  //! Records a finished span [start_us, end_us) on `track` with `bytes` of work.
  void add(Track track, std::string name, double start_us, double end_us, std::uint64_t bytes);
  //! Adds host time spent waiting inside acquire().
  void add_stall(double seconds);

  TrackStats stats(Track track) const;
  double stall_s() const;
  std::uint64_t dropped() const;
  //! Zeroes counters and drops recorded spans (e.g. after the warm-up step).
  void reset();

  //! Writes the spans as Chrome trace JSON to `path`. Fails with an errno Status naming the path.
  Status write_chrome_trace(const std::string& path) const;
  //! The same JSON as a string.
  std::string chrome_trace_json() const;

 private:
  struct Span {
    Track track;
    std::string name;
    double start_us;
    double end_us;
    std::uint64_t bytes;
  };
  const Clock::time_point origin_;
  const std::size_t events_max_;
  mutable std::mutex mutex_;
  std::vector<Span> spans_;
  std::array<TrackStats, kTrackCount> stats_{};
  std::array<double, kTrackCount> busy_until_us_{};
  double stall_s_ = 0.0;
  std::uint64_t dropped_ = 0;
};

}  // namespace strata::runtime
