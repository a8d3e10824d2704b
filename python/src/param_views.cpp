// What the binding does with a parameter's storage between steps; see param.hpp.
//
// Note [Parameters between steps]
// Between steps an unbound parameter's storage points at its poison region. torch
// code that reads or writes it there (p.data, print(p), p.norm(), ema.copy_(p),
// nn.init.*, p.mul_ under no_grad) must see and change strata's value:
//   - Reads materialise on demand. Between steps (after step(), after wrap, after a
//     no_grad forward) _views.py switches each parameter's Python class to a
//     subclass with __torch_function__ (Note [Lazy parameters] in _views.py); the
//     first torch call on it calls materialise(): open_view() maps fresh pages over
//     the region, read_tensor copies the current value in (from whichever tier holds
//     it: host, the sim device, NVMe) and seal_view() makes it read-only. The
//     storage pointer does not change. Cost: nothing for a parameter no one reads
//     (two class assignments per step); one copy of the parameter (an NVMe read for an
//     NVMe-homed one) for one that is read.
//   - Why a copy and not the chunk's own host memory: a pointer into the runtime's
//     memory is valid only until the runtime's next call or background move (the
//     next step's re-plan, an NVMe write-back freeing a staging buffer, an evicted
//     device slot), and the runtime would not see writes to it. A binding-owned copy
//     can never dangle and costs only what is read.
//   - Writes are caught by page protection: the first write to a sealed view faults,
//     the handler marks it dirty and makes it writable (poison.hpp), so writes through
//     any alias (p.data, numpy, a raw pointer) are seen. `p.data = t` gives the tensor
//     another storage, which sync_views() sees by comparing with the one adopt() found.
//   - sync_views() runs before every runtime call that reads or writes state
//     (begin_micro_batch, read, write, flush, checkpoints): it hands each written
//     parameter to the runtime with init_tensor (param and fp32 master, every stale
//     copy dropped) and seals its view again (it holds the value handed). A replaced
//     storage is swapped back after its values are taken (a wrong shape or dtype is
//     dropped and raises, naming the parameter). Views end where the runtime's value
//     changes or a lease takes over: bind() (the next forward) and step() hand what was
//     written and put the region back to poison (_views.py makes the parameters lazy
//     again after step()); write() and load_checkpoint() read an existing view again.
//   - The read window: between step() and the next forward, and after a no_grad
//     forward. Between the last backward of a step and step() strata's optimizer may
//     already have updated a parameter (it overlaps backward) while torch would show
//     the old value, so a read there raises, naming the parameter (_views.py).
//   - CUDA: the region is host memory, so a read raises at the read naming
//     model.strata.read_param and model.state_dict() (not served yet).
#include <fmt/ranges.h>

#include <span>

#include "errors.hpp"
#include "param.hpp"

namespace py = pybind11;

namespace strata::torch_binding {

void fill_view(strata::Runtime& rt, Param& p) {
  throw_if(p.poison.open_view());
  Status st = Status::Ok();
  {
    py::gil_scoped_release release;
    if (p.dtype == at::kFloat) {
      st = rt.read_tensor(p.id, std::span<float>(static_cast<float*>(p.poison.data()), p.numel));
    } else {
      std::vector<float> values(p.numel);
      st = rt.read_tensor(p.id, values);
      if (st.ok()) view_of(p).copy_(at::from_blob(values.data(), {static_cast<std::int64_t>(p.numel)}));
    }
  }
  if (!st.ok()) {
    p.poison.rearm();
    throw_if(st.with_context(fmt::format("reading parameter \"{}\" between steps", p.name)));
  }
  p.poison.seal_view();
}

bool push_written(strata::Runtime& rt, Param& p) {
  const bool swapped = replaced(p);
  const bool dirty = swapped || p.poison.view_dirty();
  if (dirty) {
    if (p.tensor.sizes() != at::IntArrayRef(p.shape) || p.tensor.scalar_type() != p.dtype) {
      const std::string message = fmt::format(
          "strata.torch: parameter \"{}\" was given a tensor of shape [{}] and dtype {} between steps; "
          "strata "
          "keeps it as shape [{}] and dtype {}, so the assignment was dropped: assign values of that shape "
          "and dtype (p.data.copy_(t)), or build the model with the new shape before wrapping",
          p.name, fmt::join(p.tensor.sizes(), ", "), std::string(c10::toString(p.tensor.scalar_type())),
          fmt::join(p.shape, ", "), std::string(c10::toString(p.dtype)));
      restore_home(p);
      throw py::value_error(message);
    }
    at::Tensor values = p.tensor.detach().to(at::kCPU).to(at::kFloat).contiguous().reshape({-1});
    Status st;
    {
      py::gil_scoped_release release;
      st = rt.init_tensor(p.id, std::span<const float>(values.data_ptr<float>(), p.numel));
    }
    throw_if(st.with_context(fmt::format("parameter \"{}\" written between steps", p.name)));
    if (swapped) {
      restore_home(p);
      throw_if(p.poison.open_view());
      view_of(p).copy_(values);
    }
    p.poison.seal_view();
  }
  return dirty;
}

void restore_home(Param& p) {
  if (replaced(p)) {
    // set_data, as `p.data = t` does: set_ would give the parameter a new gradient
    // accumulator, and the binding's gradient hook is on the old one.
    at::NoGradGuard no_grad;
    at::Tensor home = at::empty({0}, p.tensor.options().requires_grad(false));
    home.set_(p.home, 0, at::IntArrayRef(p.shape));
    p.tensor.set_data(home);
  }
  p.poison.rearm();
}

}  // namespace strata::torch_binding
