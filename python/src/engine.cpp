// strata.torch._C.Engine (engine.hpp): a runtime and the torch parameters handed to it. Binding a
// parameter's storage to its lease and back is param_binds.cpp (Note [Rebinding storage]).
#include "engine.hpp"

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "poison.hpp"
#include "strata/common/log.hpp"
#include "strata/runtime/stores.hpp"

namespace strata::torch_binding {

namespace {

//! The traffic fields a step's stats (StepStats) and the running totals (Stats) share, under the
//! same keys in both dicts.
template <class S>
void put_traffic(py::dict& d, const S& s) {
  d["bytes_h2d"] = s.bytes_h2d;
  d["bytes_d2h"] = s.bytes_d2h;
  d["bytes_disk_read"] = s.bytes_disk_read;
  d["bytes_disk_read_param_uses"] = s.bytes_disk_read_param_uses;
  d["bytes_disk_read_param_updates"] = s.bytes_disk_read_param_updates;
  d["bytes_disk_write"] = s.bytes_disk_write;
}

}  // namespace

py::dict totals_dict(const Stats& s) {
  py::dict d;
  d["steps"] = s.steps;
  put_traffic(d, s);
  d["stall_s"] = s.stall_s;
  return d;
}

Engine::Engine(const std::string& config_json, std::shared_ptr<comm::Communicator> comm) {
  Config config = value_or_throw(Config::from_json_text(config_json));
  config.runtime.comm = std::move(comm);
  rt_ = value_or_throw(strata::Runtime::create(std::move(config)));
  // The GPU the runtime opened (device.cuda_ordinal): torch's tensors over its memory name it.
  device_ = rt_->device().kind() == memory::DeviceKind::kCuda
                ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(rt_->config().device.cuda_ordinal))
                : at::Device(at::kCPU);
  install_poison_handler();
  order_.attach(*rt_);
  grads_.attach(rt_.get(), &params_, device_, &order_);
}

void Engine::close() {
  if (rt_ == nullptr) return;
  {
    py::gil_scoped_release release;
    order_.finish_torch();  // torch's queued kernels end before slots are released and freed
  }
  grads_.drop();
  bool ordered = true;  // torch's work is done (finish_torch)
  for (Param& p : params_) unbind_now(p, &ordered);
  params_.clear();
  closed_totals_ = rt_->stats();
  py::gil_scoped_release release;
  order_.detach();
  rt_.reset();
}

std::uint32_t Engine::register_param(const std::string& name, const at::Tensor& param, bool frozen) {
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

void Engine::adopt(std::uint32_t id) {
  Param& p = param(id);
  // The runtime reads host memory: a CUDA parameter's values come down first.
  at::Tensor values = p.tensor.detach().to(at::kCPU).to(at::kFloat).contiguous().reshape({-1});
  {
    py::gil_scoped_release release;
    throw_if(rt_->init_tensor(p.id, std::span<const float>(values.data_ptr<float>(), p.numel)));
  }
  p.poison = value_or_throw(PoisonRegion::create(p.tensor.nbytes()));
  p.home = p.tensor.storage();
  storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
}

void Engine::adopt_unset(std::uint32_t id) {
  Param& p = param(id);
  if (p.home.unsafeGetStorageImpl() != nullptr) return;
  p.poison = value_or_throw(PoisonRegion::create(p.tensor.nbytes()));
  p.home = p.tensor.storage();
  storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
}

void Engine::init_many(const std::vector<std::uint32_t>& ids, const std::vector<at::Tensor>& values) {
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
  std::vector<at::Tensor> owned;
  std::vector<TensorId> tensors;
  std::vector<std::span<const float>> spans;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    Param& p = param(ids[i]);
    if (values[i].numel() != static_cast<std::int64_t>(p.numel))
      throw py::value_error(
          fmt::format("parameter \"{}\": {} values for {} elements", p.name, values[i].numel(), p.numel));
    owned.push_back(values[i].detach().to(at::kCPU).to(at::kFloat).contiguous().reshape({-1}));
    tensors.push_back(p.id);
    spans.emplace_back(owned.back().data_ptr<float>(), p.numel);
  }
  py::gil_scoped_release release;
  throw_if(rt_->init_tensors(tensors, spans));
}

