#pragma once
// Core: what every part of the runtime shares. It owns the device streams, the
// host and NVMe stores, the thread pool, the one lock, the registered tensors,
// the layout, the chunks and the adopted plan, and the timeline. It calls nothing
// but the stores and the device. Residency, OptimizerPipeline and StepTracker each
// hold a reference to it; Runtime::Impl (runtime_impl.hpp) composes them.
//
// Note [Lock discipline]
// One mutex (`mu`) guards every field of the runtime's parts except the
// timeline (thread-safe itself), StepTracker's compute times (their own lock,
// taken by compute-stream callbacks) and the atomics. Public calls take it on
// entry; pool tasks and I/O completions take it; device-stream callbacks never
// do (Note [Runtime threading]). A function that is handed a
// `std::unique_lock&` may unlock it while it waits; every other member function
// of the parts expects `mu` held unless its comment says "takes mu". One lock
// and this rule need no static annotations, so the build does not check them
// with clang's thread-safety analysis.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/chunk.hpp"
#include "core/file_remover.hpp"
#include "core/record_pool.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/runtime/options.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {

struct Core;

//! One timed copy in flight: what its completion adds to the timeline (Note
//! [Completion records] in strata/common/record_pool.hpp).
struct CopyRecord {
  Core* core = nullptr;
  double start_us = 0.0;  //!< when the stream reached the copy
  Track track = Track::kH2D;
  std::uint64_t bytes = 0;
  SpanName name;
};

//! One slot's worth of a chunk's NVMe transfer: the slot and the host bytes.
struct NvmePiece {
  std::uint32_t slot = 0;
  std::span<std::byte> data;
};

//! Which NvmeStore call an NVMe piece goes through.
enum class NvmeIo : std::uint8_t { kRead, kReadAhead, kWrite };

//! Called once per NVMe piece with its outcome, on an I/O thread (or the
//! submitting one when the store refused the piece); `owner` as given to
//! Core::submit_nvme_pieces.
using NvmePieceDone = void (*)(void* owner, FamilyId f, Status status, double enqueued_us,
                               std::uint64_t bytes);

//! One NVMe piece in flight (Note [Completion records]): what its completion
//! needs, so the store's callback captures one pointer.
struct NvmeIoRecord {
  Core* core = nullptr;
  NvmePieceDone done = nullptr;
  void* owner = nullptr;
  FamilyId family = 0;
  double enqueued_us = 0.0;
  std::uint64_t bytes = 0;
};

//! One Runtime::launch() in flight (Note [Completion records]).
struct LaunchRecord {
  Core* core = nullptr;
  std::function<void()> fn;
  std::size_t use = 0;  //!< the traced use the compute time is added to
  double enqueued_us = 0.0;
};

struct Core {
  Core(memory::Device& dev, RuntimeOptions options)
      : device(dev),
        opt(std::move(options)),
        timeline(std::clamp<std::size_t>(opt.timeline_events_max, 1, kTimelineEventsMax)) {}

  memory::Device& device;
  RuntimeOptions opt;
  std::unique_ptr<ThreadPool> pool;
  std::shared_ptr<HostStore> host;
  std::shared_ptr<NvmeStore> nvme;  //!< null until a plan puts states on NVMe
  //! An older checkpoint's files, removed after a save published (Note [Stale checkpoint files]).
  FileRemover stale_checkpoint_files;
  memory::Stream compute, h2d, d2h, opt_stream;

  // Note [Lock discipline]
  std::mutex mu;
  std::condition_variable cv;
  Status background_error;  //!< the first error of background work; fail() sets it
  // Note [Prefetch errors] in eviction.cpp: a failed read ahead of use is not sticky.
  Status prefetch_error;              //!< a failed prefetch no public call has returned yet
  std::uint64_t prefetch_errors = 0;  //!< failed prefetches since the last step() (StepStats)
  std::string first_prefetch_error;   //!< the first of them

