#pragma once
// OptimizerPipeline: each family's optimizer step in the current step. It owns
// the families' progress (FamilyRun), gradient completion counting (Note
// [Gradient completion]), the grad staging buffers and NVMe places that bound
// the pipeline (Note [Pipeline places]), NVMe read-ahead, the CPU and device
// optimizer runs, and the NVMe write-backs that outlive the step (Note
// [Write-back after step]). It may call Core (stores, pool, streams, timeline)
// and Residency (loads for device optimizers, host copies, dropping a stale or
// consumed device copy). Every function expects Core::mu held unless its
// comment says "takes mu" (Note [Lock discipline]).

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/core.hpp"
#include "pipeline/family_run.hpp"
#include "residency/pipeline_progress.hpp"
#include "strata/common/assert.hpp"
#include "strata/kernels/cuda.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::runtime {

class Residency;

//! The gradient check of one family in this step (Note [Gradient check on the
//! device]): its finite flag and per-span sums of squares, taken while the
//! gradient was still on the device, so the CPU kernel needs no pass of its own.
struct GradCheckResult {
  bool valid = false;                //!< a check was taken for this step's gradient
  bool finite = true;                //!< written by the check (d2h stream) before the gradient lands
  float scale = 1.0f;                //!< the gradient scale it was taken with
  std::vector<double> span_sq;       //!< per span of grad_spans(), in span order (reused across steps)
  kernels::ExactSum sum_exact;       //!< the exact sum of span_sq's sums (Note [Exact norms])
  std::vector<kernels::Span> spans;  //!< the spans checked (reused across steps)
  double sum_squares() const { return sum_exact.to_double(); }
};

//! A family's kernel arguments, kept across steps so that their vectors keep
//! their capacity (Note [Allocation-free hot paths] in leases.cpp). Written
//! under mu when the run is launched; read by the run (pool or optimizer
//! stream) until it ends; one run per family at a time.
struct KernelCall {
  std::vector<kernels::Span> spans;
  std::vector<std::int64_t> keys;               //!< per span: (group << 48) | step number
  std::vector<kernels::Hyper> hypers;           //!< per parameter group
  std::vector<std::int64_t> distinct;           //!< run_kernels' distinct keys
  std::vector<kernels::Span> group;             //!< run_kernels' spans of one key
  std::vector<kernels::TrustPartial> partials;  //!< LAMB/LARS phase 1, per span of group
  //! LAMB/LARS with W > 1: per updated tensor the exact ||p||² and other² (Note [Exact norms])...
  std::vector<kernels::ExactSum> tensor_sums;
  //! ... and on the wire: kWireDoubles for each of those, then the Inf/NaN flag.
  std::vector<double> norms;
  std::vector<float> trust;  //!< LAMB/LARS with W > 1: per span of group
  //! q8 states: per span of spans, its q8 kernel span (Note [Q8 state chunks]) ...
  std::vector<kernels::Q8Span> q8_spans;
  std::vector<kernels::Q8Span> q8_group;  //!< ... and run_kernels' q8 spans of one key
  float scale = 1.0f;
  double enqueued_us = 0.0;
  std::uint64_t elems = 0;
  Status status;  //!< a device run's result (with report)
  kernels::StepReport report{};
};

//! An NVMe family's updated states on their way to fresh NVMe slots after its
//! optimizer step; outlives the step (Note [Write-back after step]).
struct WriteBack {
  bool active = false;
  std::vector<std::byte*> staging;                    //!< per kind: the updated states
  std::vector<std::vector<std::uint32_t>> new_slots;  //!< per kind: the NVMe slots being written
  std::vector<NvmePiece> writes;                      //!< the pieces being written
  int io_pending = 0;
  Status status;
  std::uint64_t step = 0;  //!< the step whose update this is (1-based)

  //! Back to an idle record; the lists keep their capacity (Note
  //! [Allocation-free hot paths] in leases.cpp).
  void reset() {
    active = false;
    staging.clear();
    for (auto& list : new_slots) list.clear();
    writes.clear();
    io_pending = 0;
    status = Status::Ok();
    step = 0;
  }
};

class OptimizerPipeline final : public PipelineProgress {
 public:
  OptimizerPipeline(Core& core, Residency& residency) : core_(core), residency_(residency) {}