std::int64_t Engine::family_of(std::uint32_t id) {
  const runtime::ChunkLayout& l = rt_->layout();
  const TensorId t = param(id).id;
  return t < l.slots.size() ? static_cast<std::int64_t>(l.slots[t].family) : -1;
}

py::dict Engine::layout() {
  check_open();
  const runtime::ChunkLayout& l = rt_->layout();
  py::dict d;
  d["chunk_elems"] = l.chunk_elems;
  d["families"] = l.families.size();
  d["numel"] = l.numel_total;
  d["capacity_elems"] = l.capacity_total_elems;
  d["padding_fraction"] = l.padding_fraction();
  d["state_bytes"] =
      rt_->state_bytes();  // masters and optimizer states: this rank's share (Note [Sharded step])
  const runtime::Plan& plan = rt_->plan();
  d["plan_gpu_bytes"] = plan.gpu_bytes;  // the plan in effect (its bytes per tier)
  d["plan_host_bytes"] = plan.host_bytes;
  d["plan_nvme_bytes"] = plan.nvme_bytes;
  d["plan_summary"] = plan.summary();
  // The host tier's pinned region, what it holds resident: budgets.host and the room its
  // allocator needs beside it (Note [Host store arena] in runtime/src/core/stores.cpp).
  d["host_region_bytes"] = runtime::host_store_region_bytes(rt_->config().runtime.budgets.host_bytes);
  // Whether every family's params stay on the device for the whole step (Note [Holding
  // parameters where everything fits] in _hooks.py); false before the first plan.
  d["plan_params_resident"] = !plan.families.empty() &&
                              std::all_of(plan.families.begin(), plan.families.end(),
                                          [](const runtime::FamilyPlan& f) { return f.param_resident_gpu; });
  return d;
}

void Engine::restore(std::uint32_t id) {
  Param& p = param(id);
  drop_view(p);
  unbind_now(p);
  // read() gives host memory; the storage takes memory of its own device (a CUDA
  // parameter given a host pointer would fault in its first kernel).
  at::Tensor values =
      read_tensor(id, static_cast<int>(StateKind::kParam)).to(p.tensor.scalar_type()).to(device_);
  auto* impl = storage(p);
  at::DataPtr fresh = values.storage().unsafeGetStorageImpl()->set_data_ptr(at::DataPtr(nullptr, device_));
  impl->set_data_ptr_noswap(std::move(fresh));
}

void Engine::hand_grad(std::uint32_t id, const at::Tensor& grad, bool accumulate) {
  ++crossings_;
  param(id);  // checks the engine is open and the id
  grads_.hand_grad(id, grad, accumulate);
}

std::vector<std::uint32_t> Engine::end_backward(const std::vector<bool>& zero_if_missing) {
  ++crossings_;
  check_open();
  return grads_.end_backward(zero_if_missing);
}

void Engine::begin_micro_batch(bool last) {
  sync_views();
  grads_.begin_micro_batch();
  throw_if(rt_->begin_micro_batch(last));
}

void Engine::set_tensor_group(std::uint32_t id, std::uint32_t group) {
  throw_if(rt_->set_tensor_group(param(id).id, group));
}

void Engine::set_group_hyper(std::uint32_t group, float lr, float weight_decay) {
  throw_if(rt_->set_group_hyper(group, lr, weight_decay));
}

std::pair<std::uint64_t, std::uint64_t> Engine::state_range(std::uint32_t id) {
  const Param& p = param(id);
  const Runtime::StateRange r = value_or_throw(rt_->state_range(p.id));
  return {r.first, r.count};
}

at::Tensor Engine::read_tensor(std::uint32_t id, int kind) {
  Param& p = param(id);
  sync_views();
  // Under data parallelism an optimizer state's read fills this rank's part only (Note [Sharded
  // step]); the rest is -0.0, never uninitialised memory, and adding the ranks' reads in rank
  // order gives the whole state exactly (x + -0.0 is x: Note [Optimizer states across ranks] in
  // strata/torch/_optim_state.py).
  at::Tensor out = at::full(p.tensor.sizes(), -0.0, at::TensorOptions().dtype(at::kFloat));
  py::gil_scoped_release release;
  throw_if(rt_->read_tensor(p.id, to_kind(kind), std::span<float>(out.data_ptr<float>(), p.numel)));
  return out;
}

