// strata.torch._C: the torch extension under strata.torch. An Engine owns one
// strata::Runtime and the torch parameters handed to it; Python's hooks call
// bind/unbind/hand_grad (python/strata/torch/_wrap.py). What the Engine does with a
// parameter's storage between steps is param_views.cpp (param.hpp), how it hands
// gradients over is grad_handoff.cpp, the functional kernels functional.cpp.
//
// Note [Rebinding storage]
// A parameter keeps its torch.nn.Parameter object and its StorageImpl for its
// whole life; only the StorageImpl's data pointer changes: to the param chunk's
// lease (bind) or to the parameter's poison region (unbind, Note [Poisoned
// parameters]). Views autograd saved share the StorageImpl, so they follow. A
// parameter bound by several modules at once (tied weights, a layer called twice)
// keeps one lease and a count of binds.
#include <torch/extension.h>

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "functional.hpp"
#include "grad_handoff.hpp"
#include "param.hpp"
#include "poison.hpp"
#include "strata/common/log.hpp"
#include "strata/strata.hpp"

namespace py = pybind11;

namespace strata::torch_binding {
namespace {

at::ScalarType torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return at::kFloat;
    case DType::kBF16:
      return at::kBFloat16;
    case DType::kF16:
      return at::kHalf;
    case DType::kNone:
      break;
  }
  throw StrataError(fmt::format("strata.torch: dtype {} has no torch type", dtype_name(dtype)));
}

//! model.strata.totals: the runtime's running totals (runtime::Runtime::stats(), the
//! one place they are kept, #26), under the keys _wrap.py always had.
py::dict totals_dict(const Stats& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["bytes_h2d"] = s.bytes_h2d;
  d["bytes_d2h"] = s.bytes_d2h;
  d["bytes_disk_read"] = s.bytes_disk_read;
  d["bytes_disk_write"] = s.bytes_disk_write;
  d["stall_s"] = s.stall_s;
  return d;
}

//! StateKind as module constants generated from the enum (issue #26): PARAM = 0,
//! GRAD, MASTER, STATE0, STATE1 (state_kind_name upper-cased), and STATE_KINDS,
//! the names in value order. _wrap.py takes them from here rather than numbering
//! the kinds itself.
void export_state_kinds(py::module_& m) {
  py::list names;
  for (std::size_t k = 0; k < runtime::kStateKindCount; ++k) {
    const std::string name(runtime::state_kind_name(static_cast<StateKind>(k)));
    std::string upper = name;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    m.attr(upper.c_str()) = static_cast<int>(k);
    names.append(name);
  }
  m.attr("STATE_KINDS") = py::tuple(names);
}

class Engine {
 public:
  //! A runtime from JSON config text (the facade's keys). Throws on a bad config.
  explicit Engine(const std::string& config_json) {
    Config config = value_or_throw(Config::from_json_text(config_json));
    rt_ = value_or_throw(strata::Runtime::create(std::move(config)));
    device_ =
        rt_->device().kind() == memory::DeviceKind::kCuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    install_poison_handler();
    grads_.attach(rt_.get(), &params_, device_);
  }
  ~Engine() { close(); }

  //! Frees the runtime (and its swap files). Bound params go back to poison first.
  void close() {
    if (rt_ == nullptr) return;
    grads_.drop();
    for (Param& p : params_) unbind_now(p);
    params_.clear();
    closed_totals_ = rt_->stats();
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
    p.shape.assign(param.sizes().begin(), param.sizes().end());
    p.dtype = param.scalar_type();
    p.frozen = frozen;
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
    p.home = p.tensor.storage();
    storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
  }

  //! Deferred init (Note [Deferred init] in strata/torch/_deferred.py): points the
  //! parameter's storage at its poison region without copying values (its torch
  //! memory, never written, is freed); init_values() gives the runtime its values.
  void adopt_unset(std::uint32_t id) {
    Param& p = param(id);
    if (p.home.unsafeGetStorageImpl() != nullptr) return;
    p.poison = value_or_throw(PoisonRegion::create(p.tensor.nbytes()));
    p.home = p.tensor.storage();
    storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
  }

