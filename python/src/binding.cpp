// strata.torch._C: the torch extension under strata.torch. An Engine owns one
// strata::Runtime and the torch parameters handed to it; Python's hooks call
// bind/unbind/hand_grad (python/strata/torch/_wrap.py).
//
// Note [Rebinding storage]
// A parameter keeps its torch.nn.Parameter object and its StorageImpl for its
// whole life; only the StorageImpl's data pointer changes: to the param chunk's
// lease (bind) or to the parameter's poison region (unbind, Note [Poisoned
// parameters]). Views autograd saved share the StorageImpl, so they follow. A
// parameter bound by several modules at once (tied weights, a layer called twice)
// keeps one lease and a count of binds.
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "poison.hpp"
#include "strata/common/log.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/strata.hpp"

namespace py = pybind11;

namespace strata::torch_binding {
namespace {

//! Thrown for every failed strata call; Python sees strata.torch.StrataError
//! (a RuntimeError), or ValueError for InvalidArgument.
struct StrataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void throw_if(const Status& status) {
  if (status.ok()) return;
  if (status.code() == StatusCode::kInvalidArgument) throw py::value_error(status.to_string());
  throw StrataError(status.to_string());
}

template <typename T>
T value_or_throw(Result<T> result) {
  throw_if(result.status());
  return std::move(result).value();
}

at::ScalarType torch_dtype(runtime::DType dtype) {
  switch (dtype) {
    case runtime::DType::kBF16:
      return at::kBFloat16;
    case runtime::DType::kF16:
      return at::kHalf;
    default:
      return at::kFloat;
  }
}

//! One parameter handed to the runtime.
struct Param {
  std::string name;
  at::Tensor tensor;  //!< the torch.nn.Parameter (its StorageImpl is rebound)
  TensorId id = 0;
  std::uint64_t numel = 0;
  PoisonRegion poison;
  std::optional<Lease> lease;
  int binds = 0;
};

class Engine {
 public:
  //! A runtime from JSON config text (the facade's keys). Throws on a bad config.
  explicit Engine(const std::string& config_json) {
    Config config = value_or_throw(Config::from_json_text(config_json));
    rt_ = value_or_throw(strata::Runtime::create(std::move(config)));
    device_ =
        rt_->device().kind() == memory::DeviceKind::kCuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    install_poison_handler();
  }
  ~Engine() { close(); }

  //! Frees the runtime (and its swap files). Bound params go back to poison first.
  void close() {
    if (rt_ == nullptr) return;
    for (Param& p : params_) unbind_now(p);
    params_.clear();
    py::gil_scoped_release release;
    rt_.reset();
  }

  //! Registers `param` (contiguous, on the engine's device kind, with its own
  //! storage) under `name`; its values are copied in by adopt().
  std::uint32_t register_param(const std::string& name, const at::Tensor& param, bool frozen) {
    check_open();
    std::vector<std::int64_t> shape(param.sizes().begin(), param.sizes().end());
    if (shape.empty()) shape.push_back(1);  // a 0-d parameter is one element
    const TensorId id = value_or_throw(rt_->register_tensor(name, shape, frozen));
    Param p;
    p.name = name;
    p.tensor = param;
    p.id = id;
    p.numel = static_cast<std::uint64_t>(param.numel());
    params_.push_back(std::move(p));
    return id;
  }

  //! Copies the parameter's current values into the runtime and points its
  //! storage at its poison region (the torch memory is freed).
  void adopt(std::uint32_t id) {
    Param& p = param(id);
    at::Tensor values = p.tensor.detach().to(at::kFloat).contiguous().reshape({-1});
    {
      py::gil_scoped_release release;
      throw_if(rt_->init_tensor(p.id, std::span<const float>(values.data_ptr<float>(), p.numel)));
    }
    p.poison = value_or_throw(PoisonRegion::create(p.tensor.nbytes()));
    storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
  }

  //! Gives a parameter real torch memory again with its current value (the
  //! engine is about to be closed or rebuilt).
  void restore(std::uint32_t id) {
    Param& p = param(id);
    unbind_now(p);
    at::Tensor values = read(id, static_cast<int>(StateKind::kParam)).to(p.tensor.scalar_type());
    auto* impl = storage(p);
    at::DataPtr fresh = values.storage().unsafeGetStorageImpl()->set_data_ptr(at::DataPtr(nullptr, device_));
    impl->set_data_ptr_noswap(std::move(fresh));
  }

