#pragma once
// runtime/src/dp/: data parallelism over a comm::Communicator (Note [Sharded step],
// in data_parallel.cpp). Not a public header.
//
// Owns: the gradient reduce-scatters in flight this step (reduce.cpp), the
// param all-gathers in flight since the last step (gather.cpp), the initial
// broadcast, the start-up check, the agreements (data_parallel.cpp) and the
// communicator's traffic mark.
// May call: Core (chunks, device, streams, the communicator), Residency (host
// and device copies of a chunk), the StepTracker and the OptimizerPipeline
// (read only), and the runtime's host copy of a chunk (given at construction).
// Called by: Runtime::Impl: finalize (check_config), the lease path, host
// access and the scheduler through ChunkEvents (Note [Chunk events]),
// step() (reduce_gradients, agree, gather_params, count_traffic), a discarded
// step (abandon_rounds), checkpoints (finish_all_gathers, all_ok, exchange_text,
// max) and the invariant check. Every method expects Core::mu held; those
// taking the lock unlock it while waiting for other ranks. Each is a no-op for
// one rank unless it says otherwise.

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/chunk_events.hpp"
#include "core/chunk_flags.hpp"
#include "core/core.hpp"
#include "core/step_tracker.hpp"
#include "pipeline/optimizer_pipeline.hpp"
#include "residency/residency.hpp"

namespace strata::runtime {

namespace dp_detail {

//! The communicator's dtype of a compute dtype.
comm::DType comm_dtype(DType d);

//! What the collectives of Note [Sharded step] need to know: W, this rank, the
//! families, and the compute dtype's size and comm dtype.
struct Rounds {
  explicit Rounds(const Core& core)
      : w(static_cast<FamilyId>(core.dp_ranks())),
        me(static_cast<FamilyId>(core.dp_rank())),
        families(core.layout().families.size()),
        elem_bytes(dtype_bytes(core.opt.compute_dtype)),
        dtype(comm_dtype(core.opt.compute_dtype)) {}
  FamilyId w, me, families;
  std::uint64_t elem_bytes;
  comm::DType dtype;
};

//! Starts a collective and waits for it without the runtime's lock (the other
//! ranks may take a while; nothing here touches the runtime's state meanwhile).
Status run_collective(std::unique_lock<std::mutex>& lock, Result<comm::Handle> started);

}  // namespace dp_detail

class DataParallel final : public ChunkEvents {
 public:
  //! Runs fn on a host copy of a chunk (Runtime::Impl::with_host_copy: write,
  //! whole as there). Blocks.
  using HostCopy = std::function<Status(std::unique_lock<std::mutex>&, FamilyId, StateKind, bool write,
                                        const std::function<void(std::byte*)>& fn, bool whole)>;

  DataParallel(Core& core, const StepTracker& tracker, Residency& residency,
               const OptimizerPipeline& pipeline, HostCopy host_copy)
      : core_(core),
        tracker_(tracker),
        residency_(residency),
        pipeline_(pipeline),
        host_copy_(std::move(host_copy)) {}
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Note [Chunk events]: Runtime::Impl::events is this object with W > 1.
  //! Rank 0's initial params (broadcast_initial); a param's gather (finish_gather).
  Status on_use(std::unique_lock<std::mutex>& lock, Chunk& c) override;
  //! The gathers of the params the prefetch loads next (gather_ahead).
  Status on_placed(std::unique_lock<std::mutex>& lock) override;
  //! As on_use; a host write needs no initial broadcast first.
  Status on_host_access(std::unique_lock<std::mutex>& lock, Chunk& c, bool write) override;
  //! The reductions of the families whose gradients are complete (post_complete_rounds).
  Status on_gradients_handed_over() override { return post_complete_rounds(); }

  //! Compares this rank's tensors and options with rank 0's; FailedPrecondition
  //! naming the first difference. Blocks until every rank arrived (or the timeout).
  Status check_config(std::unique_lock<std::mutex>& lock);
  //! Once, at a rank's first acquire, host read or step() after start-up: every
  //! param takes rank 0's value (broadcast), so ranks need not initialise alike.
  Status broadcast_initial(std::unique_lock<std::mutex>& lock);

  // Backward (reduce.cpp).
  //! Starts the reduce-scatter of every family whose gradient is complete, in the
  //! fixed order, last family first (Note [Sharded step]; a "round" is one family's
  //! reduction); called as gradients are handed over. Does not wait.
  Status post_complete_rounds();
  //! At step(): starts the rounds not started yet (every trainable tensor must
  //! have its gradient), then waits for every round in order and writes the sum
  //! of this rank's shard into its gradients. Unlocks while waiting for the other ranks.
  Status reduce_gradients(std::unique_lock<std::mutex>& lock);
  //! Waits (unlocking) for the reductions of the step and forgets them (a discarded step).
  void abandon_rounds(std::unique_lock<std::mutex>& lock);