  //! Deferred init: the values of several parameters (any float dtype, each its parameter's
  //! numel) as their initial value (init_tensor each: an NVMe-homed chunk is read and written
  //! per tensor; one runtime call per family is still to come, docs/scale.md). Empty lists fix
  //! the layout (finalize, through a flush).
  void init_many(const std::vector<std::uint32_t>& ids, const std::vector<at::Tensor>& values) {
    check_open();
    if (ids.size() != values.size()) throw py::value_error("init_many: as many ids as value tensors");
    if (ids.empty() && !params_.empty()) {
      // Nothing to write: fix the layout (finalize) by reading the smallest parameter.
      const Param* small = &params_[0];
      for (const Param& p : params_) small = p.numel < small->numel ? &p : small;
      std::vector<float> values(small->numel);
      py::gil_scoped_release release;
      throw_if(rt_->read_tensor(small->id, StateKind::kParam, values));
      return;
    }
    for (std::size_t i = 0; i < ids.size(); ++i) {
      Param& p = param(ids[i]);
      if (values[i].numel() != static_cast<std::int64_t>(p.numel))
        throw py::value_error(
            fmt::format("parameter \"{}\": {} values for {} elements", p.name, values[i].numel(), p.numel));
      at::Tensor v = values[i].detach().to(at::kCPU).to(at::kFloat).contiguous().reshape({-1});
      py::gil_scoped_release release;
      throw_if(rt_->init_tensor(p.id, std::span<const float>(v.data_ptr<float>(), p.numel)));
    }
  }

  //! The chunk family of a parameter (-1 before the layout is fixed).
  std::int64_t family_of(std::uint32_t id) {
    const runtime::ChunkLayout& l = rt_->layout();
    const TensorId t = param(id).id;
    return t < l.slots.size() ? static_cast<std::int64_t>(l.slots[t].family) : -1;
  }

  //! The chunk layout the runtime chose (fixed by the first init, acquire or step): chunk_elems,
  //! families, numel, capacity_elems, padding_fraction (layout.chunk_elems 0 = its own search),
  //! the plan's bytes per tier (plan_gpu_bytes, plan_host_bytes, plan_nvme_bytes) and whether it keeps
  //! every family's params on the device for the whole step (plan_params_resident).
  py::dict layout() {
    check_open();
    const runtime::ChunkLayout& l = rt_->layout();
    py::dict d;
    d["chunk_elems"] = l.chunk_elems;
    d["families"] = l.families.size();
    d["numel"] = l.numel_total;
    d["capacity_elems"] = l.capacity_total_elems;
    d["padding_fraction"] = l.padding_fraction();
    const runtime::Plan& plan = rt_->plan();
    d["plan_gpu_bytes"] = plan.gpu_bytes;  // the plan in effect (its bytes per tier)
    d["plan_host_bytes"] = plan.host_bytes;
    d["plan_nvme_bytes"] = plan.nvme_bytes;
    // Whether every family's params stay on the device for the whole step (Note [Holding
    // parameters where everything fits] in _wrap.py); false before the first plan.
    d["plan_params_resident"] =
        !plan.families.empty() &&
        std::all_of(plan.families.begin(), plan.families.end(),
                    [](const runtime::FamilyPlan& f) { return f.param_resident_gpu; });
    return d;
  }

  //! Gives a parameter real torch memory again with its current value (the
  //! engine is about to be closed or rebuilt).
  void restore(std::uint32_t id) {
    Param& p = param(id);
    drop_view(p);
    unbind_now(p);
    at::Tensor values = read(id, static_cast<int>(StateKind::kParam)).to(p.tensor.scalar_type());
    auto* impl = storage(p);
    at::DataPtr fresh = values.storage().unsafeGetStorageImpl()->set_data_ptr(at::DataPtr(nullptr, device_));
    impl->set_data_ptr_noswap(std::move(fresh));
  }

