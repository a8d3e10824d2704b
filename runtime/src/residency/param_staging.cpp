// Residency: NVMe-homed params and their staging buffers (residency.hpp, Note
// [NVMe-homed params]).
#include <algorithm>
#include <cstring>

#include "core/step_tracker.hpp"
#include "residency/residency.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

bool Residency::needs_staging(const Chunk& c) const {
  return c.kind == StateKind::kParam && c.bytes > 0 && c.family < core_.plan().families.size() &&
         core_.plan().families[c.family].param_home == Tier::kNvme &&
         (c.value == ChunkValue::kNvme || c.absent());
}

bool Residency::staged(const Chunk& c) const {
  return c.family < staging_.size() && staging_[c.family].state == Staging::kReady;
}

std::int64_t Residency::staging_victim(std::size_t window) const {
  const bool planned = tracker_.following() && tracker_.next_use().length() > 0;
  const std::size_t here = tracker_.here();
  // Oldest first; a buffer the optimizer will copy from (Note [NVMe-homed params])
  // only when nothing else can go, and never to a read ahead.
  for (const bool awaited : {false, true}) {
    if (awaited && window > 0) break;
    for (std::size_t i = 0; i < staged_.size(); ++i) {
      const FamilyId f = staged_[i];
      if (staging_[f].state != Staging::kReady) continue;  // its read is in flight
      if (staging_[f].lent > 0) continue;                  // the pipeline copies from it
      if (pipeline_->awaits_staged_param(f) != awaited) continue;
      const Chunk& c = core_.chunk(f, StateKind::kParam);
      if (planned && window > 0 && tracker_.next_use().distance(f, here) <= window) continue;
      if (c.host_read.valid()) {
        auto done = core_.device.query(c.host_read);
        if (!done.ok() || !*done) continue;  // a load still copies from it
      }
      return static_cast<std::int64_t>(i);
    }
  }
  return -1;
}

void Residency::adopt(const Plan& p) {
  staging_max_ = p.param_staging_buffers;
  staging_.resize(p.families.size());
  for (const Chunk& c : core_.chunks()) {
    if (c.kind == StateKind::kParam) staging_buffer_bytes_ = std::max(staging_buffer_bytes_, c.bytes);
  }
}

void Residency::release_staging() {
  for (FamilyId f : staged_) {
    STRATA_CHECK(staging_[f].lent == 0);
    core_.chunk_mut(f, StateKind::kParam).host = nullptr;
  }
  staged_.clear();
  for (std::byte* b : staging_buffers_) core_.host->free(b, staging_buffer_bytes_);
  staging_buffers_.clear();
  staging_free_.clear();
}

void Residency::free_staging(FamilyId f) {
  Chunk& c = core_.chunk_mut(f, StateKind::kParam);
  STRATA_CHECK(staging_[f].state == Staging::kReady && staging_[f].lent == 0);
  staging_free_.push_back(c.host);  // back to the pool
  c.host = nullptr;
  staging_[f].reset();
  staged_.erase(std::find(staged_.begin(), staged_.end(), f));
}

Status Residency::start_staging(Chunk& c, std::size_t window, bool ahead, bool* started) {
  *started = false;
  const FamilyId f = c.family;
  if (staging_[f].state != Staging::kNone) {
    *started = true;
    return Status::Ok();
  }
  if (staged_.size() >= staging_max_) {
    const std::int64_t victim = staging_victim(window);
    if (victim < 0) return Status::Ok();
    free_staging(staged_[static_cast<std::size_t>(victim)]);
  }
  if (staging_free_.empty()) {
    // The pool grows to staging_max_ buffers on first use and keeps them.
    STRATA_CHECK(staging_buffers_.size() < staging_max_);
    auto buffer = core_.host->allocate(staging_buffer_bytes_);
    if (!buffer.ok()) {
      Status s = buffer.status();
      s.with_context(fmt::format("param staging buffer {} of {} ({}) for family {}'s NVMe-homed param",
                                 staging_buffers_.size() + 1, staging_max_,
                                 format_bytes(staging_buffer_bytes_), f));
      return s;
    }
    staging_buffers_.push_back(*buffer);
    staging_free_.push_back(*buffer);
  }
  c.host = staging_free_.back();
  staging_free_.pop_back();
  staged_.push_back(f);
  *started = true;
  ParamStaging& st = staging_[f];
  if (c.absent()) {
    std::memset(c.host, 0, c.bytes);  // never written: zeros
    st.state = Staging::kReady;
    return Status::Ok();
  }
  st.state = Staging::kReading;
  st.ahead = ahead;
  st.pieces.clear();  // keeps its capacity (Note [Allocation-free hot paths] in leases.cpp)
  const std::uint64_t piece = core_.nvme.store().slot_bytes();
  for (std::size_t i = 0; i < c.nvme_slots.size(); ++i) {
    const std::uint64_t begin = i * piece;
    st.pieces.push_back({c.nvme_slots[i], std::span<std::byte>(c.host + begin, std::min<std::uint64_t>(
                                                                                   piece, c.bytes - begin))});
  }
  st.io_pending = static_cast<int>(st.pieces.size());
  ++staging_reads_;
  // Submitted from a pool thread, without the lock: a store may call back on
  // the submitting thread (as the pipeline's reads are, nvme_pipeline.cpp). The
  // task gets the pieces' address and count: nothing changes them until the
  // last piece completed (NvmeTier::submit_pieces).
  const double enqueued = core_.timeline.now_us();
  core_.pool->post([this, f, ahead, enqueued, pieces = std::span<const NvmePiece>(st.pieces)] {
    core_.nvme.submit_pieces(ahead ? NvmeIo::kReadAhead : NvmeIo::kRead, pieces,
                             &Residency::nvme_staging_done, this, f, enqueued);
  });
  return Status::Ok();
}