  //! Sizes the per-family records once the layout is known.
  void init(std::size_t family_count);
  //! Takes the adopted plan's limits and the NVMe families' order of gradient
  //! completion in `trace` (Note [Pipeline places]).
  void adopt(const StepTrace& trace);

  // --- gradient completion (Note [Gradient completion]) ---
  //! A tensor of family `f` handed its gradient over for the first time in this micro-batch.
  void note_grad_written(FamilyId f) { ++grads_written_[f]; }
  //! A tensor of family `f` gets no gradient in this micro-batch (Runtime::no_gradient).
  void note_no_gradient(FamilyId f) { ++grads_none_[f]; }
  //! Every trainable tensor of `f` handed its gradient over in the last micro-batch
  //! (or was declared gradient-less, with at least one gradient written).
  bool gradients_complete(FamilyId f) const;
  //! Families some of whose trainable tensors handed their gradient over in this
  //! micro-batch, not all (Runtime::incomplete_gradients_max() bounds them).
  std::size_t incomplete_families() const override;
  //! Starts a micro-batch (last: its gradients complete the step).
  void begin_micro_batch(bool last);

  // --- scheduling ---
  //! Requests family f's optimizer step (a no-op when it has nothing to update
  //! or a lease still writes its gradient).
  void launch_optimizer(FamilyId f);
  //! Starts whatever the places allow (Note [Pipeline places]).
  void pump();
  //! Starts reading NVMe states ahead at the first acquire of a planned step.
  void start_read_ahead();
  //! At step(): no more read-ahead; states read ahead for families that got no
  //! gradient this step are dropped.
  void stop_read_ahead();
  //! Resets the per-step records for the next step.
  void end_step();
  //! Forgets a discarded step (Note [Failed steps]): end_step's resets, the
  //! micro-batch counts, and no step counted. Call once wait_all returned.
  void abandon_step();
  //! Waits for this step's optimizer work (not for NVMe write-backs, nor for the
  //! updates parked for the next forward: Note [Deferred updates]).
  Status wait_step_work(std::unique_lock<std::mutex>& lock);
  //! Waits for everything in the background, NVMe write-backs included; parked
  //! updates run now.
  Status wait_all(std::unique_lock<std::mutex>& lock);
  //! States read ahead for family `f` become stale (a host write replaces them).
  void drop_read_ahead(FamilyId f);

  // --- queries ---
  //! Family f's optimizer has been requested this step: its gradient is the pipeline's.
  //! (A run carried over from the last step, ended or not, claims none of this step's.)
  bool claims_gradient(FamilyId f) const override { return launched_this_step(f); }
  bool launched_this_step(FamilyId f) const {
    return runs_[f].launched() && runs_[f].launched_in == steps_done_;
  }
  //! Family f's optimizer step is requested and not finished.
  bool updating(FamilyId f) const override { return runs_[f].running(); }
  //! Its states are read (or being read) and its param waits for the gradients: at
  //! most one such family per NVMe place.
  bool awaits_staged_param(FamilyId f) const override {
    return runs_[f].param == ParamRead::kAwaitsGradients;
  }
  //! Optimizer steps started so far (launch_optimizer calls that launched one).
  std::uint64_t launches() const { return launches_; }
  //! Some optimizer step is in flight (it will free slots and notify Core::cv); a
  //! parked one whose gradient has landed frees nothing before step() ends (Note
  //! [Deferred updates]).
  bool busy() const override;
  //! An optimizer step of the current step is launched and not finished (a run
  //! carried over from the last step, which keeps that step's hyperparameters, is not).
  bool busy_this_step() const { return tasks_in_flight_ > carried_; }
  //! Runs carried over from the last step still running, and runs parked for the
  //! next forward (Note [Deferred updates]).
  int carried() const { return carried_; }
  int parked() const { return parked_; }
  //! A use needs family f's update now (an access after its gradients completed in
  //! the same step): a parked run goes ahead at once.
  void release_parked(FamilyId f);
  //! Family f's updated NVMe states are still on their way to fresh slots (Note
  //! [Write-back after step]): its chunks' slots hold the value before the step
  //! until the write-back ends (and notifies Core::cv).
  bool writing_back(FamilyId f) const { return writebacks_[f].active; }
  //! Every launched family applied its update (none skipped for Inf/NaN).
  bool all_applied() const;
  //! LAMB or LARS with W > 1: a family's run all-reduces its tensors' norms
  //! between the kernel's two phases, so step() runs the families one at a
  //! time, in family order (Note [Sharded step]).
  bool exchanges_trust() const;
  void check_invariants() const;