  //! Makes the parameter's storage hold its value (counted; Note [Rebinding storage]).
  void bind(std::uint32_t id) {
    ++crossings_;
    Param& p = param(id);
    if (p.binds == 0 && (p.poison.in_view() || replaced(p))) drop_view(p);
    if (p.binds++ > 0) return;
    py::gil_scoped_release release;  // acquire may wait for the chunk's optimizer, wait for its load
    bind_now(p);
  }

  // Note [Batched binds]
  // A module's hooks bind and unbind all of its parameters in one call (bind_many,
  // unbind_many): one crossing from Python per module and hook instead of one per
  // parameter, and the GIL is released once around every acquire and wait of the
  // module (a wait for a chunk still loading, or for its optimizer, no longer holds
  // up other Python threads). A parameter already bound (tied, or the module's
  // subtree bound by its parent) only counts the bind: no lease, no lock, no wait.
  // unbind_many answers whether a poisoned region was touched since the last check
  // (any_poison_hit(), one atomic load), so the hook asks for names only then.
  void bind_many(const std::vector<std::uint32_t>& ids) {
    ++crossings_;
    std::vector<Param*> todo;
    todo.reserve(ids.size());
    for (std::uint32_t id : ids) {
      Param& p = param(id);
      if (p.binds == 0 && (p.poison.in_view() || replaced(p))) drop_view(p);
      if (p.binds++ == 0) todo.push_back(&p);
    }
    if (todo.empty()) return;
    std::size_t done = 0;
    try {
      py::gil_scoped_release release;
      for (; done < todo.size(); ++done) bind_now(*todo[done]);
    } catch (...) {
      for (std::size_t i = done + 1; i < todo.size(); ++i) --todo[i]->binds;  // bind_now undid its own
      throw;
    }
  }
  bool unbind_many(const std::vector<std::uint32_t>& ids) {
    ++crossings_;
    for (std::uint32_t id : ids) {
      Param& p = param(id);
      if (p.binds > 0 && --p.binds == 0) unbind_now(p);
    }
    return any_poison_hit();
  }

  //! Undoes one bind(); the last one points the storage at poison and releases the lease.
  void unbind(std::uint32_t id) {
    ++crossings_;
    Param& p = param(id);
    if (p.binds == 0) return;
    if (--p.binds == 0) unbind_now(p);
  }

  //! Unbinds every parameter, whatever its count (the sweep at the end of backward).
  void unbind_all() {
    for (Param& p : params_) unbind_now(p);
  }

  int binds(std::uint32_t id) { return param(id).binds; }

  // --- Gradients (Note [Gradients in pieces]; GradientHandoff, grad_handoff.hpp) ---
  //! Hands a parameter's gradient over: its grad chunk, or kept until its family's other gradients arrive.
  void hand_grad(std::uint32_t id, const at::Tensor& grad, bool accumulate) {
    ++crossings_;
    param(id);  // checks the engine is open and the id
    grads_.hand_grad(id, grad, accumulate);
  }
  //! Whether end_backward has work.
  bool gradients_pending() const { return grads_.pending(); }
  //! Backward ended: completes every family some of whose gradients came (GradientHandoff::end_backward).
  std::vector<std::uint32_t> end_backward(const std::vector<bool>& zero_if_missing) {
    ++crossings_;
    check_open();
    return grads_.end_backward(zero_if_missing);
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

  void begin_micro_batch(bool last) {
    sync_views();
    grads_.begin_micro_batch();
    throw_if(rt_->begin_micro_batch(last));
  }
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
    sync_views();
    at::Tensor out = at::empty(p.tensor.sizes(), at::TensorOptions().dtype(at::kFloat));
    py::gil_scoped_release release;
    throw_if(rt_->read_tensor(p.id, to_kind(kind), std::span<float>(out.data_ptr<float>(), p.numel)));
    return out;
  }

