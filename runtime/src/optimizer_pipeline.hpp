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

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "core.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::runtime {

class Residency;

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
  std::vector<std::vector<std::uint32_t>> new_slots;  //!< per kind: the NVMe slots being written
  int io_pending = 0;
  Status status;
  std::uint64_t step = 0;  //!< the step whose update this is (1-based)
};

class OptimizerPipeline {
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
  //! Every trainable tensor of `f` handed its gradient over in the last micro-batch.
  bool gradients_complete(FamilyId f) const;
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
  //! Waits for this step's optimizer work (not for NVMe write-backs).
  Status wait_step_work(std::unique_lock<std::mutex>& lock);
  //! Waits for everything in the background, NVMe write-backs included.
  Status wait_all(std::unique_lock<std::mutex>& lock);
  //! States read ahead for family `f` become stale (a host write replaces them).
  void drop_read_ahead(FamilyId f);

  // --- queries ---
  //! Family f's optimizer has been requested this step: its gradient is the pipeline's.
  bool claims_gradient(FamilyId f) const { return runs_[f].launched; }
  //! Family f's optimizer step is requested and not finished.
  bool updating(FamilyId f) const { return runs_[f].launched && !runs_[f].done; }
  //! Some optimizer step is in flight (it will free slots and notify Core::cv).
  bool busy() const { return tasks_in_flight_ > 0; }
  //! Every launched family applied its update (none skipped for Inf/NaN).
  bool all_applied() const;
  void check_invariants() const;

  float grad_scale = 1.0f;  //!< set_grad_scale's value
  float step_scale = 1.0f;  //!< grad scale the kernels use this step (x clip coefficient)
  bool last_micro_batch = true;
  std::vector<std::uint32_t> trainable;  //!< per family: tensors with gradients

  //! Spans of family f's updated tensors over `ptrs`; their ids into *updated.
  std::vector<kernels::Span> spans_for(FamilyId f, const FamilyPtrs& ptrs, std::vector<TensorId>* updated);

 private:
  void launch_device_optimizer(FamilyId f);
  void take_nvme_place(FamilyId f);
  void release_nvme_place(FamilyId f);
  void cancel_read_ahead(FamilyId f);
  void read_states(FamilyId f);
  void land_gradient(FamilyId f);
  void maybe_compute(FamilyId f);
  void compute_family(FamilyId f);  // pool thread; takes mu
  //! Writes family f's updated NVMe states to fresh slots after its kernel; unlocks `lock`.
  void write_back(FamilyId f, std::unique_lock<std::mutex>& lock);
  void io_done(FamilyId f, Status status, Track track, double enqueued_us, std::uint64_t bytes);  // takes mu
  void writeback_done(FamilyId f, Status status, double enqueued_us, std::uint64_t bytes);        // takes mu
  void release_gradient(FamilyId f, bool consumed);
  void finish_family(FamilyId f, Status status);
  //! Counts the update and drops the stale GPU copy of the family's param.
  void commit_param(FamilyId f);
  //! The kernel keys and group hyperparameters of `updated` tensors (for run_kernels).
  void kernel_keys(const std::vector<TensorId>& updated, std::vector<std::int64_t>* keys,
                   std::vector<kernels::Hyper>* hypers) const;
  //! kernels::step over spans grouped by key; no lock needed. `keys` per span:
  //! (group << 48) | step number, so each kernel call has one hyper and one
  //! bias-correction step; `hypers` the groups' hyperparameters, captured under
  //! the lock when the run was launched.
  Result<kernels::StepReport> run_kernels(const std::vector<kernels::Span>& spans,
                                          const std::vector<std::int64_t>& keys, float scale,
                                          const std::vector<kernels::Hyper>& hypers);

  Core& core_;
  Residency& residency_;
  std::vector<FamilyRun> runs_;
  std::vector<std::uint32_t> grads_written_;  //!< per family: trainable tensors written this micro-batch
  int tasks_in_flight_ = 0;
  std::deque<FamilyId> grad_queue_;    //!< launched families waiting for a grad staging buffer
  std::vector<FamilyId> launch_fifo_;  //!< launched this step, in order
  std::vector<FamilyId> nvme_order_;   //!< NVMe families by traced gradient completion
  std::size_t read_ahead_cursor_ = 0;
  bool read_ahead_ = false;  //!< read NVMe states ahead this step
  int grad_staging_used_ = 0, grad_staging_max_ = 2;
  int nvme_places_used_ = 0, nvme_places_max_ = 2;
  int io_families_ = 0;                //!< families with NVMe reads in flight
  std::vector<WriteBack> writebacks_;  //!< per family (Note [Write-back after step])
  int writebacks_in_flight_ = 0;
  std::uint64_t steps_done_ = 0;  //!< steps ended (end_step); a write-back names its step
};

}  // namespace strata::runtime