  float grad_scale = 1.0f;  //!< set_grad_scale's value
  float step_scale = 1.0f;  //!< grad scale the kernels use this step (x clip coefficient)
  bool last_micro_batch = true;
  std::vector<std::uint32_t> trainable;  //!< per family: tensors with gradients

  //! Spans of family f's updated tensors over `ptrs` into *spans (cleared
  //! first); their ids into *updated (cleared first) unless null.
  void spans_for(FamilyId f, const FamilyPtrs& ptrs, std::vector<kernels::Span>* spans,
                 std::vector<TensorId>* updated);
  //! The spans of family f's gradients at `grad` (no other pointer set), as
  //! grad_stats reads them, into *spans (cleared first).
  void grad_spans(FamilyId f, std::byte* grad, std::vector<kernels::Span>* spans);

  // --- the gradient check (Note [Gradient check on the device]) ---
  //! True when this device can check a gradient in its device slot (sim: yes; CUDA: not yet).
  bool checks_on_device() const;
  //! Enqueues on the d2h stream the check of family f's gradient in device slot
  //! memory `grad` with `scale`; copies enqueued after it on d2h see it done.
  //! Caller has waited the slot's fence on d2h.
  Status check_on_device(FamilyId f, std::byte* grad, float scale);
  //! Checks family f's gradient at host address `grad` now, on the pool (the
  //! fallback: one extra read, counted in take_host_check_bytes()). Call it with
  //! mu released and nothing else using the family's check.
  Status check_on_host(FamilyId f, std::byte* grad, float scale);
  //! Family f's check in this step.
  const GradCheckResult& grad_check(FamilyId f) const { return checks_[f]; }
  //! Gradient bytes the CPU read only to check them since the last take (StepStats::grad_check_host_bytes).
  std::uint64_t take_host_check_bytes() { return host_check_bytes_.exchange(0); }

 private:
  void launch_device_optimizer(FamilyId f);
  //! Enqueues family f's update (calls_[f]) on the optimizer stream of a CUDA
  //! device (Note [CUDA optimizer] in optimizer_run.cpp); a host function then completes it.
  Status enqueue_cuda_optimizer(FamilyId f);
  //! A device optimizer's result (calls_[f]): counts the update, frees the
  //! gradient, ends the family. Takes mu.
  void device_optimizer_done(FamilyId f);
  void take_nvme_place(FamilyId f);
  void release_nvme_place(FamilyId f);
  void cancel_read_ahead(FamilyId f);
  void read_states(FamilyId f);
  //! Posts run.pieces' reads and run.lent_param's copy (io_pending counts them).
  void start_reads(FamilyId f);
  //! Brings a deferred NVMe-homed param into the family's staging (maybe_compute).
  void fetch_deferred_param(FamilyId f);
  //! Copies family f's param from its clean device copy into its staging (d2h
  //! stream; the copy's end readies the family like a read).
  Status copy_param_from_device(FamilyId f);
  //! Appends the NVMe reads of chunk c's value into `buffer`, one per slot.
  void add_read_pieces(const Chunk& c, std::byte* buffer, std::vector<NvmePiece>& pieces) const;
  void land_gradient(FamilyId f);
  void maybe_compute(FamilyId f);
  void compute_family(FamilyId f);  // pool thread; takes mu
  //! Writes family f's updated NVMe states to fresh slots after its kernel; unlocks `lock`.
  void write_back(FamilyId f, std::unique_lock<std::mutex>& lock);
  void io_done(FamilyId f, Status status, Track track, double enqueued_us, std::uint64_t bytes);  // takes mu
  //! One of read_states' pieces ended (mu held): the last one readies the family.
  void read_piece_done(FamilyId f, Status status);
  //! The param's copy from its residency staging buffer ended (pool thread; takes mu).
  void staged_param_copied(FamilyId f);
  void writeback_done(FamilyId f, Status status, double enqueued_us, std::uint64_t bytes);  // takes mu
  //! NvmePieceDone trampolines to io_done (reads) and writeback_done (writes).
  static void nvme_read_done(void* self, FamilyId f, Status status, double enqueued_us, std::uint64_t bytes);
  static void nvme_write_done(void* self, FamilyId f, Status status, double enqueued_us, std::uint64_t bytes);
  void release_gradient(FamilyId f, bool consumed);
  //! The count of landed gradients in `room` (grad staging buffers, or the deferred updates' room).
  int& room_count(GradRoom room) { return room == GradRoom::kHeld ? held_grads_ : grad_staging_used_; }
  //! A parked run goes ahead in this step.
  void unpark(FamilyId f);
  //! At step()'s end a parked run becomes carried: its step's lr, weight decay and
  //! gradient scale are captured for its kernel (Note [Deferred updates]).
  void carry(FamilyId f);
  //! Every running run is parked with its gradient landed (wait_step_work's end).
  bool only_parked_left() const;
  //! A request found no host room (Note [Backpressure]): pump() stops starting work
  //! and fails the runtime when no work in flight can free room.
  void note_no_room(Status status, std::string what);
  //! Pipeline work in flight that ends by itself and frees host memory (a kernel
  //! queued or running, a gradient being copied, NVMe reads or write-backs).
  bool host_work_in_flight() const;
  void finish_family(FamilyId f, Status status);
  //! Counts the update and drops the stale GPU copy of the family's param.
  void commit_param(FamilyId f);
  //! Fills call's spans, keys and group hyperparameters for family f's run over
  //! `ptrs` (and runs_[f].updated), under mu.
  void prepare_call(FamilyId f, const FamilyPtrs& ptrs, KernelCall& call);
  //! kernels::step over call.spans grouped by key; no lock needed. Keys per
  //! span: (group << 48) | step number, so each kernel call has one hyper and
  //! one bias-correction step; hypers: the groups' hyperparameters, captured
  //! under the lock when the run was launched. `checked`: the family's gradient
  //! check (kCallerChecked), or null for the kernel's own pass (kSeparatePass).
  Result<kernels::StepReport> run_kernels(FamilyId f, KernelCall& call, const kernels::GradStats* checked);
  //! run_kernels for LAMB/LARS with W > 1: phase 1 on this rank's parts, the
  //! per-tensor partial sums all-reduced over the ranks, phase 2 with the
  //! whole tensors' trust ratios. Every rank takes part, even with no part of f.
  Result<kernels::StepReport> run_trust_exchanged(FamilyId f, KernelCall& call,
                                                  const kernels::GradStats* checked);

