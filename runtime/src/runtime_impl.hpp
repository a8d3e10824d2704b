#pragma once
// Runtime internals shared by runtime.cpp (API, registration, steps),
// residency.cpp (slots, moves, eviction, prefetch) and optimizer.cpp (the
// per-family optimizer pipeline). Not a public header.
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
//
// Note [Chunk state machine]
// A chunk is one state kind of one family. It may have a host copy, a device
// copy (in a slot) and an NVMe copy; `absent` means no tier holds a value yet
// (optimizer states start as zeros, a gradient as undefined). Exactly one copy
// is authoritative: the device copy when `dev_dirty`, else the host copy when
// `host_valid`, else the NVMe copy. A device copy is never dropped while a lease
// holds it (readers/writers); a dirty one is written back to host before its slot
// is reused. Slots carry two events: `fence` (everything that used the slot's
// previous content is done: compute releases and d2h write-backs record it) and
// `ready` (the content is loaded). Every writer of a slot waits on `fence` first,
// then records it, so `fence` always covers all earlier users.

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "strata/common/thread_pool.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {

//! One device slot: a piece of device memory that holds one chunk at a time.
struct DeviceSlot {
  std::byte* ptr = nullptr;
  std::uint64_t bytes = 0;
  std::int32_t chunk = -1;  //!< occupant chunk index, -1 when free
  bool dedicated = false;   //!< belongs to one chunk for good (everything-on-GPU plans)
  memory::Event fence;      //!< Note [Chunk state machine]
  memory::Event ready;
};

//! One chunk; see Note [Chunk state machine].
struct Chunk {
  FamilyId family = 0;
  StateKind kind = StateKind::kParam;
  std::uint64_t bytes = 0;  //!< 0: this family has no such kind
  std::byte* host = nullptr;
  bool host_valid = false;
  bool absent = true;
  std::int32_t slot = -1;
  bool dev_valid = false;
  bool dev_dirty = false;
  std::vector<std::uint32_t> nvme_slots;
  bool nvme_valid = false;
  int readers = 0;
  int writers = 0;
  std::uint64_t tick = 0;  //!< last use, for LRU
  //! The last copy that reads the host copy (a load); the host copy is not
  //! written or freed before it completes (wait_host_reads).
  memory::Event host_read;
};

//! A registered tensor and its per-step flags.
struct TensorInfo {
  TensorSpec spec;
  std::uint64_t numel = 0;
  bool grad_written = false;            //!< a gradient was written since the last optimizer step
  bool written_in_micro_batch = false;  //!< Note [Gradient completion]
  int write_leases = 0;
  std::int64_t updates = 0;  //!< optimizer steps applied to this tensor (its bias-correction step)
  std::uint32_t group = 0;   //!< Note [Parameter groups]
};

//! A parameter group's overrides of the optimizer's lr and weight decay (Note [Parameter groups]).
struct GroupHyper {
  bool set = false;
  float lr = 0.0f;
  float weight_decay = 0.0f;
};

//! A family's optimizer work in the current step (Note [Pipeline places]).
struct FamilyRun {
  bool launched = false;  //!< gradients complete, optimizer requested
  bool done = true;       //!< nothing pending (true until launched)
  bool applied = false;
  bool computing = false;  //!< the CPU kernel is queued or running
  bool has_grad_slot = false;
  bool grad_ready = false;  //!< the gradient is on host (grad_host)
  std::byte* grad_host = nullptr;
  bool grad_host_owned_by_chunk = false;  //!< grad_host is the grad chunk's own host copy
  bool has_nvme_place = false;
  bool states_ready = false;        //!< NVMe states are in staging
  bool cancel_read_ahead = false;   //!< release the place when the reads end
  std::vector<std::byte*> staging;  //!< per kind: NVMe states and the param being updated
  int io_pending = 0;
  Status io_status;
  std::vector<TensorId> updated;  //!< tensors the kernel updated (committed with the param)
};

//! An NVMe family's updated states on their way to fresh NVMe slots after its
//! optimizer step; outlives the step (Note [Write-back after step]).
struct WriteBack {
  bool active = false;
  std::vector<std::byte*> staging;                    //!< per kind: the updated states
  std::vector<std::vector<std::uint32_t>> new_slots;  //!< per kind: the slots being written
  int io_pending = 0;
  Status status;
  std::uint64_t step = 0;  //!< the step whose update this is (1-based)
};

//! The kinds the optimizer owns (they live where the family's optimizer states live).
inline bool is_optim_kind(StateKind k) {
  return k == StateKind::kMaster || k == StateKind::kState0 || k == StateKind::kState1;
}

//! Base pointers of one family's chunks, per StateKind, on one tier.
struct FamilyPtrs {
  std::byte* at[kStateKindCount] = {};
};

struct Runtime::Impl {
  Impl(memory::Device& dev, RuntimeOptions options) : device(dev), opt(std::move(options)) {}

