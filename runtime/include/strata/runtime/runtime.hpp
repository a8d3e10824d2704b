#pragma once
// Runtime: the chunk runtime. Registers tensors, packs them into chunk families,
// hands out leases on a tier, traces the warm-up step, plans, and runs each
// family's optimizer step where its states live while backward goes on.
//
// Usage (one training thread):
//
//   auto device = memory::make_device({.kind = memory::DeviceChoice::kSim, ...});
//   auto rt = Runtime::create(**device, options);               // Result<unique_ptr<Runtime>>
//   TensorId w = *(*rt)->register_tensor({"fc1.weight", {512, 512}, DType::kF32});
//   (*rt)->init_tensor(w, initial_values);
//   for (step...) {
//     { Lease p = *rt->acquire(w, StateKind::kParam, Access::kRead, Where::kDevice);
//       rt->launch([&] { forward(p.as<float>()); }); }          // compute stream
//     ...backward: acquire(w, kParam, kRead) and acquire(w, kGrad, kWrite)...
//     auto stats = rt->step();                                  // optimizer, bookkeeping
//   }
//
// Note [Runtime threading]
// The public calls are made from one training thread (they are not safe to call
// concurrently with each other). Internally, copies run on device streams, CPU
// optimizer steps on the thread pool, NVMe I/O on the IoEngine; they synchronise
// with the training thread through one mutex and device events. Device-stream
// callbacks only post to the pool (never take the mutex), so a training thread
// that blocks on a full stream queue while holding the mutex cannot deadlock.
//
// Note [Step semantics]
// A step is: any number of acquire/release calls (forward, then backward; the
// first grad acquisition marks the start of backward), then step(). A family's
// optimizer step starts as soon as the trace says its gradients are complete
// (planned steps) or at step() (the warm-up step, a step that departed from the
// trace, and every step with loss scaling). A tensor whose gradient was not
// written in a step is not updated and its states stay as they were (as in
// torch.optim, where p.grad is None). With loss scaling (set_grad_scale and
// RuntimeOptions::loss_scaling), all gradients are checked for Inf/NaN first and
// an Inf/NaN anywhere skips the whole step with every state unchanged: the
// optimizer is *deferred* to step(), not rolled back. With data parallelism
// (RuntimeOptions::comm) every optimizer step is deferred to step() as well,
// where the ranks reduce gradients and gather params (Note [Sharded step] in
// runtime/src/dp/data_parallel.cpp). With PlanOptions::deferred_updates the
// updates of the families whose gradients complete first run during the next
// forward instead (Note [Deferred updates] in
// runtime/src/pipeline/deferred_updates.cpp): every use and every read between
// steps waits for them, so the values are those of updates that ended in step().

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/comm/communicator.hpp"
#include "strata/common/status.hpp"
#include "strata/kernels/dtype.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/memory/device.hpp"
#include "strata/runtime/cost_model.hpp"
#include "strata/runtime/layout.hpp"
#include "strata/runtime/lease_types.hpp"
#include "strata/runtime/planner.hpp"
#include "strata/runtime/runtime_options.hpp"
#include "strata/runtime/state_kind.hpp"
#include "strata/runtime/stats.hpp"
#include "strata/runtime/stores.hpp"
#include "strata/runtime/tensor.hpp"
#include "strata/runtime/timeline.hpp"

namespace strata::runtime {

class Runtime;

//! A pinned view of one tensor's state on one tier. Move-only; destroying it
//! releases the pin (on the device: an event on the compute stream marks when
//! compute is done with it, and eviction waits for that event). Releasing the
//! last gradient (or param) lease of a family whose gradients are complete
//! starts that family's optimizer step (Note [Gradient completion]; Note
//! [Scheduler] in runtime/src/scheduler.cpp): it queues work, it never blocks.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease();

