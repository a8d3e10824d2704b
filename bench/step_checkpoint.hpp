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

  //! Before step i of the interleaved ones: on even i starts a save (begin_checkpoint,
  //! counted in the step's time); starts the clock.
  Status before_step(runtime::Runtime& rt, int i);
  //! After step i's step(): stops the clock, then waits for the save (not timed).
  Status after_step(runtime::Runtime& rt, int i);

  //! Median step time with a save in flight / median without.
  double slowdown() const;
  double with_save_s() const;
  double without_save_s() const;
  //! Seconds a save took (begin to finish), median.
  double save_s() const;
  std::uint64_t checkpoint_bytes() const { return bytes_; }
  const std::filesystem::path& dir() const { return dir_; }

 private:
  CheckpointOverlap() = default;
  std::filesystem::path dir_;
  std::chrono::steady_clock::time_point t0_, save_t0_;
  std::vector<double> with_, without_, save_;
  std::uint64_t bytes_ = 0;
};

}  // namespace strata::bench