  //! Makes the parameter's storage hold its value (counted; Note [Rebinding storage]).
  void bind(std::uint32_t id) {
    Param& p = param(id);
    if (p.binds++ > 0) return;
    auto lease = rt_->acquire(p.id, StateKind::kParam, Access::kRead, Where::kDevice);
    if (!lease.ok()) {
      --p.binds;
      throw_if(lease.status().with_context(fmt::format("binding parameter \"{}\"", p.name)));
    }
    Status st = rt_->wait(*lease);
    if (!st.ok()) {
      --p.binds;
      throw_if(st);
    }
    storage(p)->set_data_ptr_noswap(at::DataPtr(lease->data(), device_));
    p.lease = std::move(lease).value();
  }

  //! Undoes one bind(); the last one points the storage at poison and releases the lease.
  void unbind(std::uint32_t id) {
    Param& p = param(id);
    if (p.binds == 0) return;
    if (--p.binds == 0) unbind_now(p);
  }

  //! Unbinds every parameter, whatever its count (the sweep at the end of backward).
  void unbind_all() {
    for (Param& p : params_) unbind_now(p);
  }

  int binds(std::uint32_t id) { return param(id).binds; }

  //! Hands a parameter's gradient to its grad chunk: overwrite (first
  //! micro-batch of a step) or add (later micro-batches).
  void hand_grad(std::uint32_t id, const at::Tensor& grad, bool accumulate) {
    Param& p = param(id);
    if (grad.is_sparse())
      throw py::value_error(fmt::format("parameter \"{}\": sparse gradients are not supported", p.name));
    if (grad.numel() != static_cast<std::int64_t>(p.numel))
      throw py::value_error(
          fmt::format("parameter \"{}\": gradient of {} elements for {}", p.name, grad.numel(), p.numel));
    auto lease = rt_->acquire(p.id, StateKind::kGrad, accumulate ? Access::kAccumulate : Access::kWrite);
    if (!lease.ok()) throw_if(lease.status().with_context(fmt::format("gradient of \"{}\"", p.name)));
    throw_if(rt_->wait(*lease));
    at::Tensor dst = at::from_blob(lease->data(), {static_cast<std::int64_t>(p.numel)},
                                   at::TensorOptions().dtype(p.tensor.scalar_type()).device(device_));
    at::Tensor src = grad.reshape({-1});
    if (accumulate) {
      dst.add_(src);
    } else {
      dst.copy_(src);
    }
  }

  //! The names of parameters touched while unbound since the last call (their
  //! regions fault again afterwards). Empty, cheaply, when none.
  std::vector<std::string> poison_hits() {
    std::vector<std::string> names;
    if (!any_poison_hit()) return names;
    for (Param& p : params_) {
      if (p.poison.hit()) {
        names.push_back(p.name);
        p.poison.rearm();
      }
    }
    clear_any_poison_hit();
    return names;
  }

  void begin_micro_batch(bool last) { throw_if(rt_->begin_micro_batch(last)); }
  void set_grad_scale(float scale) { rt_->set_grad_scale(scale); }
  void set_group(std::uint32_t id, std::uint32_t group) {
    throw_if(rt_->set_tensor_group(param(id).id, group));
  }
  void set_group_hyper(std::uint32_t group, float lr, float weight_decay) {
    throw_if(rt_->set_group_hyper(group, lr, weight_decay));
  }

  //! A state of a parameter as a new fp32 CPU tensor of the parameter's shape.
  at::Tensor read(std::uint32_t id, int kind) {
    Param& p = param(id);
    at::Tensor out = at::empty(p.tensor.sizes(), at::TensorOptions().dtype(at::kFloat));
    py::gil_scoped_release release;
    throw_if(rt_->read_tensor(p.id, std::span<float>(out.data_ptr<float>(), p.numel), to_kind(kind)));
    return out;
  }

  void write(std::uint32_t id, int kind, const at::Tensor& values) {
    Param& p = param(id);
    if (values.numel() != static_cast<std::int64_t>(p.numel))
      throw py::value_error(
          fmt::format("parameter \"{}\": {} values for {} elements", p.name, values.numel(), p.numel));
    at::Tensor v = values.detach().to(at::kCPU).to(at::kFloat).contiguous();
    py::gil_scoped_release release;
    throw_if(rt_->write_tensor(p.id, std::span<const float>(v.data_ptr<float>(), p.numel), to_kind(kind)));
  }

  std::int64_t steps(std::uint32_t id) { return value_or_throw(rt_->tensor_steps(param(id).id)); }
  void set_steps(std::uint32_t id, std::int64_t steps) {
    throw_if(rt_->set_tensor_steps(param(id).id, steps));
  }