  bool valid() const { return runtime_ != nullptr; }
  //! The tensor's first element on the leased tier (device memory on kDevice).
  void* data() const;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data());
  }
  std::uint64_t numel() const { return numel_; }
  TensorId tensor() const { return tensor_; }
  StateKind kind() const { return kind_; }
  //! Releases now (idempotent). Releasing twice through copies is impossible: leases are move-only.
  //! Says whether this release started its family's optimizer step (the destructor
  //! can do the same silently: release explicitly to see it).
  Released release();
  //! Releases now without handing anything over: a gradient lease's writes are
  //! not the gradient, and no optimizer step starts; the step is marked failed
  //! (step() or abort_step() discards it; Note [Failed steps]). The destructor
  //! does this when an exception's unwinding destroys the lease. Idempotent.
  void abandon();

 private:
  friend class Runtime;
  Runtime* runtime_ = nullptr;
  //! std::uncaught_exceptions() when acquired: a destructor that sees more runs
  //! in an exception's unwinding and abandons the lease (Note [Failed steps]).
  int uncaught_ = 0;
  void* data_ = nullptr;
  std::uint64_t numel_ = 0;
  TensorId tensor_ = 0;
  StateKind kind_ = StateKind::kParam;
  Access access_ = Access::kRead;
  Where where_ = Where::kDevice;
  std::uint32_t chunk_ = 0;
};

//! Whether the runtime runs optimizer `o`'s steps on a device of `kind` (so a plan
//! may keep everything, optimizer included, on the GPU): the sim device's "kernels"
//! are the CPU ones, so yes; on CUDA, kernels::cuda_step_enqueue runs every
//! optimizer without a host phase between its passes (not lamb, lars, came: those
//! step on the CPU). Thread-safe.
bool gpu_optimizer_supported(memory::DeviceKind kind, kernels::Optimizer o);

//! The chunk runtime. See the usage example above and Note [Runtime threading].
//! strata::Runtime (strata/strata.hpp) is this class, made from a Config and
//! owning its device: one C++ API.
class Runtime {
 public:
  //! Creates a runtime over `device` (not owned; must outlive the runtime).
  //! Fails with InvalidArgument naming a bad option, or the Status of the thread
  //! pool / I/O engine / NVMe directory set-up.
  static Result<std::unique_ptr<Runtime>> create(memory::Device& device, RuntimeOptions options);
  //! Waits for background work, frees every tier, removes the swap files.
  //! (Virtual: a strata::Runtime held as a runtime::Runtime still frees its device.)
  virtual ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  //! Registers a tensor. Fails: InvalidArgument (zero elements, a dtype other than
  //! the compute dtype, a duplicate name), FailedPrecondition after the first acquire.
  Result<TensorId> register_tensor(TensorSpec spec);
  //! Registers a tensor in the compute dtype (register_tensor of a TensorSpec).
  Result<TensorId> register_tensor(std::string name, std::vector<std::int64_t> shape, bool frozen = false);
  //! Looks a tensor up by name (NotFound otherwise).
  Result<TensorId> find_tensor(std::string_view name) const;
  std::size_t tensor_count() const;

  //! Sets a tensor's initial value (fp32 master and compute-dtype param); its
  //! optimizer states start at zero. Valid between steps. Blocks (may read/write NVMe).
  Status init_tensor(TensorId tensor, std::span<const float> values);
  //! init_tensor of several tensors (values[i] for tensors[i]), one host access per
  //! chunk family: a family whose every tensor is among them is written whole,
  //! without reading its old value from NVMe first (deferred init).
  Status init_tensors(std::span<const TensorId> tensors, std::span<const std::span<const float>> values);
  //! Copies a tensor's current state of `kind` (param: as fp32; master: the fp32
  //! master, which is the param for fp32 compute; states) into `out`. Valid between
  //! steps. Blocks. FailedPrecondition for a kind this optimizer does not have.
  Status read_tensor(TensorId tensor, StateKind kind, std::span<float> out);
  //! The param, as read_tensor(tensor, StateKind::kParam, out).
  Status read_tensor(TensorId tensor, std::span<float> out) {
    return read_tensor(tensor, StateKind::kParam, out);
  }
  //! Overwrites one state of a tensor from fp32 values (a checkpoint's load): kParam
  //! sets the param and its master (as init_tensor); kMaster the fp32 master alone
  //! (kept, for fp32 compute, as the param); kState0/kState1 an optimizer state,
  //! rounded to the state dtype. Valid between steps; blocks (may read/write NVMe).
  //! Fails: InvalidArgument (bad id, wrong count), FailedPrecondition (leases held, a
  //! kind this tensor does not have, kGrad).
  Status write_tensor(TensorId tensor, StateKind kind, std::span<const float> values);
  //! The elements of `tensor` whose fp32 master and optimizer states this runtime
  //! holds: the whole tensor on one rank; with W data-parallel ranks, the part in
  //! this rank's shard of its chunk (Note [Sharded step]; count 0: none of it).
  //! read_tensor and write_tensor of kMaster (with a separate master), kState0 and
  //! kState1 read and write only these elements of their span; the rest of `out` is
  //! left as it was. FailedPrecondition before the first acquire/init/step.
  struct StateRange {
    std::uint64_t first = 0, count = 0;
  };
  Result<StateRange> state_range(TensorId tensor) const;
  //! Optimizer steps applied to a tensor so far (its bias-correction step counter;
  //! a tensor that got no gradient in a step does not count it).
  Result<std::int64_t> tensor_steps(TensorId tensor) const;
  //! Sets a tensor's step counter (a checkpoint's load). Valid between steps.
  Status set_tensor_steps(TensorId tensor, std::int64_t steps);

