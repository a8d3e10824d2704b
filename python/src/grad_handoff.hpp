#pragma once
// GradientHandoff: how strata.torch's Engine (engine.hpp) hands torch's gradients to
// the runtime's grad chunks, in the order the plan can hold (Note [Gradients in
// pieces] in strata/runtime/gradient_order.hpp). A gradient that would open more
// incomplete families than the plan's host room holds stays a torch tensor here
// (kept) until its family's last piece arrives; at backward's end every family some of
// whose gradients came is completed: the kept ones handed, the missing ones declared
// gradient-less (Runtime::no_gradient) or handed zeros where torch would show zeros.
// It holds the engine's runtime and parameters by pointer (attach) and calls the
// runtime with the GIL held; the engine checks parameter ids before calling it.

#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "param.hpp"
#include "strata/runtime/gradient_order.hpp"
#include "strata/strata.hpp"
#include "stream_order.hpp"

namespace strata::torch_binding {

class GradientHandoff {
 public:
  //! The engine's runtime, parameters and device; once, before any other call.
  void attach(strata::Runtime* rt, std::vector<Param>* params, at::Device device, StreamOrder* order) {
    rt_ = rt;
    params_ = params;
    device_ = device;
    stream_order_ = order;
  }

  //! Hands parameter `id`'s gradient to its grad chunk: overwrite (first micro-batch
  //! of a step) or add (later micro-batches); or keeps it until its family's other
  //! gradients arrive. Throws ValueError for a sparse gradient or a wrong size.
  void hand_grad(std::uint32_t id, const at::Tensor& grad, bool accumulate);
  //! Hands every gradient kept back (a backward that never reached its end).
  void hand_kept();
  //! Whether end_backward has work: a family some of whose gradients came this micro-batch, not all.
  bool pending() const { return order_.pending(); }
  //! Backward ended: hands every gradient kept back and completes every family some
  //! of whose gradients came. A tensor of one that got no gradient is declared
  //! gradient-less (Runtime::no_gradient), or, where torch's p.grad would be a zero
  //! tensor (`zero_if_missing[pid]`: Note [Zero gradients] in _grads.py), handed a zero
  //! gradient. Returns the pids handed zeros.
  std::vector<std::uint32_t> end_backward(const std::vector<bool>& zero_if_missing);
  //! A micro-batch starts: what is still kept is handed, and the order takes the
  //! runtime's bound on incomplete families.
  void begin_micro_batch();
  //! Forgets every kept gradient (the engine is closing).
  void drop();

  //! Gradients kept back so far, and the most bytes kept at once (engine.counters()).
  std::uint64_t kept_total() const { return order_.kept_total(); }
  std::uint64_t kept_bytes_peak() const { return order_.kept_bytes_peak(); }

 private:
  //! A gradient kept back: its tensor and whether it accumulates.
  struct Kept {
    at::Tensor grad;
    bool accumulate = false;
  };
  //! Hands the tensors GradientOrder listed (hand_list_): `id`'s gradient is `grad`, the others were kept.
  void hand_listed(std::uint32_t id, const at::Tensor& grad, bool accumulate);
  //! Copies (or adds) `grad` into the parameter's grad chunk through a lease.
  void hand_now(Param& p, const at::Tensor& grad, bool accumulate);
  void log_kept_once();
  std::vector<std::uint32_t> families() const;
  std::vector<bool> trainable() const;

  strata::Runtime* rt_ = nullptr;
  StreamOrder* stream_order_ = nullptr;  //!< Note [Torch's stream]
  std::vector<Param>* params_ = nullptr;
  at::Device device_{at::kCPU};
  runtime::GradientOrder order_;
  std::vector<Kept> kept_;  //!< by parameter index
  std::vector<std::uint32_t> hand_list_;
  std::vector<runtime::GradientOrder::Handing> handings_;
  bool kept_logged_ = false;
};

}  // namespace strata::torch_binding