  memory::Device& device;
  RuntimeOptions opt;
  std::unique_ptr<ThreadPool> pool;
  std::shared_ptr<HostStore> host;
  std::shared_ptr<NvmeStore> nvme;
  memory::Stream compute, h2d, d2h, opt_stream;
  memory::Event demand;  //!< without prefetch, loads wait for the compute before them
  std::vector<memory::DeviceAllocation> device_memory;
  std::vector<DeviceSlot> slots;
  std::size_t cache_slots = 0;  //!< slots [0, cache_slots) stream; the rest are dedicated

  // Registration and layout.
  std::vector<TensorInfo> tensors;
  std::unordered_map<std::string, TensorId> by_name;
  bool finalized = false;
  ChunkLayout layout;
  std::vector<FamilyBytes> family_bytes;
  std::vector<bool> kind_present = std::vector<bool>(kStateKindCount, false);
  std::uint32_t state_count = 0;
  bool separate_master = false;

  // Plan.
  Plan plan;
  StepTrace plan_trace;
  NextUse next_use;

  // Chunks: index family * kStateKindCount + kind.
  std::vector<Chunk> chunks;

  // The step in progress.
  Tracer tracer;
  std::size_t pos = 0;     //!< position in plan_trace
  bool following = false;  //!< this step follows the plan's trace so far
  bool deviated = false;
  bool in_backward = false;
  bool last_micro_batch = true;
  bool warm = false;  //!< a traced step has been planned
  std::vector<FamilyRun> runs;
  std::vector<std::uint32_t> trainable;      //!< per family: tensors with gradients
  std::vector<std::uint32_t> grads_written;  //!< per family: of those, written this micro-batch
  float grad_scale = 1.0f;
  float step_scale = 1.0f;  //!< grad scale the kernels use this step (x clip coefficient)
  std::uint64_t step_index = 0;
  int leases_out = 0;
  std::uint64_t tick = 0;
  double step_start_us = 0.0;

  // Background work.
  std::mutex mu;
  std::condition_variable cv;
  Status background_error;
  int tasks_in_flight = 0;
  std::deque<FamilyId> grad_queue;    //!< launched families waiting for a gradient slot
  std::vector<FamilyId> launch_fifo;  //!< launched this step, in order
  std::vector<FamilyId> nvme_order;   //!< NVMe families by traced gradient completion
  std::size_t read_ahead_cursor = 0;
  bool read_ahead = false;  //!< read NVMe states ahead this step
  int grad_slots_used = 0, grad_slots_max = 2;
  int nvme_places_used = 0, nvme_places_max = 2;
  int io_families = 0;                //!< families with NVMe reads in flight
  std::vector<WriteBack> writebacks;  //!< per family (Note [Write-back after step])
  int writebacks_in_flight = 0;

  Timeline timeline;
  std::mutex compute_mu;               //!< guards compute_by_use (stream callbacks take it, never mu)
  std::vector<double> compute_by_use;  //!< measured compute seconds per traced use this step
  std::uint64_t prev_copy_bytes[3] = {};
  TrackStats prev_tracks[kTrackCount] = {};
  double prev_stall_s = 0.0;
  std::uint64_t host_high_water_step = 0;
  std::atomic<double> track_end_us[kTrackCount] = {};
  std::uint64_t gpu_high_water = 0;

  // --- helpers (residency.cpp) ---
  Chunk& chunk(FamilyId f, StateKind k) { return chunks[f * kStateKindCount + static_cast<std::size_t>(k)]; }
  std::int32_t chunk_index(FamilyId f, StateKind k) const {
    return static_cast<std::int32_t>(f * kStateKindCount + static_cast<std::size_t>(k));
  }
  //! Puts `c` in a device slot, loading its content when `load`; waits (unlocking)
  //! for a slot when all are busy with background work. Caller holds `lock`.
  Status ensure_on_device(std::unique_lock<std::mutex>& lock, Chunk& c, bool load);
  //! Makes the host copy of `c` valid (write-back from device, read from NVMe). Blocks.
  Status ensure_on_host(std::unique_lock<std::mutex>& lock, Chunk& c);
  //! Frees slot `s` (writing back a dirty occupant). Caller holds the lock.
  Status evict_slot(std::size_t s);
  //! Chooses a slot for a new occupant; -1 when none can be freed now. With
  //! farther_than > 0 (prefetch), only a free slot or a clean occupant whose next
  //! use is more than that many uses ahead.
  std::int64_t pick_slot(FamilyId for_family, std::uint64_t farther_than = 0);
  //! The slot is free, or its occupant may be evicted now (not leased, not a
  //! gradient waiting for the optimizer pipeline).
  bool movable(const DeviceSlot& slot) const;
  Status load_to_slot(Chunk& c, DeviceSlot& slot);
  //! Waits until no queued copy still reads c's host copy (before it is written or freed).
  Status wait_host_reads(Chunk& c);
  void prefetch();
  Result<std::byte*> host_buffer(Chunk& c);
  void note_gpu_use();
  //! Adds a span that ends now on `track` (called in the track's stream order).
  void record_span(Track track, std::string name, double enqueued_us, std::uint64_t bytes);

