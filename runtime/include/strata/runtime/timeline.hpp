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
// creation. The buffer is bounded (events_max) and reserved whole at creation
// (pages are touched only as spans arrive); once full, further spans are
// counted as dropped and the export says so. Recording a span allocates
// nothing: its name is a SpanName, formatted only by the export (Note
// [Allocation-free hot paths] in runtime/src/leases.cpp).

#include <array>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
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

//! A span's name, kept unformatted so that recording it allocates nothing:
//! "<label>[ f<family>][ <detail>]" in the export. `label` and `detail` must
//! point to storage that outlives the timeline (string literals, state_kind_name()).
struct SpanName {
  std::string_view label;
  std::int64_t family = -1;  //!< the chunk family it concerns; -1: none
  std::string_view detail;   //!< e.g. the state kind; empty: none
  //! The export's text.
  std::string str() const;
};

//! Thread-safe recorder. Cheap: one mutex-protected append per span.
class Timeline {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Timeline(std::size_t events_max = 1u << 18);

  //! Microseconds since creation.
  double now_us() const;
  //! Records a finished span [start_us, end_us) on `track` with `bytes` of work.
  void add(Track track, SpanName name, double start_us, double end_us, std::uint64_t bytes);
  //! Adds host time spent waiting inside acquire().
  void add_stall(double seconds);

  TrackStats stats(Track track) const;
  double stall_s() const;
  std::uint64_t dropped() const;
  //! Spans kept since the last reset().
  std::uint64_t recorded() const;
  //! Zeroes counters and drops recorded spans (e.g. after the warm-up step).
  void reset();

  //! Writes the spans as Chrome trace JSON to `path`. Fails with an errno Status naming the path.
  Status write_chrome_trace(const std::string& path) const;
  //! The same JSON as a string.
  std::string chrome_trace_json() const;

 private:
  struct Span {
    Track track;
    SpanName name;
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
