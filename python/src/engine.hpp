#pragma once
// Engine: strata.torch._C.Engine, one strata::Runtime and the torch parameters
// handed to it. Python's hooks call bind/unbind/hand_grad
// (python/strata/torch/_hooks.py, _grads.py). What it does with a parameter's storage between
// steps is param_views.cpp (param.hpp), how it hands gradients over is
// grad_handoff.cpp; the methods are in engine.cpp and param_binds.cpp (binds), the module in
// binding.cpp.

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "errors.hpp"
#include "grad_handoff.hpp"
#include "param.hpp"
#include "strata/strata.hpp"
#include "stream_order.hpp"

namespace strata::torch_binding {

namespace py = pybind11;

//! model.strata.totals: the runtime's running totals (runtime::Runtime::stats(), the
//! one place they are kept, #26), under the keys _wrap.py always had.
py::dict totals_dict(const Stats& s);

class Engine {
 public:
  //! A runtime from JSON config text (the facade's keys). Throws on a bad config.
  //! `comm` (may be null: one rank) is this rank's end of the data-parallel group
  //! the runtime shards over (Note [Ranks under torchrun] in strata/torch/_processes.py).
  explicit Engine(const std::string& config_json, std::shared_ptr<comm::Communicator> comm = nullptr);
  ~Engine() { close(); }

  //! Frees the runtime (and its swap files). Bound params go back to poison first.
  void close();

  //! Registers `param` (contiguous, on the engine's device kind, with its own
  //! storage) under `name`; its values are copied in by adopt().
  std::uint32_t register_param(const std::string& name, const at::Tensor& param, bool frozen);

  //! Copies the parameter's current values into the runtime and points its
  //! storage at its poison region (the torch memory is freed).
  void adopt(std::uint32_t id);

  //! Deferred init (Note [Deferred init] in strata/torch/_deferred.py): points the
  //! parameter's storage at its poison region without copying values (its torch
  //! memory, never written, is freed); init_values() gives the runtime its values.
  void adopt_unset(std::uint32_t id);

  //! Deferred init: the values of several parameters (any float dtype, each its parameter's
  //! numel) as their initial value, in one Runtime::init_tensors: a chunk family whose every
  //! tensor is among them is written once, without reading it first. Empty lists fix the layout
  //! (finalize, through a flush).
  void init_many(const std::vector<std::uint32_t>& ids, const std::vector<at::Tensor>& values);

  //! This rank's part of a parameter's optimizer states, (first, count) in its elements: all of
  //! it with one rank, 1/W-ish of it under data parallelism (Note [Sharded step]).
  std::pair<std::uint64_t, std::uint64_t> state_range(std::uint32_t id);

  //! The chunk family of a parameter (-1 before the layout is fixed).
  std::int64_t family_of(std::uint32_t id);

  //! The chunk layout the runtime chose (fixed by the first init, acquire or step): chunk_elems,
  //! families, numel, capacity_elems, padding_fraction (layout.chunk_elems 0 = its own search),
  //! the plan's bytes per tier (plan_gpu_bytes, plan_host_bytes, plan_nvme_bytes) and whether it keeps
  //! every family's params on the device for the whole step (plan_params_resident).
  py::dict layout();

  //! Gives a parameter real torch memory again with its current value (the
  //! engine is about to be closed or rebuilt).
  void restore(std::uint32_t id);

  //! Makes the parameter's storage hold its value (counted; Note [Rebinding storage]).
  void bind(std::uint32_t id);

  // Note [Batched binds]
  // A module's hooks bind and unbind all of its parameters in one call (bind_many,
  // unbind_many): one crossing from Python per module and hook instead of one per
  // parameter, and the GIL is released once around every acquire and wait of the
  // module (a wait for a chunk still loading, or for its optimizer, no longer holds
  // up other Python threads). A parameter already bound (tied, or the module's
  // subtree bound by its parent) only counts the bind: no lease, no lock, no wait.
  // unbind_many answers whether a poisoned region was touched since the last check
  // (any_poison_hit(), one atomic load), so the hook asks for names only then.
  void bind_many(const std::vector<std::uint32_t>& ids);
  bool unbind_many(const std::vector<std::uint32_t>& ids);

  //! Undoes one bind(); the last one points the storage at poison and releases the lease.
  void unbind(std::uint32_t id);

  //! Unbinds every parameter, whatever its count (the sweep at the end of backward).
  void unbind_all();

  //! Torch's current CUDA stream (torch.cuda.current_stream().cuda_stream), which binds
  //! and releases are ordered against (Note [Torch's stream]); set at each forward's start.
  //! Ignored on the sim device.
  void set_torch_stream(std::uintptr_t stream);

  int binds(std::uint32_t id) { return param(id).binds; }

