// Note [Checkpoint overlap in the step benchmark]
// After the run's steady steps, strata-bench step measures kSaves overlapped
// saves. Each is begun (Runtime::begin_checkpoint, its own time counted in the
// step) just before a step; steps then run as training would, and every step that
// begins while the save is still in flight (checkpoint_in_flight() true after the
// previous step) is a "with" step: a save spread over several steps is charged to
// all of them. Once it is seen done, finish_checkpoint returns at once and
// --steps steps without a save follow before the next save begins. Each step's
// time is the wall time from before its forward (or the begin) to the end of
// step(). checkpoint_overlap_slowdown is the mean of every "with" step over the
// median of the "without" steps; first_step_slowdown is the first "with" step of
// each save (median) over the same. The save writes the whole model (params and
// AdamW states, from host and NVMe) into a directory of its own under the temp dir.
#include "step_checkpoint.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <string>
#include <string_view>

#include "registry.hpp"
#include "strata/common/log.hpp"

namespace strata::bench {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kDirPrefix = "strata-bench-step-ckpt-";

// Note [Step checkpoint leftovers]
// The saves are named files (a checkpoint is what they measure), so unlike swap
// files they cannot be unlinked while in use, and a killed run leaves its
// directory (1.5 GB at the default model). Each run's directory is named by its
// pid; a run removes the directories of runs whose process is gone (kill(pid, 0)
// fails with ESRCH) before it writes its own, so a killed run's saves live until
// the next run, never longer. A live run's directory is never touched.
void reclaim_dead_runs(const fs::path& parent) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with(kDirPrefix)) continue;
    const std::string digits = name.substr(kDirPrefix.size());
    if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    const long pid = std::strtol(digits.c_str(), nullptr, 10);
    if (pid <= 0 || pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    STRATA_LOG_INFO("strata-bench step: removed {}, the checkpoint directory of a run that ended without it",
                    e.path().string());
  }
}

}  // namespace

Result<std::unique_ptr<CheckpointOverlap>> CheckpointOverlap::create() {
  std::unique_ptr<CheckpointOverlap> c(new CheckpointOverlap());
  reclaim_dead_runs(fs::temp_directory_path());  // Note [Step checkpoint leftovers]
  c->dir_ = fs::temp_directory_path() / fmt::format("{}{}", kDirPrefix, ::getpid());
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

Status CheckpointOverlap::before_step(runtime::Runtime& rt) {
  t0_ = std::chrono::steady_clock::now();
  this_step_with_ = in_flight_;
  if (!in_flight_ && saves_done_ < kSaves && (saves_done_ == 0 || since_save_ >= between_)) {
    save_t0_ = t0_;
    STRATA_RETURN_IF_ERROR(rt.begin_checkpoint(dir_.string()));
    begin_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
    in_flight_ = true;
    this_step_with_ = true;
    steps_this_save_ = 0;
  }
  return Status::Ok();
}

Status CheckpointOverlap::after_step(runtime::Runtime& rt) {
  const auto t1 = std::chrono::steady_clock::now();
  const double s = std::chrono::duration<double>(t1 - t0_).count();
  if (!this_step_with_) {
    without_.push_back(s);
    ++since_save_;
    return Status::Ok();
  }
  with_.push_back(s);
  if (steps_this_save_++ == 0) first_with_.push_back(s);
  STRATA_ASSIGN_OR_RETURN(const bool running, rt.checkpoint_in_flight());
  if (running) {
    if (steps_this_save_ >= kMaxStepsPerSave)
      return failed_precondition(
          "strata-bench step: the checkpoint save into {} still runs after {} steps; the disk cannot keep up",
          dir_.string(), steps_this_save_);
    return Status::Ok();
  }
  STRATA_RETURN_IF_ERROR(rt.finish_checkpoint());
  save_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - save_t0_).count());
  in_flight_ = false;
  ++saves_done_;
  since_save_ = 0;
  std::uint64_t bytes = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) bytes += e.file_size(ec);
  bytes_ = bytes;
  return Status::Ok();
}

double CheckpointOverlap::with_save_s() const {
  double sum = 0;
  for (double s : with_) sum += s;
  return with_.empty() ? 0.0 : sum / static_cast<double>(with_.size());
}
double CheckpointOverlap::worst_with_save_s() const {
  return with_.empty() ? 0.0 : *std::max_element(with_.begin(), with_.end());
}
double CheckpointOverlap::without_save_s() const {
  return median(without_);
}
double CheckpointOverlap::slowdown() const {
  return without_save_s() > 0 ? with_save_s() / without_save_s() : 0.0;
}
double CheckpointOverlap::begin_s() const {
  return median(begin_);
}
double CheckpointOverlap::first_step_slowdown() const {
  return without_save_s() > 0 ? median(first_with_) / without_save_s() : 0.0;
}
double CheckpointOverlap::save_s() const {
  return median(save_);
}

}  // namespace strata::bench
