// Note [Checkpoint overlap in the step benchmark]
// After the run's steady steps, strata-bench step runs 2 x --steps more,
// alternating: a step with an overlapped save begun just before it
// (Runtime::begin_checkpoint, whose own time counts in the step), then a step
// without one. Each step's time is the wall time from before its forward (or the
// begin) to the end of step(); the save is then waited for (untimed), so every
// "without" step starts with no save in flight. checkpoint_overlap_slowdown is
// the median of the first kind over the median of the second: what a save costs
// the step it overlaps. The save writes the whole model (params and AdamW
// states, from host and NVMe) into a directory of its own under the temp dir.
#include "step_checkpoint.hpp"

#include <unistd.h>

#include <algorithm>

#include "registry.hpp"
#include "strata/common/log.hpp"

namespace strata::bench {

namespace fs = std::filesystem;

Result<std::unique_ptr<CheckpointOverlap>> CheckpointOverlap::create() {
  std::unique_ptr<CheckpointOverlap> c(new CheckpointOverlap());
  c->dir_ = fs::temp_directory_path() / fmt::format("strata-bench-step-ckpt-{}", ::getpid());
  std::error_code ec;
  fs::remove_all(c->dir_, ec);
  fs::create_directories(c->dir_, ec);
  if (ec) {
    return errno_status(ec.value(), fmt::format("creating the checkpoint directory {}", c->dir_.string()));
  }
  return c;
}

CheckpointOverlap::~CheckpointOverlap() {
  if (dir_.empty()) return;
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

Status CheckpointOverlap::before_step(runtime::Runtime& rt, int i) {
  t0_ = std::chrono::steady_clock::now();
  if (i % 2 == 0) {
    save_t0_ = t0_;
    STRATA_RETURN_IF_ERROR(rt.begin_checkpoint(dir_.string()));
  }
  return Status::Ok();
}

Status CheckpointOverlap::after_step(runtime::Runtime& rt, int i) {
  const auto t1 = std::chrono::steady_clock::now();
  (i % 2 == 0 ? with_ : without_).push_back(std::chrono::duration<double>(t1 - t0_).count());
  if (i % 2 == 0) {
    STRATA_RETURN_IF_ERROR(rt.finish_checkpoint());
    save_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - save_t0_).count());
    std::uint64_t bytes = 0;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir_, ec)) bytes += e.file_size(ec);
    bytes_ = bytes;
  }
  return Status::Ok();
}

double CheckpointOverlap::with_save_s() const {
  return median(with_);
}
double CheckpointOverlap::without_save_s() const {
  return median(without_);
}
double CheckpointOverlap::slowdown() const {
  return without_save_s() > 0 ? with_save_s() / without_save_s() : 0.0;
}
double CheckpointOverlap::save_s() const {
  return median(save_);
}

}  // namespace strata::bench
