#include "strata/runtime/timeline.hpp"

#include <fstream>
#include <nlohmann/json.hpp>

namespace strata::runtime {

std::string_view track_name(Track track) {
  switch (track) {
    case Track::kCompute:
      return "compute";
    case Track::kH2D:
      return "h2d";
    case Track::kD2H:
      return "d2h";
    case Track::kCpuOptimizer:
      return "cpu_optimizer";
    case Track::kGpuOptimizer:
      return "gpu_optimizer";
    case Track::kDiskRead:
      return "disk_read";
    case Track::kDiskWrite:
      return "disk_write";
    case Track::kCount:
      break;
  }
  return "unknown";
}

std::string SpanName::str() const {
  std::string s(label);
  if (family >= 0) s += fmt::format(" f{}", family);
  if (!detail.empty()) {
    s += ' ';
    s += detail;
  }
  return s;
}

Timeline::Timeline(std::size_t events_max) : origin_(Clock::now()), events_max_(events_max) {
  spans_.reserve(events_max_);  // once: add() never reallocates
}

double Timeline::now_us() const {
  return std::chrono::duration<double, std::micro>(Clock::now() - origin_).count();
}

void Timeline::add(Track track, SpanName name, double start_us, double end_us, std::uint64_t bytes) {
  std::lock_guard lock(mutex_);
  const auto t = static_cast<std::size_t>(track);
  TrackStats& s = stats_[t];
  s.bytes += bytes;
  const double from = std::max(start_us, busy_until_us_[t]);
  if (end_us > from) s.busy_s += (end_us - from) * 1e-6;
  busy_until_us_[t] = std::max(busy_until_us_[t], end_us);
  s.spans += 1;
  if (spans_.size() >= events_max_) {
    ++dropped_;
    return;
  }
  spans_.push_back(Span{track, name, start_us, end_us, bytes});
}

void Timeline::add_stall(double seconds) {
  std::lock_guard lock(mutex_);
  stall_s_ += seconds;
}

TrackStats Timeline::stats(Track track) const {
  std::lock_guard lock(mutex_);
  return stats_[static_cast<std::size_t>(track)];
}

double Timeline::stall_s() const {
  std::lock_guard lock(mutex_);
  return stall_s_;
}

std::uint64_t Timeline::dropped() const {
  std::lock_guard lock(mutex_);
  return dropped_;
}

std::uint64_t Timeline::recorded() const {
  std::lock_guard lock(mutex_);
  return spans_.size();
}

void Timeline::reset() {
  std::lock_guard lock(mutex_);
  spans_.clear();
  stats_ = {};
  busy_until_us_ = {};
  stall_s_ = 0.0;
  dropped_ = 0;
}

std::string Timeline::chrome_trace_json() const {
  std::lock_guard lock(mutex_);
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t t = 0; t < kTrackCount; ++t) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", t},
                      {"args", {{"name", std::string(track_name(static_cast<Track>(t)))}}}});
  }
  for (const Span& s : spans_) {
    events.push_back({{"name", s.name.str()},
                      {"ph", "X"},
                      {"pid", 1},
                      {"tid", static_cast<int>(s.track)},
                      {"ts", s.start_us},
                      {"dur", s.end_us - s.start_us},
                      {"args", {{"bytes", s.bytes}}}});
  }
  nlohmann::json doc = {{"traceEvents", events},
                        {"displayTimeUnit", "ms"},
                        {"otherData", {{"producer", "strata"}, {"dropped_spans", dropped_}}}};
  return doc.dump();
}

Status Timeline::write_chrome_trace(const std::string& path) const {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return errno_status(errno, fmt::format("opening Chrome trace file {}", path));
  out << chrome_trace_json();
  out.close();
  if (!out) return errno_status(errno, fmt::format("writing Chrome trace file {}", path));
  return Status::Ok();
}

}  // namespace strata::runtime
