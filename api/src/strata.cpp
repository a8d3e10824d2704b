// strata::Runtime: the facade over memory::make_device + runtime::Runtime.
#include "strata/strata.hpp"

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/runtime/options.hpp"

namespace strata {

Status Config::validate() const {
  STRATA_RETURN_IF_ERROR(device.validate());
  STRATA_RETURN_IF_ERROR(runtime::validate_options(runtime));
  if (runtime.budgets.gpu_bytes > device.budget_bytes) {
    return invalid_argument(
        "budgets.gpu = {} is larger than device.budget = {}: the chunk budget is part of "
        "the device's memory; lower budgets.gpu or raise device.budget",
        format_bytes(runtime.budgets.gpu_bytes), format_bytes(device.budget_bytes));
  }
  return Status::Ok();
}

Result<std::unique_ptr<Runtime>> Runtime::create(Config config) {
  STRATA_RETURN_IF_ERROR(config.validate());
  std::string why;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<memory::Device> device, memory::make_device(config.device, &why));
  STRATA_LOG_INFO("strata: device {} ({})", device->name(), why);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<runtime::Runtime> core,
                          runtime::Runtime::create(*device, config.runtime));
  return std::unique_ptr<Runtime>(new Runtime(std::move(config), std::move(device), std::move(core)));
}

Runtime::Runtime(Config config, std::unique_ptr<memory::Device> device,
                 std::unique_ptr<runtime::Runtime> core)
    : config_(std::move(config)), device_(std::move(device)), core_(std::move(core)) {}

Runtime::~Runtime() {
  core_.reset();  // before the device it runs on
}

Result<TensorId> Runtime::register_tensor(std::string name, std::vector<std::int64_t> shape, bool frozen) {
  return core_->register_tensor({.name = std::move(name),
                                 .shape = std::move(shape),
                                 .dtype = config_.runtime.compute_dtype,
                                 .frozen = frozen});
}

Result<TensorId> Runtime::find_tensor(std::string_view name) const {
  return core_->find_tensor(name);
}

Status Runtime::init_tensor(TensorId tensor, std::span<const float> values) {
  return core_->init_tensor(tensor, values);
}

Status Runtime::read_tensor(TensorId tensor, StateKind kind, std::span<float> out) {
  return core_->read_tensor(tensor, kind, out);
}

Result<Lease> Runtime::param(TensorId tensor, Where where) {
  return core_->acquire(tensor, StateKind::kParam, Access::kRead, where);
}

Result<Lease> Runtime::grad(TensorId tensor, Access access, Where where) {
  return core_->acquire(tensor, StateKind::kGrad, access, where);
}

Result<Lease> Runtime::acquire(TensorId tensor, StateKind kind, Access access, Where where) {
  return core_->acquire(tensor, kind, access, where);
}

Status Runtime::launch(std::function<void()> fn) {
  return core_->launch(std::move(fn));
}

Status Runtime::synchronize() {
  return device_->synchronize(core_->compute_stream());
}

Status Runtime::wait(const Lease& lease) {
  return core_->wait(lease);
}

Status Runtime::begin_micro_batch(bool last) {
  return core_->begin_micro_batch(last);
}

Status Runtime::no_gradient(TensorId tensor) {
  return core_->no_gradient(tensor);
}

Status Runtime::write_tensor(TensorId tensor, StateKind kind, std::span<const float> values) {
  return core_->write_tensor(tensor, kind, values);
}

Result<std::int64_t> Runtime::tensor_steps(TensorId tensor) const {
  return core_->tensor_steps(tensor);
}

Status Runtime::set_tensor_steps(TensorId tensor, std::int64_t steps) {
  return core_->set_tensor_steps(tensor, steps);
}

Status Runtime::save_checkpoint(const std::string& dir) {
  return core_->save_checkpoint(dir);
}

Status Runtime::begin_checkpoint(const std::string& dir) {
  return core_->begin_checkpoint(dir);
}

Status Runtime::finish_checkpoint() {
  return core_->finish_checkpoint();
}

Result<bool> Runtime::checkpoint_in_flight() {
  return core_->checkpoint_in_flight();
}

Status Runtime::load_checkpoint(const std::string& dir) {
  return core_->load_checkpoint(dir);
}

Status Runtime::set_tensor_group(TensorId tensor, std::uint32_t group) {
  return core_->set_tensor_group(tensor, group);
}

Status Runtime::set_group_hyper(std::uint32_t group, float lr, float weight_decay) {
  return core_->set_group_hyper(group, lr, weight_decay);
}

void Runtime::set_grad_scale(float scale) {
  core_->set_grad_scale(scale);
}

Status Runtime::abort_step() {
  return core_->abort_step();
}

Status Runtime::flush() {
  return core_->flush();
}

Result<StepStats> Runtime::step() {
  STRATA_ASSIGN_OR_RETURN(StepStats st, core_->step());
  ++stats_.steps;
  stats_.steps_skipped += st.applied ? 0 : 1;
  stats_.bytes_h2d += st.bytes_h2d;
  stats_.bytes_d2h += st.bytes_d2h;
  stats_.bytes_disk_read += st.bytes_disk_read;
  stats_.bytes_disk_write += st.bytes_disk_write;
  stats_.stall_s += st.stall_s;
  stats_.step_s += st.step_s;
  stats_.gpu_high_water_bytes = std::max(stats_.gpu_high_water_bytes, st.gpu_high_water_bytes);
  stats_.host_high_water_bytes = std::max(stats_.host_high_water_bytes, st.host_high_water_bytes);
  stats_.nvme_bytes = std::max(stats_.nvme_bytes, st.nvme_bytes);
  stats_.prefetch_errors += st.prefetch_errors;
  return st;
}

Status Runtime::write_chrome_trace(const std::string& path) const {
  return core_->write_chrome_trace(path);
}

std::string Runtime::describe() const {
  return fmt::format("device {}; plan: {}", device_->name(), core_->plan().summary());
}

}  // namespace strata