  void write(std::uint32_t id, int kind, const at::Tensor& values) {
    Param& p = param(id);
    if (values.numel() != static_cast<std::int64_t>(p.numel))
      throw py::value_error(
          fmt::format("parameter \"{}\": {} values for {} elements", p.name, values.numel(), p.numel));
    sync_views();
    at::Tensor v = values.detach().to(at::kCPU).to(at::kFloat).contiguous();
    {
      py::gil_scoped_release release;
      throw_if(rt_->write_tensor(p.id, to_kind(kind), std::span<const float>(v.data_ptr<float>(), p.numel)));
    }
    refresh_view(p);  // this helper's block (Note [Parameters between steps]); a no-op without a view
  }

  std::int64_t steps(std::uint32_t id) { return value_or_throw(rt_->tensor_steps(param(id).id)); }
  void set_steps(std::uint32_t id, std::int64_t steps) {
    throw_if(rt_->set_tensor_steps(param(id).id, steps));
  }

  //! Ends the step (optimizer, re-planning); the step's figures as a dict.
  py::dict step() {
    check_open();
    drop_views();
    grads_.hand_kept();
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
    grads_.drop();
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
    sync_views();
    py::gil_scoped_release release;
    throw_if(rt_->flush());
  }

  //! Runtime::save_checkpoint / load_checkpoint (docs/checkpoint.md).
  void save_checkpoint(const std::string& dir) {
    check_open();
    sync_views();
    py::gil_scoped_release release;
    throw_if(rt_->save_checkpoint(dir));
  }
  //! Runtime::begin_checkpoint / finish_checkpoint (Note [Overlapped save]).
  void begin_checkpoint(const std::string& dir) {
    check_open();
    sync_views();
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
    sync_views();
    {
      py::gil_scoped_release release;
      throw_if(rt_->load_checkpoint(dir));
    }
    for (Param& p : params_) refresh_view(p);
  }

  std::string describe() {
    check_open();
    return rt_->describe();
  }
  std::string device_kind() { return device_.is_cuda() ? "cuda" : "cpu"; }
  //! Whether the runtime keeps a separate fp32 master (compute dtype other than fp32).
  bool separate_master() { return rt_->config().runtime.compute_dtype != runtime::DType::kF32; }
  void write_trace(const std::string& path) { throw_if(rt_->write_chrome_trace(path)); }

  // --- Parameters between steps (Note [Parameters between steps]) -------------------------------

  //! Fills an unbound parameter's poison region with its current value and seals it
  //! read-only: its storage (which points there) reads the value until the next
  //! sync_views(). A no-op when it is bound, already a view, or replaced by
  //! `p.data = t`. Blocks (may read NVMe). Throws StrataError on CUDA (the region
  //! is host memory) naming the parameter and the calls that return its value.
  void materialise(std::uint32_t id) {
    Param& p = param(id);
    if (p.binds > 0 || p.poison.in_view() || replaced(p) || p.poison.data() == nullptr) return;
    if (device_.is_cuda()) {
      throw StrataError(fmt::format(
          "strata.torch: parameter \"{}\" was read between steps, which strata serves on the sim device "
          "only; read it with model.strata.read_param(\"{}\") or model.state_dict()",
          p.name, p.name));
    }
    fill_view(*rt_, p);
  }

  //! Hands every parameter written between steps (through a view, or replaced by
  //! `p.data = t`) to the runtime and puts every view back to poison. Returns the
  //! names of the parameters written. O(parameters) pointer checks when none is.
  std::vector<std::string> sync_views() {
    std::vector<std::string> written;
    if (rt_ == nullptr) return written;
    for (Param& p : params_) {
      if (p.binds > 0 || !(p.poison.in_view() || replaced(p))) continue;
      if (push_written(*rt_, p)) written.push_back(p.name);
    }
    return written;
  }

  //! sync_views(), then every view back to poison: the runtime is about to change
  //! the values (step()); _wrap.py makes the parameters lazy again.
  void drop_views() {
    if (rt_ == nullptr) return;
    for (Param& p : params_) {
      if (p.binds == 0 && (p.poison.in_view() || replaced(p))) drop_view(p);
    }
  }

