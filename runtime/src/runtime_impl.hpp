#pragma once
// Runtime::Impl: the runtime's parts and what crosses them. Not a public header.
//
//   Core               core.*            shared context: lock, stores (stores.cpp), streams, thread pool,
//                                        timeline, tensors, chunks (chunk.hpp), plan, the first error
//   StepTracker        step_tracker.*    this step's trace, position in the adopted trace, step counters
//   Residency          residency.*,      device slots, host <-> device moves, eviction victims and
//                      eviction.cpp,     prefetch, NVMe-homed params' staging buffers
//                      param_staging.cpp
//   OptimizerPipeline  optimizer_*.*,    families' optimizer runs, gradient completion, the Inf/NaN
//                      grad_check.cpp,   check, staging, NVMe read-ahead and write-back
//                      nvme_pipeline.cpp
//
// Impl owns them and does what needs several: registration and finalising the
// layout (runtime.cpp), leases (leases.cpp), starting background work
// (scheduler.cpp), plan adoption and moving states between homes
// (plan_adoption.cpp), host access to any state between steps (host_copy.cpp,
// tensor_state.cpp), step() (step.cpp), a failed step's discard (step_abort.cpp),
// data parallelism (the dp_* members: data_parallel.cpp, dp_reduce.cpp,
// dp_gather.cpp, dp.hpp), checkpoints (the checkpoint_* members: runtime/checkpoint/,
// its README.md) and the invariants checked after each public call
// (invariants.cpp). Planner, cost model, layout, trace, timeline, options and
// tensor names have public headers (strata/runtime/) and do not include this one.
//
// Note [Gradient completion]
// A family's gradients are complete when every trainable tensor in it has had
// its gradient written (a write or accumulate lease released) in the last
// micro-batch, and its optimizer step starts when, besides, no lease holds its
// gradient or its param (so the update never races a reader). The contract that
// makes completion exact: within one micro-batch each
// tensor's gradient is handed over once (tied uses are accumulated by the caller
// first, as torch's post-accumulate-grad hook does); a second write lease in the
// same micro-batch is refused. Its optimizer step then starts at once (unless
// clipping or loss scaling defer every step to step()). A family with a tensor
// that got no gradient this step (unused) completes at step().

#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include "core.hpp"
#include "optimizer_pipeline.hpp"
#include "residency.hpp"
#include "step_tracker.hpp"
#include "strata/common/assert.hpp"

namespace strata::runtime {

//! The moments at which the training thread starts background work (Note [Scheduler]).
enum class SchedulerEvent : std::uint8_t { kUseBegins, kUsePlaced, kGradientsHandedOver, kStepEnds };

struct CheckpointSave;  // runtime/checkpoint/checkpoint.hpp

struct Runtime::Impl {
  Impl(memory::Device& dev, RuntimeOptions options)
      : core(dev, std::move(options)),
        tracker(core),
        residency(core, tracker, pipeline),
        pipeline(core, residency) {}

  Core core;
  StepTracker tracker;
  Residency residency;
  OptimizerPipeline pipeline;
  int leases_out = 0;
  //! The asynchronous save in flight or finished and not yet collected (Note [Overlapped save]).
  std::shared_ptr<CheckpointSave> checkpoint;

