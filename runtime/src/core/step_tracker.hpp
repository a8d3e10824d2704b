#pragma once
// StepTracker: where the step is against the plan. It owns the Tracer (this
// step's uses), the adopted trace and its next-use index, the position in it and
// whether the step still follows it, the step counter, the compute time measured
// per use and the per-step deltas of the counters behind StepStats. It calls
// nothing but Core's timeline and the device's copy counters; Residency reads its
// position (eviction and prefetch); Runtime::Impl adopts plans into it.

#include <cstdint>
#include <mutex>
#include <vector>

#include "core/core.hpp"
#include "strata/runtime/stats.hpp"
#include "strata/runtime/trace.hpp"

namespace strata::runtime {

class StepTracker {
 public:
  explicit StepTracker(Core& core) : core_(core) {}

  //! Records a use by the training thread and checks it against the adopted
  //! trace; a use the trace does not predict ends following it for the step.
  void note_use(FamilyId family, Phase phase, bool writes_grad);
  //! The latest use recorded this step (launch() attributes compute time to it).
  std::size_t current_use() const;
  //! Adds measured compute time to use `use`; takes its own lock, never mu
  //! (compute-stream callbacks call it).
  void add_compute(std::size_t use, double seconds);
  //! Takes this step's trace with the compute time measured per use.
  StepTrace take_trace();
  //! Makes `trace` the one later steps follow.
  void adopt(StepTrace trace, std::size_t family_count);
  //! Keeps the freshest compute times when the step followed the trace.
  void refresh(StepTrace trace);
  //! Starts the next step: following the plan once one was traced.
  void begin_step();
  //! Forgets the uses of a discarded step and starts the next (Note [Failed steps]).
  void abandon_step();
  //! Fills the counters of `stats` (deltas since the last call) and advances the step counter.
  void finish_stats(StepStats& stats, std::uint64_t gpu_high_water);

  //! The step follows the adopted trace so far (prefetch and Belady apply).
  bool following() const { return following_; }
  //! The step departed from the trace (a re-plan follows it).
  bool deviated() const { return deviated_; }
  //! A traced step has been planned.
  bool warm() const { return warm_; }
  void set_warm() { warm_ = true; }
  //! Position in the adopted trace (0 before the first use).
  std::size_t here() const { return pos_ == kBeforeFirst ? 0 : pos_; }
  //! The position of the next use.
  std::size_t next_position() const { return pos_ == kBeforeFirst ? 0 : pos_ + 1; }
  const StepTrace& plan_trace() const { return plan_trace_; }
  const NextUse& next_use() const { return next_use_; }
  //! The step in progress is the (step_index() + 1)th.
  std::uint64_t step_index() const { return step_index_; }
  //! Backward has begun (a gradient was acquired) in this micro-batch.
  bool in_backward() const { return in_backward_; }
  void set_in_backward(bool b) { in_backward_ = b; }

 private:
  static constexpr std::size_t kBeforeFirst = SIZE_MAX;
  Core& core_;
  Tracer tracer_;
  StepTrace plan_trace_;
  NextUse next_use_;
  std::size_t pos_ = kBeforeFirst;  //!< position in plan_trace_
  bool following_ = false;          //!< this step follows the plan's trace so far
  bool deviated_ = false;
  bool in_backward_ = false;
  bool warm_ = false;
  std::uint64_t step_index_ = 0;
  double step_start_us_ = 0.0;
  std::uint64_t prev_h2d_bytes_ = 0, prev_d2h_bytes_ = 0;
  std::uint64_t prev_param_use_reads_ = 0, prev_param_update_reads_ = 0;
  TrackStats prev_tracks_[kTrackCount] = {};
  double prev_stall_s_ = 0.0;
  std::mutex compute_mu_;               //!< guards compute_by_use_ (Note [Lock discipline])
  std::vector<double> compute_by_use_;  //!< measured compute seconds per traced use this step
};

}  // namespace strata::runtime