  //! The binding's work so far (Note [Step counters] in _wrap.py): calls from hooks
  //! (bind, unbind, hand_grad; a batched call counts once) and param leases taken.
  py::dict counters() const {
    py::dict d;
    d["crossings"] = crossings_;
    d["param_leases"] = param_leases_;
    d["kept_gradients"] = grads_.kept_total();  // Note [Gradients in pieces]
    d["kept_bytes_peak"] = grads_.kept_bytes_peak();
    return d;
  }

  //! Totals since the engine was created (totals_dict); after close(), its last ones.
  py::dict totals() const { return totals_dict(rt_ != nullptr ? rt_->stats() : closed_totals_); }

  //! Whether parameter `id` is a view between steps (for tests).
  bool is_view(std::uint32_t id) { return param(id).poison.in_view(); }

 private:
  void check_open() const {
    if (rt_ == nullptr) throw StrataError("strata.torch: this engine is closed");
  }
  Param& param(std::uint32_t id) {
    check_open();
    if (id >= params_.size()) throw py::value_error(fmt::format("no parameter with id {}", id));
    return params_[id];
  }
  static StateKind to_kind(int kind) {
    if (kind < 0 || kind > static_cast<int>(StateKind::kState1))
      throw py::value_error(fmt::format("bad state kind {}", kind));
    return static_cast<StateKind>(kind);
  }
  //! Values of parameters whose view the runtime changed (write, load_checkpoint) are read again.
  void refresh_view(Param& p) {
    if (p.binds == 0 && p.poison.in_view() && !replaced(p)) fill_view(*rt_, p);
  }
  //! push_written(), then the region back to poison.
  void drop_view(Param& p) {
    push_written(*rt_, p);
    restore_home(p);
  }
  //! The lease of a parameter whose count just went 0 -> 1; undoes the count on failure.
  //! Runs without the GIL (touches no Python object).
  void bind_now(Param& p) {
    ++param_leases_;
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
  void unbind_now(Param& p) {
    p.binds = 0;
    if (!p.lease.has_value()) return;
    if (p.poison.data() != nullptr) storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
    p.lease.reset();
  }

  std::unique_ptr<strata::Runtime> rt_;
  at::Device device_{at::kCPU};
  std::vector<Param> params_;
  std::uint64_t crossings_ = 0;
  std::uint64_t param_leases_ = 0;
  GradientHandoff grads_;  //!< Note [Gradients in pieces]: the order gradients reach the runtime
  Stats closed_totals_;    //!< rt_->stats() when close() freed the runtime
};

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
      .def("adopt_unset", &Engine::adopt_unset)  // deferred init (#28)
      .def("init_many", &Engine::init_many)
      .def("family_of", &Engine::family_of)
      .def("layout", &Engine::layout)  // #28: padding of the runtime's chunk search
      .def("restore", &Engine::restore)
      .def("bind", &Engine::bind)
      .def("unbind", &Engine::unbind)
      .def("bind_many", &Engine::bind_many)
      .def("unbind_many", &Engine::unbind_many)
      .def("unbind_all", &Engine::unbind_all)
      .def("binds", &Engine::binds)
      .def("hand_grad", &Engine::hand_grad)
      .def("gradients_pending", &Engine::gradients_pending)
      .def("end_backward", &Engine::end_backward)
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
      .def("write_trace", &Engine::write_trace)
      // Parameters between steps (Note [Parameters between steps]).
      .def("materialise", &Engine::materialise)
      .def("sync_views", &Engine::sync_views)
      .def("drop_views", &Engine::drop_views)
      .def("is_view", &Engine::is_view)
      .def("counters", &Engine::counters)
      .def("totals", &Engine::totals);  // #26: model.strata.totals
  m.def("zero_totals",
        [] { return strata::torch_binding::totals_dict(strata::Stats{}); });  // before an engine
  strata::torch_binding::export_state_kinds(m);  // #26: PARAM..STATE1 from the C++ enum
  m.def("validate_config", &strata::torch_binding::validate_config, py::arg("config_json"));
  strata::torch_binding::register_functional(m);  // fused_step (functional.cpp, #26)
}
