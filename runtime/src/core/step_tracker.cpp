// StepTracker: following the adopted trace, compute time per use, step counters
// (step_tracker.hpp).
#include "core/step_tracker.hpp"

#include <algorithm>

#include "strata/common/log.hpp"

namespace strata::runtime {

void StepTracker::note_use(FamilyId family, Phase phase, bool writes_grad) {
  tracer_.record(family, phase, writes_grad);
  if (!following_) return;
  const auto& uses = plan_trace_.uses;
  auto matches = [&](std::size_t p) {
    return p < uses.size() && uses[p].family == family && uses[p].phase == phase;
  };
  if (pos_ != kBeforeFirst && matches(pos_)) return;  // same use
  if (matches(next_position())) {
    pos_ = next_position();
    return;
  }
  STRATA_LOG_DEBUG(
      "runtime: step {} departs from the trace at use {} (family {} {}); on-demand moves and "
      "LRU eviction for the rest of the step, re-plan after it",
      step_index_ + 1, next_position(), family, phase == Phase::kForward ? "forward" : "backward");
  following_ = false;
  deviated_ = true;
}

std::size_t StepTracker::current_use() const {
  return tracer_.trace().uses.empty() ? 0 : tracer_.trace().uses.size() - 1;
}

void StepTracker::add_compute(std::size_t use, double seconds) {
  std::lock_guard lock(compute_mu_);
  if (compute_by_use_.size() <= use) compute_by_use_.resize(use + 1, 0.0);
  compute_by_use_[use] += seconds;
}

StepTrace StepTracker::take_trace() {
  StepTrace trace = tracer_.take();
  std::lock_guard g(compute_mu_);
  for (std::size_t i = 0; i < trace.uses.size() && i < compute_by_use_.size(); ++i) {
    trace.uses[i].compute_s = compute_by_use_[i];
  }
  compute_by_use_.clear();
  return trace;
}

void StepTracker::adopt(StepTrace trace, std::size_t family_count) {
  plan_trace_ = std::move(trace);
  next_use_ = NextUse(plan_trace_.uses, family_count);
}

void StepTracker::refresh(StepTrace trace) {
  if (trace.uses.size() == plan_trace_.uses.size()) std::swap(plan_trace_, trace);
  tracer_.give_back(std::move(trace));  // its room records a later step
}

void StepTracker::abandon_step() {
  tracer_.give_back(take_trace());  // its room records the next step
  begin_step();
}

void StepTracker::begin_step() {
  following_ = warm_;
  deviated_ = false;
  pos_ = kBeforeFirst;
  in_backward_ = false;
}

void StepTracker::finish_stats(StepStats& stats, std::uint64_t gpu_high_water) {
  ++step_index_;
  stats.step = step_index_;
  const double now = core_.timeline.now_us();
  stats.step_s = (now - step_start_us_) * 1e-6;
  step_start_us_ = now;
  const memory::CopyStats h2d = core_.device.copy_stats(memory::CopyKind::kHostToDevice);
  const memory::CopyStats d2h = core_.device.copy_stats(memory::CopyKind::kDeviceToHost);
  stats.bytes_h2d = h2d.bytes - prev_h2d_bytes_;
  stats.bytes_d2h = d2h.bytes - prev_d2h_bytes_;
  prev_h2d_bytes_ = h2d.bytes;
  prev_d2h_bytes_ = d2h.bytes;
  stats.bytes_disk_read_param_uses = core_.param_use_read_bytes - prev_param_use_reads_;
  stats.bytes_disk_read_param_updates = core_.param_update_read_bytes - prev_param_update_reads_;
  prev_param_use_reads_ = core_.param_use_read_bytes;
  prev_param_update_reads_ = core_.param_update_read_bytes;
  for (std::size_t t = 0; t < kTrackCount; ++t) {
    TrackStats ts = core_.timeline.stats(static_cast<Track>(t));
    stats.busy_s[t] = ts.busy_s - prev_tracks_[t].busy_s;
    if (static_cast<Track>(t) == Track::kDiskRead) stats.bytes_disk_read = ts.bytes - prev_tracks_[t].bytes;
    if (static_cast<Track>(t) == Track::kDiskWrite) stats.bytes_disk_write = ts.bytes - prev_tracks_[t].bytes;
    prev_tracks_[t] = ts;
  }
  const double stall = core_.timeline.stall_s();
  stats.stall_s = stall - prev_stall_s_;
  prev_stall_s_ = stall;
  stats.gpu_high_water_bytes = gpu_high_water;
  stats.host_high_water_bytes = core_.host->high_water_bytes();
  stats.nvme_bytes = core_.nvme.is_open() ? core_.nvme.store().used_bytes() : 0;
  ErrorState::PrefetchCount prefetches = core_.errors.take_prefetch_count();
  stats.prefetch_errors = prefetches.count;
  stats.first_prefetch_error = std::move(prefetches.first);
}

}  // namespace strata::runtime
