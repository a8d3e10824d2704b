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
// with clang's thread-safety analysis. The two tables are written only through
// Core (Note [Table writes] in core.cpp), under mu like every other field.

#include <algorithm>
#include <array>
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
#include "core/error_state.hpp"
#include "core/nvme_tier.hpp"
#include "core/record_pool.hpp"
#include "core/tables.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/runtime/options.hpp"
#include "strata/runtime/runtime_options.hpp"
#include "strata/runtime/timeline.hpp"

namespace strata::runtime {

class Core;

//! One timed copy in flight: what its completion adds to the timeline (Note
//! [Completion records] in strata/common/record_pool.hpp).
struct CopyRecord {
  Core* core = nullptr;
  double start_us = 0.0;  //!< when the stream reached the copy
  Track track = Track::kH2D;
  std::uint64_t bytes = 0;
  SpanName name;
};

//! One Runtime::launch() in flight (Note [Completion records]).
struct LaunchRecord {
  Core* core = nullptr;
  std::function<void()> fn;
  std::size_t use = 0;  //!< the traced use the compute time is added to
  double enqueued_us = 0.0;
};

//! The largest predicted peak per tier of the plans adopted so far: the high water
//! marks (which count from the start) stay within them (checked at each step's end
//! in checked builds; Note [Host room] in planner.cpp).
struct PlannedPeaks {
  std::uint64_t host_bytes = 0, gpu_bytes = 0, nvme_bytes = 0;
};

class Core {
 public:
  Core(memory::Device& dev, RuntimeOptions options)
      : device(dev),
        opt(std::move(options)),
        nvme(opt.nvme_store),
        timeline(std::clamp<std::size_t>(opt.timeline_events_max, 1, kTimelineEventsMax)),
        state_count(kernels::optimizer_state_count(opt.hyper)),
        separate_master(opt.compute_dtype != DType::kF32) {}

  // The shared parts, set up once by Runtime::create.
  memory::Device& device;
  const RuntimeOptions opt;
  std::unique_ptr<ThreadPool> pool;
  std::shared_ptr<HostStore> host;
  NvmeTier nvme;  //!< the store opens when a plan puts states on NVMe (ensure_nvme_store)
  memory::Stream compute, h2d, d2h, opt_stream;
  Timeline timeline;

  // Note [Lock discipline]
  std::mutex mu;
  std::condition_variable cv;
  ErrorState errors;

  // The tables every part reads under mu (tables.hpp): the registered tensors with
  // their name index, and the chunks with their families' sizes. Only core/ writes
  // them, through the operations below (Note [Table writes]).
  const TensorTable& tensors() const { return tensors_; }
  const ChunkTable& chunks() const { return chunks_; }

  // The tensor table's writes, each a fact of the step (Note [Table writes]).
  //! Registers a tensor; its name must not be registered yet (the caller checked).
  TensorId add_tensor(TensorSpec spec, std::uint64_t numel) { return tensors_.add(std::move(spec), numel); }
  //! A lease on tensor t pinned chunk `chunk` (ChunkTable::index) to write or to
  //! read: the chunk counts a writer or a reader, and t a write lease.
  void lease_taken(TensorId t, std::int32_t chunk, bool write);
  //! That lease was released or abandoned (checks the counts it drops are held).
  void lease_returned(TensorId t, std::int32_t chunk, bool write);
  //! A write lease on t's gradient was released: t has a gradient to step. True when
  //! it is t's first in this micro-batch (Note [Gradient completion]).
  bool grad_handed_over(TensorId t);
  //! no_gradient(t): t hands over no gradient in this micro-batch.
  void grad_declared_absent(TensorId t) { tensors_[t].written_in_micro_batch = true; }
  //! A micro-batch ended (or was discarded): no tensor is written in the next one yet.
  void micro_batch_ended() { tensors_.end_micro_batch(); }
  //! An optimizer step consumed (or a discard dropped) every gradient; family f's.
  void grads_consumed() { tensors_.clear_grads_written(); }
  void family_grads_consumed(FamilyId f);
  //! An optimizer step updated `updated` (their bias-correction step counts one more).
  void count_updates(std::span<const TensorId> updated);
  //! set_tensor_steps / a checkpoint's load: t's bias-correction step is `steps`.
  void restore_updates(TensorId t, std::int64_t steps) { tensors_[t].updates = steps; }
  //! set_tensor_group / a checkpoint's load: t is in parameter group `group`.
  void assign_group(TensorId t, std::uint32_t group) { tensors_[t].group = group; }

  // The chunk table's writes (Note [Table writes]).
  //! Lays out the chunks once the layout is fixed: family f's chunk of kind k holds
  //! bytes[f][k] (rounded up to 4 KiB), numels[f] trainable elements; then counts the
  //! NVMe tier's bytes of each (FamilyBytes).
  void lay_out_chunks(std::span<const std::array<std::uint64_t, kStateKindCount>> bytes,
                      std::span<const std::uint64_t> numels);
  //! A chunk to change under the chunk state machine (Note [Chunk state machine]):
  //! the escape hatch every other part's write takes, each use counted
  //! (scripts/check-owners).
  Chunk& chunk_mut(FamilyId f, StateKind k) { return chunks_.at(f, k); }
  Chunk& chunk_mut(std::int32_t index) { return chunks_.at(index); }
  //! Every chunk, to change (the same escape hatch).
  std::span<Chunk> chunks_mut() { return chunks_.all(); }
  //! begin_micro_batch(false) was called: gradients accumulate across micro-batches.
  bool accumulation_seen = false;
  //! Tensors leased together, as (set, tensor) pairs (Note [Working sets] in core.cpp).
  std::vector<std::pair<std::uint32_t, TensorId>> working_sets;
  //! The most families one working set spans (1 with none declared or no layout yet).
  std::uint32_t working_set_families() const;
  //! NVMe reads of NVMe-homed params, since creation (under mu): for their forward and
  //! backward uses (into param staging), and by the optimizer pipeline beside their
  //! states (StepStats::bytes_disk_read_param_uses / _param_updates).
  std::uint64_t param_use_read_bytes = 0;
  std::uint64_t param_update_read_bytes = 0;
  const std::uint32_t state_count;  //!< optimizer states per element (kernels::optimizer_state_count)
  const bool separate_master;       //!< the fp32 master is its own chunk (compute dtype is not fp32)