  //! The one scheduler entry point (Note [Scheduler], scheduler.cpp): starts what
  //! `event` allows; `family` is the one whose lease was released
  //! (kGradientsHandedOver). Returns a failed prefetch's error (kUsePlaced), which
  //! is also recorded: as the next call's error when the prefetch was a read ahead
  //! of use, else as the background error (Note [Prefetch errors]). Caller holds mu.
  Status schedule(SchedulerEvent event, FamilyId family = 0);
  //! Packs the registered tensors into chunk families and adopts the first plan
  //! (once, at the first acquire/init/step). Caller holds `lock`.
  Status finalize(std::unique_lock<std::mutex>& lock);
  //! Plans from `trace`, moves optimizer states whose home changes, rebuilds the
  //! device slots and makes the tracker and the pipeline follow the new plan.
  Status adopt_plan(std::unique_lock<std::mutex>& lock, StepTrace trace);
  //! Moves optimizer states whose home changes between the current plan and `p`.
  Status migrate_homes(std::unique_lock<std::mutex>& lock, const Plan& p);
  //! Gradients to host and one global check (clipping, loss scaling); sets the
  //! pipeline's step scale. *skip is set when an Inf/NaN skips the step.
  Status deferred_prepass(std::unique_lock<std::mutex>& lock, bool* skip);
  //! deferred_prepass's family lists, reused (Note [Allocation-free hot paths] in leases.cpp).
  std::vector<FamilyId> prepass_checked, prepass_on_host;
  //! Drops every gradient of a step skipped for Inf/NaN.
  void discard_gradients();
  // Note [Failed steps] (step_abort.cpp).
  //! The first error a public call met in the step in progress; step() discards the step then.
  Status step_error;
  //! Records `st` (an error of a public call mid-step) as the step's (unless not
  //! fails_step: a failed prefetch) and waits (unlocking) for the compute stream,
  //! so the caller may free what its launches captured; returns `st`.
  Status poison_step(std::unique_lock<std::mutex>& lock, Status st, bool fails_step = true);
  //! Discards the step in progress: waits for all background work (unlocking),
  //! drops its gradients, forgets its trace and clears the runtime's errors.
  //! Returns `cause` with the discard named.
  Status discard_step(std::unique_lock<std::mutex>& lock, Status cause);
  //! step()'s work once its preconditions hold; an error makes step() discard the step.
  Result<StepStats> run_step(std::unique_lock<std::mutex>& lock);
  //! Writes the NVMe-homed states a failed write-back kept in host memory (Note
  //! [Write-back after step]) home again, freeing their host room; unlocks while
  //! writing. False (and states_kept set) when some stay.
  bool rehome_kept_states(std::unique_lock<std::mutex>& lock);
  bool states_kept = false;  //!< rehome_kept_states left some; the next acquire tries again
  //! Waits (unlocking) for the data-parallel reductions of the step and forgets them.
  void abandon_dp_rounds(std::unique_lock<std::mutex>& lock);
  // Data parallelism (data_parallel.cpp, dp_reduce.cpp, dp_gather.cpp; Note [Sharded step]); no-ops for one
  // rank.
  //! Compares this rank's tensors and options with rank 0's; FailedPrecondition
  //! naming the first difference. Blocks until every rank arrived (or the timeout).
  Status dp_check_config(std::unique_lock<std::mutex>& lock);
  //! Starts the reduce-scatter of every family whose gradient is complete, in the
  //! fixed order, last family first (Note [Sharded step]; a "round" is one family's
  //! reduction); called as gradients are handed over. Does not wait. Caller holds mu.
  Status dp_post_complete_rounds();
  //! At step(): starts the rounds not started yet (every trainable tensor must
  //! have its gradient), then waits for every round in order and writes the sum
  //! of this rank's shard into its gradients. Unlocks while waiting for the other ranks.
  Status dp_reduce_gradients(std::unique_lock<std::mutex>& lock);
  //! Starts one family's reduce-scatter (families go last to first); at_step: a
  //! tensor without a gradient is an error (not just incomplete).
  Status dp_post_round(bool at_step);
  //! A family's reduce-scatter in flight (`first`: the family; `slice`: the bytes of
  //! one shard): its buffers live until it is waited for.
  struct DpRound {
    FamilyId first = 0;
    std::uint64_t slice = 0;
    std::vector<std::byte> send, recv;
    comm::Handle handle;
    //! The device-side pack of `send` (compute stream) is done when it completes;
    //! the reduce-scatter starts after it (started).
    std::optional<memory::Event> packed;
    bool started = false;
    //! A device-buffer communicator (nccl): the collective reads `dev` (the
    //! gradient's device slot, or `staging` for a gradient on host) and writes
    //! this rank's shard's sum in place there; `send`/`recv` stay empty.
    std::byte* dev = nullptr;
    memory::DeviceAllocation staging;
    bool landed = false;  //!< waited for and landed during backward (dp_land_done_rounds)
  };
  //! Device-buffer communicator: lands the rounds whose collectives are done, and
  //! waits for the oldest while too many hold device slots (back-pressure: the
  //! slots are backward's).
  Status dp_land_done_rounds();
  //! Device-buffer communicator: points `round` at gradient g's device slot (or
  //! a device buffer of `whole` bytes holding it) after the writes to it.
  Status dp_stage_round_on_device(DpRound& round, Chunk& g, std::uint64_t whole);
  //! Device-buffer communicator, once `round` is done: a GPU-homed family keeps
  //! its shard's sum in its slot; otherwise only the shard comes down to host.
  Status dp_land_device_round(DpRound& round);
  //! Starts, in issue order, the reduce-scatters whose packs are done (with
  //! block, waits for each pack). Caller holds mu.
  Status dp_start_packed(bool block);
  std::vector<DpRound> dp_inflight;  //!< started this step, in issue order
  std::size_t dp_rounds_posted = 0;  //!< families posted this step (from the last family down)
  //! The communicator's counters when the last step ended (StepStats::bytes_comm, comm_s).
  comm::CommStats dp_stats_mark;
  //! Agrees on the step's Inf/NaN and grad norm² over ranks: *finite becomes
  //! every rank's, *norm_sq the exact sum of every rank's (one all-reduce).
  Status dp_agree(std::unique_lock<std::mutex>& lock, bool* finite, kernels::ExactSum* norm_sq);
  //! Starts the all-gather of each family's updated param shards (after the step's
  //! optimizer work); the params are marked awaiting_gather.
  Status dp_gather_params(std::unique_lock<std::mutex>& lock);
  //! Waits (unlocking) for the all-gather of family f's params, if one is still
  //! pending, and writes the gathered chunk.
  Status dp_finish_gather(std::unique_lock<std::mutex>& lock, FamilyId f);
  //! dp_finish_gather for every pending family (in issue order).
  Status dp_finish_all_gathers(std::unique_lock<std::mutex>& lock);
  //! Finishes the gathers of the families the next `depth` traced uses load (the
  //! planned prefetch), so prefetch can load their updated params.
  Status dp_gather_ahead(std::unique_lock<std::mutex>& lock);
  //! Once, at a rank's first acquire, host read or step() after start-up: every
  //! param takes rank 0's value (broadcast), so ranks need not initialise alike.
  Status dp_broadcast_initial(std::unique_lock<std::mutex>& lock);
  bool dp_initial_sent = false;
  //! Every rank's `text`, by rank (W = 1: {text}). A collective: every rank calls it.
  Result<std::vector<std::string>> dp_exchange_text(std::unique_lock<std::mutex>& lock,
                                                    const std::string& text);
  //! A collective agreement on `mine` (checkpoints, Note [Sharded checkpoint]): OK on every rank only
  //! when it is OK on all; a failed rank gets its own error (naming the rank), the others one naming
  //! every failed rank and its error. W = 1: `mine`.
  Status dp_all_ok(std::unique_lock<std::mutex>& lock, Status mine, std::string_view what);
  //! The largest `value` over the ranks (exact below 2^53). W = 1: `value`.
  Result<std::int64_t> dp_max(std::unique_lock<std::mutex>& lock, std::int64_t value);
  //! A family's param all-gather in flight (`first`: the family; `slice`: one shard's bytes).
  struct DpGather {
    FamilyId first = 0;
    std::uint64_t slice = 0;
    std::vector<std::byte> all;
    comm::Handle handle;
    //! A device-buffer communicator: the gather fills `dev` (the param's device
    //! slot, or `staging` for a param not on the device); `all` stays empty.
    std::byte* dev = nullptr;
    memory::DeviceAllocation staging;
  };
  std::vector<DpGather> dp_gathers;  //!< started at the last step's end, in issue order
  //! Device-buffer communicator: points `g` at param p's device slot (in place) or
  //! a device buffer, with this rank's updated shard in it.
  Status dp_stage_gather_on_device(std::unique_lock<std::mutex>& lock, DpGather& g, Chunk& p);
  //! Runs fn on a host copy of chunk c (reading NVMe into a temporary when it lives
  //! there); with write, the change is stored back to c's home. With whole (and
  //! write), fn overwrites every byte of the chunk, so an NVMe copy is not read
  //! first: fn gets zeros. Blocks.
  Status with_host_copy(std::unique_lock<std::mutex>& lock, Chunk& c, bool write,
                        const std::function<void(std::byte*)>& fn, bool whole = false);
  // Note [Overlapped save] (checkpoint/capture.cpp).
  //! True when family f's optimizer update may start now: no save is in flight or
  //! it has captured f. Otherwise the save launches it once it has. Caller holds mu.
  bool checkpoint_allows_update(FamilyId f);
  //! Captures family f for the save in flight before an update of f starts, waiting
  //! (unlocked) while the save's room is full; a no-op when f has nothing to update.
  Status checkpoint_capture_for_update(std::unique_lock<std::mutex>& lock, FamilyId f);
  //! Waits until the save in flight has launched the updates it held back (before a
  //! step waits for its updates); with every_family, until it has captured every
  //! family too (before a host write or a load changes values).
  Status checkpoint_wait_captured(std::unique_lock<std::mutex>& lock, bool every_family = false);
  //! Waits for the save in flight to end; its outcome (collected: cleared).
  Status checkpoint_finish(std::unique_lock<std::mutex>& lock);
  //! The checks of Note [Chunk state machine] and Note [Pipeline places]; aborts
  //! on a violation. Caller holds mu.
  void check_invariants() const;
  //! Its data-parallel part: the awaiting_* flags, gathers in flight, shard sizes.
  void check_dp_invariants() const;
};

//! Runs Runtime::Impl::check_invariants when it goes out of scope, in checked
//! builds: declared right after a public call takes the lock, it checks what the
//! call left (and skips the check when the call returns with the lock released).
class InvariantCheck {
 public:
  explicit InvariantCheck(const Runtime::Impl& m, const std::unique_lock<std::mutex>* lock = nullptr)
      : m_(m), lock_(lock) {}
  InvariantCheck(const InvariantCheck&) = delete;
  InvariantCheck& operator=(const InvariantCheck&) = delete;
  ~InvariantCheck() {
    if constexpr (STRATA_CHECKED_BUILD) {
      if (lock_ == nullptr || lock_->owns_lock()) m_.check_invariants();
    }
  }

 private:
  const Runtime::Impl& m_;
  const std::unique_lock<std::mutex>* lock_;
};

//! Synthetic trace before the first step: forward in packing order, backward in reverse.
StepTrace registration_trace(std::size_t families);

}  // namespace strata::runtime