  // --- Gradients (Note [Gradients in pieces]; GradientHandoff, grad_handoff.hpp) ---
  //! Hands a parameter's gradient over: its grad chunk, or kept until its family's other gradients arrive.
  void hand_grad(std::uint32_t id, const at::Tensor& grad, bool accumulate);
  //! Whether end_backward has work.
  bool gradients_pending() const { return grads_.pending(); }
  //! Backward ended: completes every family some of whose gradients came (GradientHandoff::end_backward).
  std::vector<std::uint32_t> end_backward(const std::vector<bool>& zero_if_missing);

  //! The names of parameters touched while unbound since the last call (their
  //! regions fault again afterwards). Empty, cheaply, when none.
  std::vector<std::string> poison_hits();

  void begin_micro_batch(bool last);
  void set_grad_scale(float scale) { rt_->set_grad_scale(scale); }
  void set_tensor_group(std::uint32_t id, std::uint32_t group);
  void set_group_hyper(std::uint32_t group, float lr, float weight_decay);

  //! A state of a parameter as a new fp32 CPU tensor of the parameter's shape.
  at::Tensor read_tensor(std::uint32_t id, int kind);

  void write_tensor(std::uint32_t id, int kind, const at::Tensor& values);

  std::int64_t tensor_steps(std::uint32_t id) { return value_or_throw(rt_->tensor_steps(param(id).id)); }
  void set_tensor_steps(std::uint32_t id, std::int64_t steps);
  void add_to_working_set(std::uint32_t id, std::uint32_t set);

  //! Ends the step (optimizer, re-planning); the step's figures as a dict.
  py::dict step();

  //! Unbinds every parameter and discards the step in progress (Note [Failed
  //! steps]): after an exception in forward or backward.
  void abort_step();

  void flush();

  //! Runtime::save_checkpoint / load_checkpoint (docs/checkpoint.md).
  void save_checkpoint(const std::string& dir);
  //! Runtime::begin_checkpoint / finish_checkpoint (Note [Overlapped save]).
  void begin_checkpoint(const std::string& dir);
  void finish_checkpoint();
  bool checkpoint_in_flight();
  void load_checkpoint(const std::string& dir);

  std::string describe();
  std::string device_kind() { return device_.is_cuda() ? "cuda" : "cpu"; }
  //! Whether the runtime keeps a separate fp32 master (compute dtype other than fp32).
  bool separate_master() { return rt_->config().runtime.compute_dtype != runtime::DType::kF32; }
  void write_chrome_trace(const std::string& path) { throw_if(rt_->write_chrome_trace(path)); }

  // --- Parameters between steps (Note [Parameters between steps]) -------------------------------

  //! Fills an unbound parameter's poison region with its current value and seals it
  //! read-only: its storage (which points there) reads the value until the next
  //! sync_views(). A no-op when it is bound, already a view, or replaced by
  //! `p.data = t`. Blocks (may read NVMe). Throws StrataError on CUDA (the region
  //! is host memory) naming the parameter and the calls that return its value.
  void materialise(std::uint32_t id);

  //! Hands every parameter written between steps (through a view, or replaced by
  //! `p.data = t`) to the runtime and puts every view back to poison. Returns the
  //! names of the parameters written. O(parameters) pointer checks when none is.
  std::vector<std::string> sync_views();

  //! sync_views(), then every view back to poison: the runtime is about to change
  //! the values (step()); _views.py makes the parameters lazy again.
  void drop_views();

  //! The binding's work so far (Note [Step counters] in _grads.py): calls from hooks
  //! (bind, unbind, hand_grad; a batched call counts once) and param leases taken.
  py::dict counters() const;

  //! Totals since the engine was created (totals_dict); after close(), its last ones.
  py::dict totals() const { return totals_dict(rt_ != nullptr ? rt_->stats() : closed_totals_); }

  //! Whether parameter `id` is a view between steps (for tests).
  bool is_view(std::uint32_t id) { return param(id).poison.in_view(); }

 private:
  void check_open() const;
  Param& param(std::uint32_t id);
  static StateKind to_kind(int kind);
  //! Values of parameters whose view the runtime changed (write, load_checkpoint) are read again.
  void refresh_view(Param& p);
  //! push_written(), then the region back to poison.
  void drop_view(Param& p);
  //! The lease of a parameter whose count just went 0 -> 1; undoes the count on failure.
  //! Runs without the GIL (touches no Python object).
  void bind_now(Param& p);
  //! What an OutOfBudget while binding adds: the parameters bound at that point (the working set).
  std::string working_set_note() const;
  //! Releases the parameter's lease, its fence after torch's queued work (Note [Torch's
  //! stream]). A batch passes one flag: the first release orders, and sets it.
  void unbind_now(Param& p, bool* ordered = nullptr);

  std::unique_ptr<strata::Runtime> rt_;
  at::Device device_{at::kCPU};
  std::vector<Param> params_;
  std::uint64_t crossings_ = 0;
  std::uint64_t param_leases_ = 0;
  StreamOrder order_;      //!< Note [Torch's stream]: cuda only
  GradientHandoff grads_;  //!< Note [Gradients in pieces]: the order gradients reach the runtime
  Stats closed_totals_;    //!< rt_->stats() when close() freed the runtime
};

}  // namespace strata::torch_binding