void Engine::write_tensor(std::uint32_t id, int kind, const at::Tensor& values) {
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

void Engine::add_to_working_set(std::uint32_t id, std::uint32_t set) {
  throw_if(rt_->add_to_working_set(param(id).id, set));
}

void Engine::set_tensor_steps(std::uint32_t id, std::int64_t steps) {
  throw_if(rt_->set_tensor_steps(param(id).id, steps));
}

py::dict Engine::step() {
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
  d["updates_deferred"] = stats->updates_deferred;  // run during the next forward (Note [Deferred updates])
  d["followed_plan"] = stats->followed_plan;
  d["step_s"] = stats->step_s;
  d["stall_s"] = stats->stall_s;
  put_traffic(d, *stats);
  d["gpu_high_water_bytes"] = stats->gpu_high_water_bytes;
  d["host_high_water_bytes"] = stats->host_high_water_bytes;
  d["nvme_bytes"] = stats->nvme_bytes;
  return d;
}

void Engine::abort_step() {
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

void Engine::flush() {
  check_open();
  sync_views();
  py::gil_scoped_release release;
  throw_if(rt_->flush());
}

void Engine::save_checkpoint(const std::string& dir) {
  check_open();
  sync_views();
  py::gil_scoped_release release;
  throw_if(rt_->save_checkpoint(dir));
}

void Engine::begin_checkpoint(const std::string& dir) {
  check_open();
  sync_views();
  py::gil_scoped_release release;
  throw_if(rt_->begin_checkpoint(dir));
}

void Engine::finish_checkpoint() {
  check_open();
  py::gil_scoped_release release;
  throw_if(rt_->finish_checkpoint());
}

bool Engine::checkpoint_in_flight() {
  check_open();
  auto r = rt_->checkpoint_in_flight();
  throw_if(r.status());
  return *r;
}

void Engine::load_checkpoint(const std::string& dir) {
  check_open();
  sync_views();
  {
    py::gil_scoped_release release;
    throw_if(rt_->load_checkpoint(dir));
  }
  for (Param& p : params_) refresh_view(p);
}

std::string Engine::describe() {
  check_open();
  return rt_->describe();
}

void Engine::materialise(std::uint32_t id) {
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

std::vector<std::string> Engine::sync_views() {
  std::vector<std::string> written;
  if (rt_ == nullptr) return written;
  for (Param& p : params_) {
    if (p.binds > 0 || !(p.poison.in_view() || replaced(p))) continue;
    if (push_written(*rt_, p)) written.push_back(p.name);
  }
  return written;
}

void Engine::drop_views() {
  if (rt_ == nullptr) return;
  for (Param& p : params_) {
    if (p.binds == 0 && (p.poison.in_view() || replaced(p))) drop_view(p);
  }
}

py::dict Engine::counters() const {
  py::dict d;
  d["crossings"] = crossings_;
  d["param_leases"] = param_leases_;
  d["kept_gradients"] = grads_.kept_total();  // Note [Gradients in pieces]
  d["kept_bytes_peak"] = grads_.kept_bytes_peak();
  return d;
}

void Engine::check_open() const {
  if (rt_ == nullptr) throw StrataError("strata.torch: this engine is closed");
}

Param& Engine::param(std::uint32_t id) {
  check_open();
  if (id >= params_.size()) throw py::value_error(fmt::format("no parameter with id {}", id));
  return params_[id];
}

StateKind Engine::to_kind(int kind) {
  if (kind < 0 || kind > static_cast<int>(StateKind::kState1))
    throw py::value_error(fmt::format("bad state kind {}", kind));
  return static_cast<StateKind>(kind);
}

void Engine::refresh_view(Param& p) {
  if (p.binds == 0 && p.poison.in_view() && !replaced(p)) fill_view(*rt_, p);
}

void Engine::drop_view(Param& p) {
  push_written(*rt_, p);
  restore_home(p);
}

}  // namespace strata::torch_binding