  //! Ends the step (optimizer, re-planning); the step's figures as a dict.
  py::dict step() {
    check_open();
    std::optional<Result<StepStats>> result;
    {
      py::gil_scoped_release release;
      result.emplace(rt_->step());
    }
    throw_if(result->status());
    const StepStats* stats = &result->value();
    py::dict d;
    d["step"] = stats->step;
    d["applied"] = stats->applied;
    d["followed_plan"] = stats->followed_plan;
    d["step_s"] = stats->step_s;
    d["stall_s"] = stats->stall_s;
    d["bytes_h2d"] = stats->bytes_h2d;
    d["bytes_d2h"] = stats->bytes_d2h;
    d["bytes_disk_read"] = stats->bytes_disk_read;
    d["bytes_disk_write"] = stats->bytes_disk_write;
    d["gpu_high_water_bytes"] = stats->gpu_high_water_bytes;
    d["host_high_water_bytes"] = stats->host_high_water_bytes;
    d["nvme_bytes"] = stats->nvme_bytes;
    return d;
  }

  //! Unbinds every parameter and discards the step in progress (Note [Failed
  //! steps]): after an exception in forward or backward.
  void abort_step() {
    check_open();
    for (Param& p : params_) {
      p.binds = 0;
      if (!p.lease.has_value()) continue;
      if (p.poison.data() != nullptr) storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
      p.lease->abandon();  // releasing it could start an optimizer step of the discarded step
      p.lease.reset();
    }
    py::gil_scoped_release release;
    throw_if(rt_->abort_step());
  }

  void flush() {
    check_open();
    py::gil_scoped_release release;
    throw_if(rt_->flush());
  }

  //! Runtime::save_checkpoint / load_checkpoint (docs/checkpoint.md).
  void save_checkpoint(const std::string& dir) {
    check_open();
    py::gil_scoped_release release;
    throw_if(rt_->save_checkpoint(dir));
  }
  //! Runtime::begin_checkpoint / finish_checkpoint (Note [Overlapped save]).
  void begin_checkpoint(const std::string& dir) {
    check_open();
    py::gil_scoped_release release;
    throw_if(rt_->begin_checkpoint(dir));
  }
  void finish_checkpoint() {
    check_open();
    py::gil_scoped_release release;
    throw_if(rt_->finish_checkpoint());
  }
  bool checkpoint_in_flight() {
    check_open();
    auto r = rt_->checkpoint_in_flight();
    throw_if(r.status());
    return *r;
  }
  void load_checkpoint(const std::string& dir) {
    check_open();
    py::gil_scoped_release release;
    throw_if(rt_->load_checkpoint(dir));
  }

  std::string describe() {
    check_open();
    return rt_->describe();
  }
  std::string device_kind() { return device_.is_cuda() ? "cuda" : "cpu"; }
  //! Whether the runtime keeps a separate fp32 master (compute dtype other than fp32).
  bool separate_master() { return rt_->config().runtime.compute_dtype != runtime::DType::kF32; }
  void write_trace(const std::string& path) { throw_if(rt_->write_chrome_trace(path)); }

 private:
  void check_open() const {
    if (rt_ == nullptr) throw StrataError("strata.torch: this engine is closed");
  }
  Param& param(std::uint32_t id) {
    check_open();
    if (id >= params_.size()) throw py::value_error(fmt::format("no parameter with id {}", id));
    return params_[id];
  }
  static c10::StorageImpl* storage(Param& p) { return p.tensor.storage().unsafeGetStorageImpl(); }
  static StateKind to_kind(int kind) {
    if (kind < 0 || kind > static_cast<int>(StateKind::kState1))
      throw py::value_error(fmt::format("bad state kind {}", kind));
    return static_cast<StateKind>(kind);
  }
  void unbind_now(Param& p) {
    p.binds = 0;
    if (!p.lease.has_value()) return;
    if (p.poison.data() != nullptr) storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
    p.lease.reset();
  }