  //! The chunk layout: set once, at the first acquire/init/step, before finalize().
  const ChunkLayout& layout() const { return layout_; }
  void set_layout(ChunkLayout layout) { layout_ = std::move(layout); }
  //! The layout is fixed: from the first acquire/init/step on.
  bool finalized() const { return finalized_; }
  void finalize() { finalized_ = true; }
  //! Parameter groups' overrides, per group id (Note [Parameter groups]).
  std::span<const GroupHyper> groups() const { return groups_; }
  void set_group(std::uint32_t group, GroupHyper h);

  // The adopted plan.
  const Plan& plan() const { return plan_; }
  //! Adopts `p`; `counts_accumulation`: it counts host room for accumulating every
  //! gradient (Note [Host room]). Written only by Runtime::Impl::adopt_plan.
  void adopt_plan(Plan p, bool counts_accumulation);
  bool accumulation_planned() const { return accumulation_planned_; }
  const PlannedPeaks& planned_max() const { return planned_max_; }

  const Chunk& chunk(FamilyId f, StateKind k) const { return chunks_.at(f, k); }
  static std::int32_t chunk_index(FamilyId f, StateKind k) { return ChunkTable::index(f, k); }
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
    return layout_.families[f].capacity_elems / static_cast<std::uint64_t>(dp_ranks());
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
    const TensorSlot& ts = layout_.slots[t];
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
  bool on_nvme(FamilyId f) const { return plan_.families[f].optim_home == Tier::kNvme; }
  //! The family's param lives on NVMe too (Note [NVMe-homed params] in residency.hpp).
  bool param_on_nvme(FamilyId f) const { return plan_.families[f].param_home == Tier::kNvme; }
  //! The hyperparameters of `group` (the runtime's, with the group's overrides).
  kernels::Hyper hyper(std::uint32_t group) const;
  std::uint64_t largest_optim_chunk() const;

  //! The host copy's buffer of `c`, allocated on first use. Fails with the host
  //! store's OutOfBudget, naming the chunk.
  Result<std::byte*> host_buffer(Chunk& c);
  //! Opens the NVMe store on first use (its slot fits the largest optimizer chunk),
  //! preallocating `initial_bytes` (default: the adopted plan's NVMe bytes) and
  //! growing up to budgets.nvme, a cap (Note [Growing swap files]).
  Status ensure_nvme_store(std::optional<std::uint64_t> initial_bytes = std::nullopt);
  //! Synchronous NVMe transfer of a whole chunk (unlocks while waiting), opening
  //! the store first (NvmeTier::transfer).
  Status nvme_transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                       std::vector<std::uint32_t>& slots_io);
  //! Enqueues a copy on `stream` and records its span on `track` (start when the
  //! stream reaches it, end when it is done).
  //! Allocates nothing once the copies in flight stay below their high water
  //! (Note [Completion records]).
  Status timed_copy(const memory::Stream& stream, Track track, void* dst, const void* src,
                    std::uint64_t bytes, memory::CopyKind kind, SpanName name);
  //! Adds a span that ends now on `track` (called in the track's stream order).
  void record_span(Track track, SpanName name, double enqueued_us, std::uint64_t bytes);

  // Runtime::launch's records (Note [Completion records]). Launches since the
  // last step() are counted under mu; step() waits for the compute stream, so no
  // more launches than one step's are ever in flight, and the pool is reserved to
  // the most of any step (a steady step never grows it however far the host runs
  // ahead).
  void count_launch() { ++launches_this_step_; }
  //! A record for a launch, and its return (both thread-safe).
  LaunchRecord* take_launch_record() { return launch_records_.take(); }
  void give_back_launch_record(LaunchRecord* r) { launch_records_.give_back(r); }
  //! A compute span ended at `end_us` (the compute track's end, for record_span).
  void compute_ended(double end_us) {
    track_end_us_[static_cast<std::size_t>(Track::kCompute)].store(end_us);
  }
  //! Every launch so far has run (step() waited): reserves the most of any step.
  void end_step_launches();
  //! A failed step was discarded: its launches are not counted.
  void forget_step_launches() { launches_this_step_ = 0; }
  std::uint64_t copy_records_created() const { return copy_records_.created(); }
  std::uint64_t launch_records_created() const { return launch_records_.created(); }

 private:
  TensorTable tensors_;
  ChunkTable chunks_;
  ChunkLayout layout_;
  bool finalized_ = false;
  std::vector<GroupHyper> groups_;

  Plan plan_;
  bool accumulation_planned_ = false;
  PlannedPeaks planned_max_;

  std::atomic<double> track_end_us_[kTrackCount] = {};
  RecordPool<CopyRecord> copy_records_;
  RecordPool<LaunchRecord> launch_records_;
  std::size_t launches_this_step_ = 0;
  std::size_t launches_per_step_max_ = 0;
};

}  // namespace strata::runtime