  Core& core_;
  Residency& residency_;
  std::vector<FamilyRun> runs_;
  std::vector<std::uint32_t> grads_written_;  //!< per family: trainable tensors written this micro-batch
  std::vector<std::uint32_t> grads_none_;     //!< per family: declared gradient-less this micro-batch
  int tasks_in_flight_ = 0;
  std::uint64_t launches_ = 0;
  std::vector<FamilyId>
      grad_queue_;  //!< launched families waiting for a grad staging buffer, in launch order
  std::vector<FamilyId> launch_fifo_;  //!< launched this step, in order
  std::vector<FamilyId> nvme_order_;   //!< NVMe families by traced gradient completion
  std::vector<char> defer_;            //!< per family: its update is deferred (Note [Deferred updates])
  int held_grads_ = 0, held_max_ = 0;  //!< deferred updates' gradients on host, and their room
  int parked_ = 0;                     //!< runs parked this step
  int carried_ = 0;                    //!< runs carried over from the last step, still running
  bool park_ = true;                   //!< this step parks deferred families (wait_all clears it)
  std::size_t read_ahead_cursor_ = 0;
  bool read_ahead_ = false;  //!< read NVMe states ahead this step
  int grad_staging_used_ = 0, grad_staging_max_ = 2;
  int nvme_places_used_ = 0, nvme_places_max_ = 2;
  int io_families_ = 0;                //!< families with NVMe reads in flight
  Status no_room_;                     //!< set by note_no_room during a pump()
  std::vector<WriteBack> writebacks_;  //!< per family (Note [Write-back after step])
  int writebacks_in_flight_ = 0;
  std::uint64_t steps_done_ = 0;         //!< steps ended (end_step); a write-back names its step
  std::vector<GradCheckResult> checks_;  //!< per family: this step's gradient check
  std::vector<KernelCall> calls_;        //!< per family: its kernel's arguments
  std::vector<std::vector<kernels::CudaStepScratch>> cuda_scratch_;  //!< per family, per kernel call (CUDA)
  std::atomic<std::uint64_t> host_check_bytes_{0};  //!< gradient bytes read on the host only to check them
};

}  // namespace strata::runtime
