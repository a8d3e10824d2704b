// How strata.torch hands gradients to the runtime; see grad_handoff.hpp.
#include "grad_handoff.hpp"

#include <algorithm>
#include <utility>

#include "errors.hpp"
#include "strata/common/log.hpp"

namespace py = pybind11;

namespace strata::torch_binding {

void GradientHandoff::hand_grad(std::uint32_t id, const at::Tensor& grad, bool accumulate) {
  Param& p = (*params_)[id];
  if (grad.is_sparse())
    throw py::value_error(fmt::format("parameter \"{}\": sparse gradients are not supported", p.name));
  if (grad.numel() != static_cast<std::int64_t>(p.numel))
    throw py::value_error(
        fmt::format("parameter \"{}\": gradient of {} elements for {}", p.name, grad.numel(), p.numel));
  if (!order_.has_families()) {
    order_.set_families(families(), trainable());
    kept_.assign(params_->size(), {});
  }
  hand_list_.clear();
  order_.offer(id, static_cast<std::uint64_t>(grad.nbytes()), &hand_list_);
  if (std::find(hand_list_.begin(), hand_list_.end(), id) == hand_list_.end()) {
    kept_[id] = {grad, accumulate};
    log_kept_once();
  }
  hand_listed(id, grad, accumulate);
}

void GradientHandoff::hand_kept() {
  hand_list_.clear();
  order_.take_kept(&hand_list_);
  hand_listed(UINT32_MAX, {}, false);
}

std::vector<std::uint32_t> GradientHandoff::end_backward(const std::vector<bool>& zero_if_missing) {
  std::vector<std::uint32_t> zeroed;
  if (!order_.pending()) return zeroed;
  handings_.clear();
  order_.end_backward(&handings_);
  for (const runtime::GradientOrder::Handing& h : handings_) {
    Param& p = (*params_)[h.tensor];
    if (h.gradient) {
      Kept k = std::exchange(kept_[h.tensor], {});
      hand_now(p, k.grad, k.accumulate);
    } else if (h.tensor < zero_if_missing.size() && zero_if_missing[h.tensor]) {
      hand_now(p, at::zeros({static_cast<std::int64_t>(p.numel)}, p.tensor.options()), false);
      zeroed.push_back(h.tensor);
    } else {
      throw_if(rt_->no_gradient(p.id).with_context(fmt::format("parameter \"{}\" (no gradient)", p.name)));
    }
  }
  return zeroed;
}

void GradientHandoff::begin_micro_batch() {
  hand_kept();  // (backward's end handed them; a backward that never ended did not)
  order_.begin_micro_batch(rt_->incomplete_gradients_max());
}

void GradientHandoff::drop() {
  order_.drop();
  for (Kept& k : kept_) k = {};
}

void GradientHandoff::hand_listed(std::uint32_t id, const at::Tensor& grad, bool accumulate) {
  for (std::uint32_t t : hand_list_) {
    if (t == id) {
      hand_now((*params_)[t], grad, accumulate);
      continue;
    }
    Kept k = std::exchange(kept_[t], {});
    hand_now((*params_)[t], k.grad, k.accumulate);
  }
}

void GradientHandoff::hand_now(Param& p, const at::Tensor& grad, bool accumulate) {
  auto lease = rt_->acquire(p.id, StateKind::kGrad, accumulate ? Access::kAccumulate : Access::kWrite);
  if (!lease.ok()) throw_if(lease.status().with_context(fmt::format("gradient of \"{}\"", p.name)));
  // Sim: torch adds on this thread, after the host wait. Cuda: torch's stream waits for the
  // chunk, and the release's fence waits for torch's copy (Note [Torch's stream]).
  if (stream_order_->active()) {
    stream_order_->torch_after_strata();
  } else {
    throw_if(rt_->wait(*lease));
  }
  at::Tensor dst = at::from_blob(lease->data(), {static_cast<std::int64_t>(p.numel)},
                                 at::TensorOptions().dtype(p.tensor.scalar_type()).device(device_));
  at::Tensor src = grad.reshape({-1});
  if (accumulate) {
    dst.add_(src);
  } else {
    dst.copy_(src);
  }
  stream_order_->strata_after_torch();
}

void GradientHandoff::log_kept_once() {
  if (std::exchange(kept_logged_, true)) return;
  STRATA_LOG_INFO(
      "strata.torch: gradients arrive in another order than the plan's (e.g. one torch.autocast region "
      "around several steps): {} families are incomplete at once, as many as the plan's host room holds; a "
      "gradient that would open more stays a torch tensor until its family completes (Note [Gradients in "
      "pieces] in strata/runtime/gradient_order.hpp; the bytes kept: engine.counters()['kept_bytes_peak'])",
      order_.open());
}

std::vector<std::uint32_t> GradientHandoff::families() const {
  const runtime::ChunkLayout& l = rt_->layout();
  std::vector<std::uint32_t> out(params_->size());
  for (std::size_t i = 0; i < params_->size(); ++i)
    out[i] = static_cast<std::uint32_t>(l.slots.at((*params_)[i].id).family);
  return out;
}

std::vector<bool> GradientHandoff::trainable() const {
  std::vector<bool> out(params_->size());
  for (std::size_t i = 0; i < params_->size(); ++i) out[i] = !(*params_)[i].frozen;
  return out;
}

}  // namespace strata::torch_binding
