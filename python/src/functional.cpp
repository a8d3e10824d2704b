// strata.torch._C.fused_step: strata's fused optimizer kernel over plain torch tensors
// (strata.torch.functional), for comparing strata.torch training with torch-only
// training that uses the same arithmetic. Apart from the Engine (engine.hpp):
// it holds no runtime, only the kernels (issue #26).
#include "functional.hpp"

#include <torch/extension.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "errors.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/optim.hpp"

namespace py = pybind11;

namespace strata::torch_binding {
namespace {

struct FloatKey {
  const char* name;
  float kernels::Hyper::*field;
};
struct BoolKey {
  const char* name;
  bool kernels::Hyper::*field;
};
// The torch-style names step_() takes (python/strata/torch/functional.py), one per Hyper field.
constexpr FloatKey kFloatKeys[] = {{"lr", &kernels::Hyper::lr},
                                   {"beta1", &kernels::Hyper::beta1},
                                   {"beta2", &kernels::Hyper::beta2},
                                   {"eps", &kernels::Hyper::eps},
                                   {"weight_decay", &kernels::Hyper::weight_decay},
                                   {"momentum", &kernels::Hyper::momentum},
                                   {"dampening", &kernels::Hyper::dampening},
                                   {"trust_coefficient", &kernels::Hyper::trust_coefficient},
                                   {"lr_decay", &kernels::Hyper::lr_decay}};
constexpr BoolKey kBoolKeys[] = {{"nesterov", &kernels::Hyper::nesterov},
                                 {"bias_correction", &kernels::Hyper::bias_correction},
                                 {"lars_clip", &kernels::Hyper::lars_clip}};

//! kernels::Hyper for `optimizer` from a dict of torch-style names: the optimizer's
//! defaults (kernels::optimizer_defaults, as the runtime's config has them), then
//! every key given. `caller` opens the errors.
kernels::Hyper hyper_of(const char* caller, const std::string& optimizer, const py::dict& hyper) {
  Result<kernels::Optimizer> parsed = kernels::parse_optimizer(optimizer);
  if (!parsed.ok()) throw py::value_error(fmt::format("{}: {}", caller, parsed.status().message()));
  kernels::Hyper h = kernels::optimizer_defaults(*parsed);
  for (auto item : hyper) {
    const std::string key = py::str(item.first);
    bool known = false;
    for (const FloatKey& k : kFloatKeys) {
      if (key == k.name) {
        h.*k.field = item.second.cast<float>();
        known = true;
      }
    }
    for (const BoolKey& k : kBoolKeys) {
      if (key == k.name) {
        h.*k.field = item.second.cast<bool>();
        known = true;
      }
    }
    if (!known) throw py::value_error(fmt::format("{}: unknown hyperparameter \"{}\"", caller, key));
  }
  return h;
}

//! hyper_of for fused_step, which refuses came.
kernels::Hyper parse_hyper(const std::string& optimizer, const py::dict& hyper) {
  Result<kernels::Optimizer> parsed = kernels::parse_optimizer(optimizer);
  if (parsed.ok() && *parsed == kernels::Optimizer::kCame)
    throw py::value_error(
        "fused_step: came keeps factored second moments per whole tensor (kernels::came_step), which this "
        "one-flat-tensor step does not take; train with strata.torch's optimizer, or pick another optimizer");
  return hyper_of("fused_step", optimizer, hyper);
}

// Note [Optimizer state names]
// The full-size states each optimizer's kernel keeps, in state order (Span::state[0], [1]: the
// runtime's STATE0, STATE1), as kernels/hyper.hpp lists them, under the names torch.optim's
// state_dict gives them (the kernels follow torch.optim's rules, and strata.torch's optimizers
// read and write torch's format, optim.py). How many an optimizer keeps for given
// hyperparameters (SGD without momentum: none) is kernels::optimizer_state_count's answer, not
// this table's. _C.optimizer_states is the one place strata.torch takes them from.
struct StateNames {
  kernels::Optimizer optimizer;
  const char* names[2];
};
constexpr StateNames kStateNames[] = {{kernels::Optimizer::kAdam, {"exp_avg", "exp_avg_sq"}},
                                      {kernels::Optimizer::kAdamW, {"exp_avg", "exp_avg_sq"}},
                                      {kernels::Optimizer::kLamb, {"exp_avg", "exp_avg_sq"}},
                                      {kernels::Optimizer::kLars, {"momentum_buffer", nullptr}},
                                      {kernels::Optimizer::kSgd, {"momentum_buffer", nullptr}},
                                      {kernels::Optimizer::kLion, {"exp_avg", nullptr}},
                                      {kernels::Optimizer::kAdagrad, {"sum", nullptr}}};

//! The names of the states `optimizer` keeps with hyperparameters `hyper` (torch-style names, as
//! fused_step takes them), in state order (Note [Optimizer state names]). Throws ValueError for
//! an unknown optimizer or hyperparameter, and for came (its second moments are factored per
//! tensor, came.hpp: no flat state to name).
py::tuple optimizer_states(const std::string& optimizer, const py::dict& hyper) {
  const kernels::Hyper h = hyper_of("optimizer_states", optimizer, hyper);
  const std::uint32_t count = kernels::optimizer_state_count(h);
  for (const StateNames& s : kStateNames) {
    if (s.optimizer != h.optimizer) continue;
    py::list names;
    for (std::uint32_t k = 0; k < count; ++k) {
      if (k >= std::size(s.names) || s.names[k] == nullptr)
        throw StrataError(fmt::format("optimizer_states: {} keeps {} states, {} named", optimizer, count, k));
      names.append(s.names[k]);
    }
    return py::tuple(names);
  }
  throw py::value_error(
      fmt::format("optimizer_states: {} keeps no flat states (kernels/hyper.hpp)", optimizer));
}

kernels::DType kernel_dtype(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? kernels::DType::kBF16
         : t.scalar_type() == at::kHalf   ? kernels::DType::kF16
                                          : kernels::DType::kF32;
}

//! A pool of `threads` workers for fused_step, kept for the process (one per count asked for).
ThreadPool* fused_step_pool(std::int64_t threads) {
  static std::mutex mu;
  static std::map<std::int64_t, std::unique_ptr<ThreadPool>> pools;
  if (threads <= 1) return nullptr;
  std::lock_guard lock(mu);
  auto& pool = pools[threads];
  if (!pool) {
    auto made = ThreadPool::create({.threads = static_cast<std::size_t>(threads)});
    throw_if(made.status());
    pool = std::move(made).value();
  }
  return pool.get();
}

//! strata's fused kernels here run on the CPU: every tensor fused_step reads or writes must be
//! a CPU tensor (a CUDA one's data pointer read on the host would fault).
void check_on_cpu(const at::Tensor& param, const at::Tensor& grad, const std::vector<at::Tensor>& states,
                  const std::optional<at::Tensor>& param_copy) {
  auto refuse = [](std::string_view what, const at::Tensor& t) {
    if (t.device().is_cpu()) return;
    throw py::value_error(fmt::format(
        "fused_step: {} is on {}, but strata.torch.functional runs strata's CPU kernels: pass CPU tensors "
        "(.cpu()), or train through strata.torch.wrap, whose runtime steps where the optimizer states live",
        what, t.device().str()));
  };
  refuse("param", param);
  refuse("grad", grad);
  for (const at::Tensor& t : states) refuse("a state", t);
  if (param_copy.has_value()) refuse("param_copy", *param_copy);
}

//! strata's fused optimizer kernel over torch tensors (strata.torch.functional):
//! one step for one tensor, in place. fp32 master (param), any-dtype grad, fp32
//! or bf16 states (bf16: Adam, AdamW, LAMB), an optional bf16/fp16 param copy
//! written in the same pass, on `threads` threads (1: the calling thread).
//! grad_checked: the caller vouches the gradients are finite (the runtime's path
//! when the device checked them; kernels/optim.hpp's Note [Inf/NaN and untouched
//! states]: the fused pass still fails on a non-finite one, after writing).
void fused_step(const std::string& optimizer, at::Tensor param, const at::Tensor& grad,
                std::vector<at::Tensor> states, std::int64_t step, py::dict hyper, float grad_scale,
                std::optional<at::Tensor> param_copy, std::int64_t threads, bool grad_checked) {
  check_on_cpu(param, grad, states, param_copy);
  if (param.scalar_type() != at::kFloat || !param.is_contiguous() || !grad.is_contiguous())
    throw py::value_error("fused_step: param must be contiguous fp32, grad contiguous");
  if (grad.numel() != param.numel()) throw py::value_error("fused_step: grad must have the param's size");
  kernels::Span s;
  s.n = static_cast<std::uint64_t>(param.numel());
  s.master = param.data_ptr<float>();
  s.param_dtype = kernels::DType::kNone;
  if (param_copy.has_value()) {
    const at::Tensor& c = *param_copy;
    if (c.scalar_type() == at::kFloat || !c.is_contiguous() || c.numel() != param.numel())
      throw py::value_error(
          "fused_step: param_copy must be a contiguous bf16 or fp16 tensor of the param's size");
    s.param = c.data_ptr();
    s.param_dtype = kernel_dtype(c);
  }
  s.grad = static_cast<const std::byte*>(grad.data_ptr());
  s.grad_dtype = kernel_dtype(grad);
  if (states.size() > s.state.size()) throw py::value_error("fused_step: too many states");
  const auto state_type = states.empty() ? at::kFloat : states[0].scalar_type();
  for (std::size_t i = 0; i < states.size(); ++i) {
    if ((state_type != at::kFloat && state_type != at::kBFloat16) || states[i].scalar_type() != state_type ||
        states[i].numel() != param.numel() || !states[i].is_contiguous())
      throw py::value_error(
          "fused_step: states must be contiguous tensors of the param's size, all fp32 or all bf16");
    s.state[i] = static_cast<std::byte*>(states[i].data_ptr());
  }
  s.state_dtype = state_type == at::kBFloat16 ? kernels::DType::kBF16 : kernels::DType::kF32;
  if (threads < 1) throw py::value_error("fused_step: threads must be >= 1");
  const kernels::GradStats checked{.sum_squares = 0.0, .finite = true};
  kernels::StepArgs args{.hyper = parse_hyper(optimizer, hyper),
                         .step = step,
                         .grad_scale = grad_scale,
                         .spans = std::span(&s, 1),
                         .pool = fused_step_pool(threads)};
  if (grad_checked) {
    args.check = kernels::GradCheck::kCallerChecked;
    args.checked = &checked;
  }
  kernels::StepReport report;
  {
    py::gil_scoped_release release;
    auto r = kernels::step(args);
    throw_if(r.status());
    report = r.value();
  }
  if (!report.applied) throw StrataError("fused_step: a gradient was Inf/NaN; nothing was updated");
}

}  // namespace

void register_functional(py::module_& m) {
  m.def("fused_step", &fused_step, py::arg("optimizer"), py::arg("param"), py::arg("grad"), py::arg("states"),
        py::arg("step"), py::arg("hyper"), py::arg("grad_scale") = 1.0f, py::arg("param_copy") = std::nullopt,
        py::arg("threads") = 1, py::arg("grad_checked") = false);
  m.def("optimizer_states", &optimizer_states, py::arg("optimizer"), py::arg("hyper"));
}

}  // namespace strata::torch_binding