  //! Writes a checkpoint of every tensor's param, fp32 master, optimizer states,
  //! step counter and group (and the groups' lr and weight decay) into `dir`
  //! (created when missing), from whichever tier holds each state (Note
  //! [Checkpoint format], Note [Checkpoint publish] in runtime/checkpoint/format.cpp).
  //! Atomic: a crash or error at any point leaves the previous checkpoint in `dir`
  //! loadable; the older files are removed in the background once it has published
  //! (flush() waits for that). Valid between steps; blocks (flushes first). Fails: InvalidArgument
  //! (`dir` is inside an NVMe swap directory), FailedPrecondition (leases held),
  //! PermissionDenied / NoSpace / IoError naming the file. With data parallelism
  //! (W > 1 ranks) a collective call: every rank calls it on the same directory; the
  //! ranks gather each family's state shards, rank f mod W writes family f's file, rank 0
  //! publishes the manifest, and it fails on every rank
  //! when it fails on one, naming the rank and its error (Note [Sharded checkpoint]).
  Status save_checkpoint(const std::string& dir);
  //! Starts a checkpoint of the state as of this call into `dir` and returns at once
  //! (Note [Overlapped save] in runtime/checkpoint/capture.cpp): training goes on while a
  //! background thread writes it; a family's optimizer update waits only until that
  //! family's pre-update values are captured. Valid between steps (waits for the
  //! previous step's NVMe write-backs, and for a save still in flight, returning its
  //! error). Fails at once as save_checkpoint does for a bad `dir` or held leases;
  //! later errors surface in finish_checkpoint / checkpoint_in_flight, and never touch
  //! the previously published checkpoint. Refused (FailedPrecondition) with W > 1
  //! data-parallel ranks: use save_checkpoint there.
  Status begin_checkpoint(const std::string& dir);
  //! Waits for the save begun by begin_checkpoint and returns its outcome (Ok when
  //! none is in flight or it was published). Blocks.
  Status finish_checkpoint();
  //! Polls the save begun by begin_checkpoint: true while it runs, false when none
  //! runs or it was published; its error when it failed (finish_checkpoint clears it).
  Result<bool> checkpoint_in_flight();
  //! Loads the checkpoint published in `dir` into this runtime, whose chunk size,
  //! budgets and placement may differ from the saving one's (the format is per
  //! tensor). Every file's CRC32C stripes, the names, shapes, optimizer and
  //! format version are checked before any state changes: a bad checkpoint is
  //! refused whole. Valid between steps; blocks. Fails: NotFound (no manifest),
  //! FailedPrecondition (another model, another optimizer, a newer format version,
  //! leases held), Corrupt (a flipped byte, a truncated file), each naming the file.
  //! With W > 1 ranks a collective call; a checkpoint saved at any W loads, and no rank
  //! applies anything unless every rank's checks passed (Note [Sharded checkpoint]).
  Status load_checkpoint(const std::string& dir);