void Residency::nvme_staging_done(void* self, FamilyId f, Status status, double enqueued_us,
                                  std::uint64_t bytes) {
  static_cast<Residency*>(self)->staging_read_done(f, std::move(status), enqueued_us, bytes);
}

void Residency::staging_read_done(FamilyId f, Status status, double enqueued_us, std::uint64_t bytes) {
  core_.timeline.add(Track::kDiskRead, SpanName{"nvme read param", f}, enqueued_us, core_.timeline.now_us(),
                     bytes);
  std::lock_guard lock(core_.mu);
  core_.param_use_read_bytes += bytes;
  ParamStaging& st = staging_[f];
  if (!status.ok() && st.status.ok()) st.status = std::move(status);
  if (--st.io_pending > 0) return;
  --staging_reads_;
  if (st.status.ok()) {
    st.state = Staging::kReady;
  } else {
    // Bad bytes never reach the device: the buffer is dropped. A read ahead of use
    // leaves the runtime going (its use reads the param again, and fails then if
    // the fault persists); a read a use waits for fails the runtime (Note
    // [Prefetch errors] in eviction.cpp).
    Status s = std::move(st.status);
    const bool ahead = st.ahead;
    s.with_context(fmt::format("{}NVMe read of family {}'s param into a staging buffer",
                               ahead ? "prefetch (a read ahead of use): " : "", f));
    st.state = Staging::kReady;
    free_staging(f);
    if (ahead) {
      core_.errors.prefetch_failed(std::move(s));
    } else {
      core_.errors.fail(std::move(s));
    }
  }
  core_.cv.notify_all();
}

Status Residency::wait_staged(std::unique_lock<std::mutex>& lock, Chunk& c) {
  const double t0 = core_.timeline.now_us();
  while (needs_staging(c) && !staged(c)) {
    if (!core_.errors.background().ok()) return core_.errors.background();
    bool started = false;
    STRATA_RETURN_IF_ERROR(start_staging(c, /*window=*/0, /*ahead=*/false, &started));
    if (staged(c)) break;
    if (started || staging_reads_ > 0) {
      core_.cv.wait(lock);  // its read, or one that frees a victim, ends (staging_read_done)
      continue;
    }
    // Every buffer is read and a load still copies from it: wait for the loads.
    for (FamilyId g : staged_) STRATA_RETURN_IF_ERROR(wait_host_reads(core_.chunk_mut(g, StateKind::kParam)));
    if (staging_victim(0) < 0 && lent_buffers() > 0) {
      core_.cv.wait(lock);  // the pipeline's copy from one ends (give_back_staged)
      continue;
    }
    if (staging_victim(0) < 0) {
      return internal_error("family {}: none of the {} param staging buffers can be taken back", c.family,
                            staging_max_);
    }
  }
  if (!core_.errors.background().ok()) return core_.errors.background();
  core_.timeline.add_stall((core_.timeline.now_us() - t0) * 1e-6);
  return Status::Ok();
}

Status Residency::drop_staging(std::unique_lock<std::mutex>& lock, Chunk& c) {
  if (c.kind != StateKind::kParam || c.family >= staging_.size()) return Status::Ok();
  const FamilyId f = c.family;
  core_.cv.wait(lock, [&] { return staging_[f].state != Staging::kReading && staging_[f].lent == 0; });
  if (staging_[f].state != Staging::kReady) return Status::Ok();
  STRATA_RETURN_IF_ERROR(wait_host_reads(c));
  free_staging(f);
  return Status::Ok();
}

void Residency::wait_staging_reads(std::unique_lock<std::mutex>& lock) {
  core_.cv.wait(lock, [&] { return staging_reads_ == 0; });
}

const std::byte* Residency::lend_staged(FamilyId f) {
  if (f >= staging_.size()) return nullptr;
  const Chunk& c = core_.chunk(f, StateKind::kParam);
  if (!staged(c) || c.value != ChunkValue::kNvme) return nullptr;
  ++staging_[f].lent;
  return c.host;
}

void Residency::give_back_staged(FamilyId f) {
  STRATA_CHECK(f < staging_.size() && staging_[f].lent > 0);
  --staging_[f].lent;
}

int Residency::lent_buffers() const {
  int n = 0;
  for (FamilyId f : staged_) n += staging_[f].lent > 0 ? 1 : 0;
  return n;
}

Status Residency::read_params_ahead() {
  const auto& uses = tracker_.plan_trace().uses;
  const std::size_t start = tracker_.next_position();
  for (std::size_t q = start; q < uses.size() && q < start + staging_max_; ++q) {
    Chunk& c = core_.chunk_mut(uses[q].family, StateKind::kParam);
    if (c.device_copy || !needs_staging(c) || pipeline_->updating(c.family)) continue;
    bool started = false;
    STRATA_RETURN_IF_ERROR(start_staging(c, staging_max_, /*ahead=*/true, &started));
    if (!started) break;  // no buffer free: the next placed use tries again
  }
  return Status::Ok();
}

}  // namespace strata::runtime