  //! Agrees on the step's Inf/NaN and grad norm² over ranks: *finite becomes
  //! every rank's, *norm_sq the exact sum of every rank's (one all-reduce).
  Status agree(std::unique_lock<std::mutex>& lock, bool* finite, kernels::ExactSum* norm_sq);
  //! The communicator's traffic since the last call (or the start-up check)
  //! into stats (bytes_comm, comm_s). Any W with a communicator.
  void count_traffic(StepStats& stats);

  // After the update (gather.cpp).
  //! Starts the all-gather of each family's updated param shards (after the step's
  //! optimizer work); the params are marked awaiting_gather.
  Status gather_params(std::unique_lock<std::mutex>& lock);
  //! Waits (unlocking) for the all-gather of family f's params, if one is still
  //! pending, and writes the gathered chunk.
  Status finish_gather(std::unique_lock<std::mutex>& lock, FamilyId f);
  //! finish_gather for every pending family (in issue order).
  Status finish_all_gathers(std::unique_lock<std::mutex>& lock);
  //! Finishes the gathers of the families the next `depth` traced uses load (the
  //! planned prefetch), so prefetch can load their updated params.
  Status gather_ahead(std::unique_lock<std::mutex>& lock);
  //! Gathers in flight (tests).
  std::size_t gathers_in_flight() const { return gathers_.size(); }
  //! The per-chunk flags (chunk_flags.hpp) Residency reads.
  const DpChunkFlags& flags() const { return flags_; }
  //! Writable, for a test that breaks them on purpose.
  DpChunkFlags& flags_for_testing() { return flags_; }

  // Agreements (checkpoints, Note [Sharded checkpoint]).
  //! Every rank's `text`, by rank (W = 1: {text}). A collective: every rank calls it.
  Result<std::vector<std::string>> exchange_text(std::unique_lock<std::mutex>& lock, const std::string& text);
  //! OK on every rank only when `mine` is OK on all; a failed rank gets its own
  //! error (naming the rank), the others one naming every failed rank and its
  //! error. W = 1: `mine`.
  Status all_ok(std::unique_lock<std::mutex>& lock, Status mine, std::string_view what);
  //! The largest `value` over the ranks (exact below 2^53). W = 1: `value`.
  Result<std::int64_t> max(std::unique_lock<std::mutex>& lock, std::int64_t value);

  //! The chunk flags, gathers in flight, shard sizes (invariants.cpp); aborts on a violation.
  void check_invariants() const;

 private:
  //! A family's reduce-scatter in flight (`first`: the family; `slice`: the bytes of
  //! one shard): its buffers live until it is waited for.
  struct Round {
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
    bool landed = false;  //!< waited for and landed during backward (land_done_rounds)
  };
  //! A family's param all-gather in flight (`first`: the family; `slice`: one shard's bytes).
  struct Gather {
    FamilyId first = 0;
    std::uint64_t slice = 0;
    std::vector<std::byte> all;
    comm::Handle handle;
    //! A device-buffer communicator: the gather fills `dev` (the param's device
    //! slot, or `staging` for a param not on the device); `all` stays empty.
    std::byte* dev = nullptr;
    memory::DeviceAllocation staging;
  };

  //! Starts one family's reduce-scatter (families go last to first); at_step: a
  //! tensor without a gradient is an error (not just incomplete).
  Status post_round(bool at_step);
  //! Device-buffer communicator: lands the rounds whose collectives are done, and
  //! waits for the oldest while too many hold device slots (back-pressure: the
  //! slots are backward's).
  Status land_done_rounds();
  //! Device-buffer communicator: points `round` at gradient g's device slot (or
  //! a device buffer of `whole` bytes holding it) after the writes to it.
  Status stage_round_on_device(Round& round, Chunk& g, std::uint64_t whole);
  //! Device-buffer communicator, once `round` is done: a GPU-homed family keeps
  //! its shard's sum in its slot; otherwise only the shard comes down to host.
  Status land_device_round(Round& round);
  //! Starts, in issue order, the reduce-scatters whose packs are done (with
  //! block, waits for each pack).
  Status start_packed(bool block);
  //! Device-buffer communicator: points `g` at param p's device slot (in place) or
  //! a device buffer, with this rank's updated shard in it.
  Status stage_gather_on_device(std::unique_lock<std::mutex>& lock, Gather& g, Chunk& p);
  Status host_copy(std::unique_lock<std::mutex>& lock, const Chunk& c, bool write,
                   const std::function<void(std::byte*)>& fn, bool whole = false) {
    return host_copy_(lock, c.family, c.kind, write, fn, whole);
  }

  Core& core_;
  const StepTracker& tracker_;
  Residency& residency_;
  const OptimizerPipeline& pipeline_;
  HostCopy host_copy_;
  DpChunkFlags flags_;             //!< sized at check_config (finalize)
  std::vector<Round> inflight_;    //!< started this step, in issue order
  std::size_t rounds_posted_ = 0;  //!< families posted this step (from the last family down)
  std::vector<Gather> gathers_;    //!< started at the last step's end, in issue order
  //! The communicator's counters when the last step ended (StepStats::bytes_comm, comm_s).
  comm::CommStats stats_mark_;
  bool initial_sent_ = false;
};

}  // namespace strata::runtime