  //! Note [Parameter groups]
  //! Every tensor belongs to one group (0 unless set); a group may override the
  //! optimizer's lr and weight decay (torch's param_groups). The other
  //! hyperparameters are the runtime's. The values in effect when a family's
  //! optimizer step starts are used: set them before backward (a torch LR
  //! scheduler sets the next step's lr after step(), which is in time).
  //! Puts `tensor` in `group` (< 65536). Valid before the first acquire and between steps.
  Status set_tensor_group(TensorId tensor, std::uint32_t group);
  //! Declares that `tensor` is leased together with the other tensors of working set
  //! `set` (a torch module's parameters and its ancestors'): every plan keeps a GPU chunk
  //! slot for each family of the largest set, and one for a gradient (Note [Working sets]
  //! in runtime/src/core/core.cpp). A tensor may be in several sets. Declare before the
  //! first acquire or init; later declarations count from the next plan.
  Status add_to_working_set(TensorId tensor, std::uint32_t set);
  //! Sets group `group`'s lr and weight decay (finite, >= 0). Valid while no
  //! optimizer step runs (between step() and the start of backward); FailedPrecondition otherwise.
  Status set_group_hyper(std::uint32_t group, float lr, float weight_decay);

  //! Pins `tensor`'s `kind` chunk on `where` and returns a view. On the device it
  //! does not wait for the move on the host: the compute stream waits for it. It
  //! blocks only for CPU work the chunk depends on (its family's optimizer step)
  //! or for a free slot. Fails: InvalidArgument (bad id/kind), FailedPrecondition
  //! (a second write lease on the same tensor, a grad of a frozen tensor, kAccumulate
  //! before any write this step), OutOfBudget (every slot pinned: raise the budget).
  Result<Lease> acquire(TensorId tensor, StateKind kind, Access access, Where where = Where::kDevice);
  //! A read lease on the param, on `where` (device by default). Fails as acquire().
  Result<Lease> param(TensorId tensor, Where where = Where::kDevice) {
    return acquire(tensor, StateKind::kParam, Access::kRead, where);
  }
  //! A write (or accumulate) lease on the gradient. Fails as acquire().
  Result<Lease> grad(TensorId tensor, Access access = Access::kWrite, Where where = Where::kDevice) {
    return acquire(tensor, StateKind::kGrad, access, where);
  }

  //! Blocks the host until the lease's memory holds the tensor (its move is done),
  //! for callers that compute on the host thread rather than on the compute stream
  //! (torch CPU math on the sim device). The lease stays valid. Fails with the
  //! device's Status.
  Status wait(const Lease& lease);

  //! The stream compute runs on; leases on kDevice are ordered against it.
  const memory::Stream& compute_stream() const;
  //! Runs fn on the compute stream (the sim device's kernels); the time it takes
  //! counts as compute on the timeline.
  Status launch(std::function<void()> fn);
  //! Waits for everything launched so far. Blocks.
  Status synchronize();

  //! Multiplies every gradient by `scale` (1/loss_scale) from the next optimizer
  //! step on; set it before backward (families start during backward).
  void set_grad_scale(float scale);
  //! Starts a micro-batch: with last = false its gradients are kept (accumulated
  //! by the next micro-batch with Access::kAccumulate) and no optimizer runs.
  Status begin_micro_batch(bool last);
  //! Tensor `tensor` gets no gradient in this micro-batch: the caller's backward
  //! ended without one (a branch unused on this step). Its family's gradients may
  //! then complete before step() (Note [Gradient completion]) and free the host room
  //! an incomplete family holds; without it such a family waits for step(), and many
  //! of them at once can outgrow the plan's room. step() updates the tensor as any
  //! unused one (from an earlier micro-batch's gradient, if it has one). A later
  //! write of its gradient in this micro-batch is refused. Fails: InvalidArgument
  //! (unknown id), FailedPrecondition (frozen; its gradient already handed over or
  //! declared absent in this micro-batch; data parallelism, where every rank hands
  //! every gradient: write zeros instead).
  Status no_gradient(TensorId tensor);