  // --- optimizer.cpp ---
  //! Optimizers run at step() rather than as gradients complete.
  bool deferred() const { return opt.loss_scaling || opt.clip_max_norm > 0.0; }
  // The functions below are called with mu held unless noted (pipeline.cpp).
  void launch_optimizer(FamilyId f);
  void launch_device_optimizer(FamilyId f);
  bool on_nvme(FamilyId f) const;
  void pump();  //!< starts whatever the places allow (Note [Pipeline places])
  void take_nvme_place(FamilyId f);
  void release_nvme_place(FamilyId f);
  void cancel_read_ahead(FamilyId f);
  void read_states(FamilyId f);
  void land_gradient(FamilyId f);
  void maybe_compute(FamilyId f);
  void compute_family(FamilyId f);  // pool thread; takes mu
  void io_done(FamilyId f, Status status, Track track, double enqueued_us, std::uint64_t bytes);  // takes mu
  void writeback_done(FamilyId f, Status status, double enqueued_us, std::uint64_t bytes);        // takes mu
  void release_gradient(FamilyId f, bool consumed);
  void finish_family(FamilyId f, Status status);
  //! Counts the update and drops the stale GPU copy of the family's param.
  void commit_param(FamilyId f);
  std::vector<kernels::Span> spans_for(FamilyId f, const FamilyPtrs& ptrs, std::vector<TensorId>* updated);
  //! kernels::step over spans grouped by step number; no lock needed.
  //! The kernel keys and group hyperparameters of `updated` tensors (for run_kernels). Caller holds mu.
  void kernel_keys(const std::vector<TensorId>& updated, std::vector<std::int64_t>* keys,
                   std::vector<kernels::Hyper>* hypers) const;
  //! `keys` per span: (group << 48) | step number, so each kernel call has one
  //! hyper and one bias-correction step; `hypers` the groups' hyperparameters,
  //! captured under the lock when the run was launched.
  Result<kernels::StepReport> run_kernels(const std::vector<kernels::Span>& spans,
                                          const std::vector<std::int64_t>& steps, float scale,
                                          const std::vector<kernels::Hyper>& hypers);
  //! Enqueues a copy on `stream` and records its span on `track` (start when the
  //! stream reaches it, end when it is done).
  Status timed_copy(const memory::Stream& stream, Track track, void* dst, const void* src,
                    std::uint64_t bytes, memory::CopyKind kind, std::string name);
  //! Waits for this step's optimizer work (not for NVMe write-backs).
  Status wait_step_work(std::unique_lock<std::mutex>& lock);
  //! Waits for everything in the background, NVMe write-backs included.
  Status wait_optimizers(std::unique_lock<std::mutex>& lock);
  void fail(Status status);  // records the first background error

  // --- runtime.cpp ---
  Status finalize(std::unique_lock<std::mutex>& lock);
  Status adopt_plan(std::unique_lock<std::mutex>& lock, StepTrace trace);
  //! Rebuilds the device slots for `p` (all device copies must be clean).
  Status build_slots(const Plan& p);
  //! Moves optimizer states whose home changes between the current plan and `p`.
  Status migrate_homes(std::unique_lock<std::mutex>& lock, const Plan& p);
  //! Gradients to host and one global check (clipping, loss scaling); sets step_scale.
  //! *skip is set when an Inf/NaN skips the step.
  Status deferred_prepass(std::unique_lock<std::mutex>& lock, bool* skip);
  //! Runs fn on a host copy of chunk c (reading NVMe into a temporary when it lives
  //! there); with write, the change is stored back to c's home. Blocks.
  Status with_host_copy(std::unique_lock<std::mutex>& lock, Chunk& c, bool write,
                        const std::function<void(std::byte*)>& fn);
  //! Synchronous NVMe transfer of a whole chunk (unlocks while waiting).
  Status nvme_transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                       std::vector<std::uint32_t>& slots_io);
  Status ensure_nvme_store();
  std::uint64_t largest_optim_chunk() const {
    std::uint64_t largest = 0;
    for (const Chunk& c : chunks) {
      if (is_optim_kind(c.kind)) largest = std::max(largest, c.bytes);
    }
    return largest;
  }
  //! The hyperparameters of `group` (the runtime's, with the group's overrides).
  kernels::Hyper hyper(std::uint32_t group) const {
    kernels::Hyper h = opt.hyper;
    if (group < groups.size() && groups[group].set) {
      h.lr = groups[group].lr;
      h.weight_decay = groups[group].weight_decay;
    }
    return h;
  }
  std::vector<GroupHyper> groups;  //!< per group id; Note [Parameter groups]
};

//! Synthetic trace before the first step: forward in packing order, backward in reverse.
StepTrace registration_trace(std::size_t families);

}  // namespace strata::runtime