  // Registration and layout (fixed from the first acquire/init/step on).
  std::vector<TensorInfo> tensors;
  std::unordered_map<std::string, TensorId> by_name;
  bool finalized = false;
  ChunkLayout layout;
  std::vector<FamilyBytes> family_bytes;
  std::uint32_t state_count = 0;   //!< optimizer states per element (kernels::optimizer_state_count)
  bool separate_master = false;    //!< the fp32 master is its own chunk (compute dtype is not fp32)
  std::vector<GroupHyper> groups;  //!< per group id; Note [Parameter groups]

  //! Chunks: index family * kStateKindCount + kind.
  std::vector<Chunk> chunks;
  //! The adopted plan; written only by Runtime::Impl::adopt_plan.
  Plan plan;
  //! begin_micro_batch(false) was called: gradients accumulate across micro-batches.
  bool accumulation_seen = false;
  //! The adopted plan counts host room for accumulating every gradient (Note [Host room]).
  bool accumulation_planned = false;
  //! The largest predicted peak per tier of the plans adopted so far: the high water
  //! marks (which count from the start) stay within them (checked at each step's end
  //! in checked builds; Note [Host room] in planner.cpp).
  std::uint64_t host_bytes_planned_max = 0, gpu_bytes_planned_max = 0, nvme_bytes_planned_max = 0;

  Timeline timeline;
  std::atomic<double> track_end_us[kTrackCount] = {};

  Chunk& chunk(FamilyId f, StateKind k) { return chunks[f * kStateKindCount + static_cast<std::size_t>(k)]; }
  std::int32_t chunk_index(FamilyId f, StateKind k) const {
    return static_cast<std::int32_t>(f * kStateKindCount + static_cast<std::size_t>(k));
  }
  //! The dtype a chunk of `kind` holds.
  DType kind_dtype(StateKind kind) const;
  //! Optimizers run at step() rather than as gradients complete.
  bool deferred() const { return opt.loss_scaling || opt.clip_max_norm > 0.0 || dp_ranks() > 1; }
  //! Ranks of data parallelism (1 without a communicator) and this one's index.
  int dp_ranks() const { return opt.comm != nullptr ? opt.comm->size() : 1; }
  int dp_rank() const { return opt.comm != nullptr ? opt.comm->rank() : 0; }
  //! Note [Sharded step]: every rank holds and steps shard dp_rank() of every
  //! family's masters and optimizer states: elements [shard_begin, shard_begin +
  //! shard_elems) of the family's chunk (capacities are multiples of W x
  //! kShardAlignElems). The whole chunk for one rank.
  std::uint64_t shard_elems(FamilyId f) const {
    return layout.families[f].capacity_elems / static_cast<std::uint64_t>(dp_ranks());
  }
  std::uint64_t shard_begin(FamilyId f) const {
    return shard_elems(f) * static_cast<std::uint64_t>(dp_rank());
  }
  //! The part of tensor t inside this rank's shard: tensor elements [first,
  //! first + count), at element `at` of the family's optimizer chunks (count 0:
  //! none of it).
  struct ShardPart {
    std::uint64_t first = 0, count = 0, at = 0;
  };
  ShardPart shard_part(TensorId t) const {
    const TensorSlot& ts = layout.slots[t];
    const std::uint64_t lo = shard_begin(ts.family), hi = lo + shard_elems(ts.family);
    const std::uint64_t b = std::max(ts.offset_elems, lo), e = std::min(ts.offset_elems + ts.numel, hi);
    if (b >= e) return {};
    return {.first = b - ts.offset_elems, .count = e - b, .at = b - lo};
  }
  //! This rank writes family f's checkpoint file (Note [Sharded checkpoint]).
  bool owns(FamilyId f) const {
    return f % static_cast<FamilyId>(dp_ranks()) == static_cast<FamilyId>(dp_rank());
  }
  //! The family's optimizer states live on NVMe.
  bool on_nvme(FamilyId f) const { return plan.families[f].optim_home == Tier::kNvme; }
  //! The family's param lives on NVMe too (Note [NVMe-homed params] in residency.hpp).
  bool param_on_nvme(FamilyId f) const { return plan.families[f].param_home == Tier::kNvme; }
  //! The hyperparameters of `group` (the runtime's, with the group's overrides).
  kernels::Hyper hyper(std::uint32_t group) const;
  std::uint64_t largest_optim_chunk() const;