  //! Ends the step: waits for (or runs) every family's optimizer step (not for
  //! the NVMe write-backs of updated states: see flush(); nor for the updates
  //! deferred into the next forward, StepStats::updates_deferred), checks
  //! Inf/NaN, advances the step counter, and after the warm-up step (or a step
  //! that departed from the trace) re-plans. Blocks. Fails with the first error of
  //! a background task (an NVMe EIO, a corrupt chunk); the state of the last
  //! completed step is then intact and the runtime can be destroyed cleanly.
  Result<StepStats> step();

  //! Discards the step in progress (Note [Failed steps] in runtime/src/step_abort.cpp):
  //! after an error, or an exception thrown in the caller's forward or backward,
  //! waits for every piece of background work and launched compute, drops every
  //! gradient of the step (earlier micro-batches included), forgets its trace (the
  //! step counter does not advance) and clears the runtime's error, so the next
  //! step starts clean. Families whose optimizer step already ran keep their update.
  //! step() does the same when it fails. Blocks. Fails: FailedPrecondition while
  //! leases are held (release or destroy them first).
  Status abort_step();

  //! Waits until every state the last step updated is on its home tier: NVMe
  //! write-backs go on after step() returns, overlapping the next forward (Note
  //! [Write-back after step] in runtime/src/pipeline/nvme_pipeline.cpp). Returns the first background error
  //! (a failed write-back keeps that step's states in host memory; read_tensor
  //! reads them). Also waits until the files of checkpoints older than the last one
  //! saved are removed (a save leaves that to a thread of its own once it has
  //! published). Blocks. read_tensor, init_tensor and the destructor flush by themselves.
  Status flush();

  //! Totals since creation (every step() that returned a StepStats).
  const RunStats& stats() const;
  //! "device sim (...); plan: ..." for a progress line or a log.
  std::string describe() const;
  const ChunkLayout& layout() const;
  //! Bytes of the fp32 masters and optimizer states this runtime keeps (on every
  //! tier together): with data parallelism, this rank's share (Note [Sharded step]).
  //! 0 before the layout exists (the first acquire/init/step).
  std::uint64_t state_bytes() const;
  const Plan& plan() const;
  //! How many families' gradients the plan lets be incomplete at once (some of
  //! their trainable tensors' gradients written in this micro-batch, not all: Note
  //! [Gradient completion]): the host room for gradient copies holds that many
  //! (Note [Host room] in runtime/plan/planner.cpp). A caller that may hand
  //! gradients in another order than its warm-up step keeps a gradient that would
  //! open one more family until its family's other gradients arrive (strata.torch
  //! does: Note [Gradients in pieces] in runtime/include/strata/runtime/gradient_order.hpp). Every family
  //! when nothing is evicted or every gradient has room (micro-batches, loss
  //! scaling, clipping, data parallelism); 0 before the layout exists.
  std::size_t incomplete_gradients_max() const;
  //! The cost model's prediction for the current plan with `rates`.
  StepCost predict(const Rates& rates) const;
  const StepTrace& last_trace() const;
  const Timeline& timeline() const;
  //! The hot paths' pool counters. Thread-safe; never blocks on background work.
  HotPathCounters hot_path_counters() const;
  Status write_chrome_trace(const std::string& path) const;

  //! Checks the runtime's internal invariants (the chunk and family state
  //! machines, device slot ownership, the pipeline's counters, lease counts) and
  //! aborts naming the broken condition. Every public call runs it in checked
  //! builds (STRATA_CHECKED); tests call it directly. Takes the runtime's lock.
  void check_invariants() const;

  //! Implementation; public so the .cpp files can share it, opaque to users.
  struct Impl;

 protected:
  //! For strata::Runtime, which owns its device: an empty runtime that start() sets up.
  Runtime();
  //! Sets up an empty runtime over `device` as create() does (fails as it does).
  Status start(memory::Device& device, RuntimeOptions options);

 private:
  friend class Lease;
  friend struct RuntimeTestAccess;  //!< defined by tests only (breaking invariants on purpose)
  Released release(Lease& lease);
  //! A lease destroyed by an exception's unwinding: unpinned, no gradient handed
  //! over, the step marked failed (Note [Failed steps]).
  void abandon(Lease& lease);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::runtime