  std::unique_ptr<strata::Runtime> rt_;
  at::Device device_{at::kCPU};
  std::vector<Param> params_;
};

//! strata's fused optimizer kernel over torch tensors (strata.torch.functional):
//! one step for one tensor, in place. fp32 master (param), any-dtype grad.
void fused_step(const std::string& optimizer, at::Tensor param, const at::Tensor& grad,
                std::vector<at::Tensor> states, std::int64_t step, py::dict hyper, float grad_scale) {
  if (param.scalar_type() != at::kFloat || !param.is_contiguous() || !grad.is_contiguous())
    throw py::value_error("fused_step: param must be contiguous fp32, grad contiguous");
  kernels::Hyper h;
  bool found = false;
  for (kernels::Optimizer o : {kernels::Optimizer::kAdam, kernels::Optimizer::kAdamW,
                               kernels::Optimizer::kLamb, kernels::Optimizer::kLars, kernels::Optimizer::kSgd,
                               kernels::Optimizer::kLion, kernels::Optimizer::kAdagrad}) {
    if (kernels::optimizer_name(o) == optimizer) {
      h.optimizer = o;
      found = true;
    }
  }
  if (!found) throw py::value_error(fmt::format("fused_step: unknown optimizer \"{}\"", optimizer));
  for (auto item : hyper) {
    const std::string key = py::str(item.first);
    if (key == "lr")
      h.lr = item.second.cast<float>();
    else if (key == "beta1")
      h.beta1 = item.second.cast<float>();
    else if (key == "beta2")
      h.beta2 = item.second.cast<float>();
    else if (key == "eps")
      h.eps = item.second.cast<float>();
    else if (key == "weight_decay")
      h.weight_decay = item.second.cast<float>();
    else if (key == "momentum")
      h.momentum = item.second.cast<float>();
    else if (key == "dampening")
      h.dampening = item.second.cast<float>();
    else if (key == "nesterov")
      h.nesterov = item.second.cast<bool>();
    else if (key == "bias_correction")
      h.bias_correction = item.second.cast<bool>();
    else if (key == "trust_coefficient")
      h.trust_coefficient = item.second.cast<float>();
    else if (key == "lars_clip")
      h.lars_clip = item.second.cast<bool>();
    else if (key == "lr_decay")
      h.lr_decay = item.second.cast<float>();
    else
      throw py::value_error(fmt::format("fused_step: unknown hyperparameter \"{}\"", key));
  }
  kernels::Span s;
  s.n = static_cast<std::uint64_t>(param.numel());
  s.master = param.data_ptr<float>();
  s.param_dtype = kernels::DType::kNone;
  s.grad = static_cast<const std::byte*>(grad.data_ptr());
  s.grad_dtype = grad.scalar_type() == at::kBFloat16 ? kernels::DType::kBF16
                 : grad.scalar_type() == at::kHalf   ? kernels::DType::kF16
                                                     : kernels::DType::kF32;
  if (states.size() > s.state.size()) throw py::value_error("fused_step: too many states");
  for (std::size_t i = 0; i < states.size(); ++i) {
    if (states[i].scalar_type() != at::kFloat || states[i].numel() != param.numel() ||
        !states[i].is_contiguous())
      throw py::value_error("fused_step: states must be contiguous fp32 of the param's size");
    s.state[i] = static_cast<std::byte*>(states[i].data_ptr());
  }
  s.state_dtype = kernels::DType::kF32;
  kernels::StepArgs args{.hyper = h, .step = step, .grad_scale = grad_scale, .spans = std::span(&s, 1)};
  auto report = kernels::step(args);
  throw_if(report.status());
}

//! Parses config text as Runtime creation will (unknown keys, types, values), without creating anything.
void validate_config(const std::string& config_json) {
  throw_if(Config::from_json_text(config_json).status());
}

}  // namespace
}  // namespace strata::torch_binding

PYBIND11_MODULE(_C, m) {
  using strata::torch_binding::Engine;
  m.doc() = "strata.torch's C++ engine (see strata/torch/__init__.py)";
  py::register_exception<strata::torch_binding::StrataError>(m, "StrataError", PyExc_RuntimeError);
  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::string&>(), py::arg("config_json"))
      .def("close", &Engine::close)
      .def("register_param", &Engine::register_param)
      .def("adopt", &Engine::adopt)
      .def("restore", &Engine::restore)
      .def("bind", &Engine::bind)
      .def("unbind", &Engine::unbind)
      .def("unbind_all", &Engine::unbind_all)
      .def("binds", &Engine::binds)
      .def("hand_grad", &Engine::hand_grad)
      .def("poison_hits", &Engine::poison_hits)
      .def("begin_micro_batch", &Engine::begin_micro_batch)
      .def("set_grad_scale", &Engine::set_grad_scale)
      .def("set_group", &Engine::set_group)
      .def("set_group_hyper", &Engine::set_group_hyper)
      .def("read", &Engine::read)
      .def("write", &Engine::write)
      .def("steps", &Engine::steps)
      .def("set_steps", &Engine::set_steps)
      .def("step", &Engine::step)
      .def("flush", &Engine::flush)
      .def("abort_step", &Engine::abort_step)
      .def("save_checkpoint", &Engine::save_checkpoint)
      .def("load_checkpoint", &Engine::load_checkpoint)
      .def("begin_checkpoint", &Engine::begin_checkpoint)
      .def("finish_checkpoint", &Engine::finish_checkpoint)
      .def("checkpoint_in_flight", &Engine::checkpoint_in_flight)
      .def("describe", &Engine::describe)
      .def("device_kind", &Engine::device_kind)
      .def("separate_master", &Engine::separate_master)
      .def("write_trace", &Engine::write_trace);
  m.def("validate_config", &strata::torch_binding::validate_config, py::arg("config_json"));
  m.def("fused_step", &strata::torch_binding::fused_step, py::arg("optimizer"), py::arg("param"),
        py::arg("grad"), py::arg("states"), py::arg("step"), py::arg("hyper"), py::arg("grad_scale") = 1.0f);
}