  //! Records the first background error (and logs it); later ones are dropped.
  void fail(Status status);
  //! Records a failed prefetch (Note [Prefetch errors]): logged, counted for
  //! StepStats, and kept for the next public call to return once.
  void prefetch_failed(Status status);
  //! What a public call returns before it does anything: the background error,
  //! else take_prefetch_error().
  Status take_error();
  //! A failed prefetch not returned yet, then forgotten (returned once); else Ok.
  Status take_prefetch_error() { return std::exchange(prefetch_error, Status::Ok()); }
  //! The host copy's buffer of `c`, allocated on first use. Fails with the host
  //! store's OutOfBudget, naming the chunk.
  Result<std::byte*> host_buffer(Chunk& c);
  //! Creates the NVMe store on first use (its slot fits the largest optimizer chunk),
  //! preallocating `initial_bytes` (default: the adopted plan's NVMe bytes) and
  //! growing up to budgets.nvme, a cap (Note [Growing swap files]).
  Status ensure_nvme_store(std::optional<std::uint64_t> initial_bytes = std::nullopt);
  //! Note [Pinned NVMe slots]: a slot an asynchronous checkpoint (checkpoint/capture.cpp)
  //! still has to read. free_nvme_slot of a pinned slot defers the release to
  //! unpin_nvme_slot, so the copy-on-write write-back never hands it out while the
  //! save reads it. Every release of a chunk's slots goes through free_nvme_slot.
  void pin_nvme_slot(std::uint32_t slot) { nvme_pins.emplace(slot, false); }
  void unpin_nvme_slot(std::uint32_t slot);
  void free_nvme_slot(std::uint32_t slot);
  std::unordered_map<std::uint32_t, bool> nvme_pins;  //!< pinned slot -> freed while pinned
  //! Synchronous NVMe transfer of a whole chunk (unlocks while waiting). A write
  //! goes to fresh slots that replace `slots_io` only when every piece succeeded.
  Status nvme_transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                       std::vector<std::uint32_t>& slots_io);
  //! Hands `pieces` of family `f` to the NVMe store one by one (reads, reads
  //! ahead or writes); each piece's outcome reaches done(owner, f, ...) exactly
  //! once. Call without mu (a store may call back on this thread). Reads each
  //! piece before submitting it and none after the last: the caller's piece
  //! list may be reused as soon as the last completion ran. Allocates nothing
  //! once the pieces in flight stay below their high water (nvme_io_records).
  void submit_nvme_pieces(NvmeIo io, std::span<const NvmePiece> pieces, NvmePieceDone done, void* owner,
                          FamilyId f, double enqueued_us);
  //! Enqueues a copy on `stream` and records its span on `track` (start when the
  //! stream reaches it, end when it is done).
  //! Allocates nothing once the copies in flight stay below their high water
  //! (copy_records; Note [Completion records]).
  Status timed_copy(const memory::Stream& stream, Track track, void* dst, const void* src,
                    std::uint64_t bytes, memory::CopyKind kind, SpanName name);
  //! Adds a span that ends now on `track` (called in the track's stream order).
  void record_span(Track track, SpanName name, double enqueued_us, std::uint64_t bytes);

  RecordPool<CopyRecord> copy_records;       //!< timed_copy's
  RecordPool<LaunchRecord> launch_records;   //!< Runtime::launch's
  RecordPool<NvmeIoRecord> nvme_io_records;  //!< submit_nvme_pieces's
  //! Runtime::launch calls since the last step() (under mu), and the most of any
  //! step: step() waits for the compute stream, so no more launches than one
  //! step's are ever in flight, and launch_records is reserved to that many
  //! (a steady step never grows it however far the host runs ahead).
  std::size_t launches_this_step = 0;
  std::size_t launches_per_step_max = 0;
};

}  // namespace strata::runtime
