#pragma once
// strata-bench step's checkpoint_overlap_slowdown: the step time with an
// overlapped save in flight against the step time without, measured in the same
// run, interleaved (Note [Checkpoint overlap in the step benchmark] in
// step_checkpoint.cpp).

#include <chrono>
#include <filesystem>
#include <memory>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::bench {

class CheckpointOverlap {
 public:
  //! Saves go to a fresh directory of their own (not inside the NVMe swap directory).
  static Result<std::unique_ptr<CheckpointOverlap>> create();
  CheckpointOverlap(const CheckpointOverlap&) = delete;
  CheckpointOverlap& operator=(const CheckpointOverlap&) = delete;
  ~CheckpointOverlap();

  //! Sets the number of steps without a save run after each save (--steps).
  void set_steps_between(int steps) { between_ = steps; }
  //! True once every save and the steps after it have run.
  bool done() const { return saves_done_ == kSaves && since_save_ >= between_; }
  //! Before a step: starts a save when none is in flight and the steps without one
  //! since the last are done (begin_checkpoint counted in the step's time); notes
  //! whether this step overlaps a save; starts the clock.
  Status before_step(runtime::Runtime& rt);
  //! After the step's step(): stops the clock and files the step as with or without
  //! a save; a save no longer in flight is finished (finish_checkpoint, untimed: it
  //! returns at once) and its error returned.
  Status after_step(runtime::Runtime& rt);

  //! Mean time of every step that began while a save was in flight / median without.
  double slowdown() const;
  //! Median time of the first step of each save / median without (what a save costs
  //! the step it is begun before).
  double first_step_slowdown() const;
  double with_save_s() const;
  double without_save_s() const;
  double worst_with_save_s() const;
  //! Steps that began while a save was in flight, over all saves.
  std::size_t steps_with_save() const { return with_.size(); }
  //! Seconds a save took (begin to the end of the step it was seen done after), median.
  double save_s() const;
  //! Seconds begin_checkpoint itself took, median (part of the first "with" step).
  double begin_s() const;
  std::uint64_t checkpoint_bytes() const { return bytes_; }
  const std::filesystem::path& dir() const { return dir_; }
  //! Saves measured.
  static constexpr int kSaves = 2;
  //! A save that spans more steps than this is reported as an error.
  static constexpr int kMaxStepsPerSave = 64;

 private:
  CheckpointOverlap() = default;
  std::filesystem::path dir_;
  std::chrono::steady_clock::time_point t0_, save_t0_;
  std::vector<double> with_, first_with_, without_, save_, begin_;
  std::uint64_t bytes_ = 0;
  int between_ = 4;
  int saves_done_ = 0;
  int since_save_ = 0;       // steps without a save since the last finished
  int steps_this_save_ = 0;  // steps begun while the current save was in flight
  bool in_flight_ = false;   // a save begun and not yet seen done
  bool this_step_with_ = false;
};

}  // namespace strata::bench
