// Runtime: options, registration, leases, steps and re-planning.
#include "strata/runtime/runtime.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/runtime/options.hpp"

namespace strata::runtime {
namespace {

std::uint32_t optimizer_state_count(const kernels::Hyper& h) {
  using kernels::Optimizer;
  switch (h.optimizer) {
    case Optimizer::kAdam:
    case Optimizer::kAdamW:
    case Optimizer::kLamb:
      return 2;
    case Optimizer::kSgd:
      return h.momentum != 0.0f ? 1 : 0;
    case Optimizer::kLars:
    case Optimizer::kLion:
    case Optimizer::kAdagrad:
      return 1;
    case Optimizer::kCame:
      return 0;
  }
  return 0;
}

}  // namespace

std::string_view state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::kParam:
      return "param";
    case StateKind::kGrad:
      return "grad";
    case StateKind::kMaster:
      return "master";
    case StateKind::kState0:
      return "state0";
    case StateKind::kState1:
      return "state1";
  }
  return "unknown";
}

// --- Lease ---------------------------------------------------------------

Lease::Lease(Lease&& other) noexcept {
  *this = std::move(other);
}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    release();
    runtime_ = std::exchange(other.runtime_, nullptr);
    data_ = other.data_;
    numel_ = other.numel_;
    tensor_ = other.tensor_;
    kind_ = other.kind_;
    access_ = other.access_;
    where_ = other.where_;
    chunk_ = other.chunk_;
  }
  return *this;
}

Lease::~Lease() {
  release();
}

void* Lease::data() const {
  STRATA_CHECK_MSG(runtime_ != nullptr, "data() of an empty or released lease");
  return data_;
}

void Lease::release() {
  if (runtime_ == nullptr) return;
  runtime_->release(*this);
  runtime_ = nullptr;
}

// --- Runtime -------------------------------------------------------------

Runtime::Runtime(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<Runtime>> Runtime::create(memory::Device& device, RuntimeOptions options) {
  STRATA_RETURN_IF_ERROR(validate_options(options));
  auto impl = std::make_unique<Impl>(device, std::move(options));
  Impl& m = *impl;
  STRATA_ASSIGN_OR_RETURN(m.pool, ThreadPool::create({.threads = m.opt.threads}));
  if (m.opt.host_store != nullptr) {
    m.host = m.opt.host_store;
  } else {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<HostStore> host,
                            make_host_store(m.opt.budgets.host_bytes, &device));
    m.host = std::move(host);
  }
  m.nvme = m.opt.nvme_store;
  STRATA_ASSIGN_OR_RETURN(m.compute, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(m.h2d, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(m.d2h, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(m.opt_stream, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(m.demand, device.create_event());
  m.state_count = optimizer_state_count(m.opt.hyper);
  m.separate_master = m.opt.compute_dtype != DType::kF32;
  STRATA_LOG_INFO(
      "runtime: device {}; host tier {}; gpu budget {}, host budget {}, nvme budget {}; {} workers",
      device.name(), m.host->describe(), format_bytes(m.opt.budgets.gpu_bytes),
      format_bytes(m.opt.budgets.host_bytes), format_bytes(m.opt.budgets.nvme_bytes), m.pool->size());
  return std::unique_ptr<Runtime>(new Runtime(std::move(impl)));
}

Runtime::~Runtime() {
  Impl& m = *impl_;
  {
    std::unique_lock lock(m.mu);
    m.wait_optimizers(lock).ignore();
  }
  m.device.synchronize().ignore();
  for (Chunk& c : m.chunks) {
    if (c.host != nullptr) m.host->free(c.host, c.bytes);
    if (m.nvme != nullptr) {
      for (std::uint32_t s : c.nvme_slots) m.nvme->free_slot(s);
    }
  }
  m.slots.clear();
  m.device_memory.clear();
}

Result<TensorId> Runtime::register_tensor(TensorSpec spec) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  if (m.finalized) {
    return failed_precondition(
        "register_tensor(\"{}\") after the first acquire/init/step: register every tensor before the first "
        "step",
        spec.name);
  }
  STRATA_ASSIGN_OR_RETURN(std::uint64_t numel, shape_numel(spec.name, spec.shape));
  if (spec.dtype != m.opt.compute_dtype) {
    return invalid_argument(
        "tensor \"{}\" has dtype {} but the runtime's compute_dtype is {}; register it as {}", spec.name,
        runtime::dtype_name(spec.dtype), runtime::dtype_name(m.opt.compute_dtype),
        runtime::dtype_name(m.opt.compute_dtype));
  }
  if (m.by_name.contains(spec.name))
    return invalid_argument("tensor \"{}\" is already registered", spec.name);
  auto id = static_cast<TensorId>(m.tensors.size());
  m.by_name.emplace(spec.name, id);
  m.tensors.push_back(TensorInfo{.spec = std::move(spec), .numel = numel});
  return id;
}

Result<TensorId> Runtime::find_tensor(std::string_view name) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->by_name.find(std::string(name));
  if (it == impl_->by_name.end()) return not_found("no tensor named \"{}\" is registered", name);
  return it->second;
}

std::size_t Runtime::tensor_count() const {
  std::lock_guard lock(impl_->mu);
  return impl_->tensors.size();
}

Status Runtime::Impl::finalize(std::unique_lock<std::mutex>& lock) {
  if (finalized) return Status::Ok();
  if (tensors.empty())
    return failed_precondition("no tensors are registered; register them before the first step");
  std::vector<std::uint64_t> numels;
  std::vector<TensorId> order;
  for (TensorId t = 0; t < tensors.size(); ++t) {
    numels.push_back(tensors[t].numel);
    order.push_back(t);
  }
  STRATA_ASSIGN_OR_RETURN(layout, build_layout(numels, order, opt.layout));
  const std::uint64_t cb = dtype_bytes(opt.compute_dtype);
  const std::uint64_t sb = kernels::dtype_size(opt.state_dtype);
  const std::size_t families = layout.families.size();
  chunks.clear();
  chunks.resize(families * kStateKindCount);
  family_bytes.assign(families, FamilyBytes{});
  runs.assign(families, FamilyRun{});
  writebacks.assign(families, WriteBack{});
  trainable.assign(families, 0);
  grads_written.assign(families, 0);
  for (FamilyId f = 0; f < families; ++f) {
    const FamilyLayout& fl = layout.families[f];
    std::uint64_t trainable_numel = 0;
    for (TensorId t : fl.tensors) {
      trainable_numel += tensors[t].spec.frozen ? 0 : tensors[t].numel;
      trainable[f] += tensors[t].spec.frozen ? 0 : 1;
    }
    const std::uint64_t cap = fl.capacity_elems;
    std::uint64_t bytes[kStateKindCount] = {};
    bytes[static_cast<int>(StateKind::kParam)] = cap * cb;
    if (trainable_numel > 0) {
      bytes[static_cast<int>(StateKind::kGrad)] = cap * cb;
      if (separate_master) bytes[static_cast<int>(StateKind::kMaster)] = cap * 4;
      for (std::uint32_t i = 0; i < state_count; ++i)
        bytes[static_cast<int>(StateKind::kState0) + i] = cap * sb;
    }
    for (std::size_t k = 0; k < kStateKindCount; ++k) {
      Chunk& c = chunk(f, static_cast<StateKind>(k));
      c.family = f;
      c.kind = static_cast<StateKind>(k);
      c.bytes = align_up(bytes[k], 4096);
      if (bytes[k] == 0) c.bytes = 0;
    }
    FamilyBytes& b = family_bytes[f];
    b.numel = trainable_numel;
    b.param_bytes = chunk(f, StateKind::kParam).bytes;
    b.grad_bytes = chunk(f, StateKind::kGrad).bytes;
    for (StateKind k : {StateKind::kMaster, StateKind::kState0, StateKind::kState1})
      b.optim_bytes += chunk(f, k).bytes;
  }
  // As the NVMe tier will store them (ensure_nvme_store picks the same slot).
  const std::uint64_t nvme_slot = nvme_slot_bytes(largest_optim_chunk());
  for (FamilyId f = 0; f < families; ++f) {
    for (StateKind k : {StateKind::kMaster, StateKind::kState0, StateKind::kState1})
      family_bytes[f].optim_nvme_bytes += nvme_chunk_bytes(chunk(f, k).bytes, nvme_slot);
  }
  // Every param has a host home (zeros until init_tensor).
  for (FamilyId f = 0; f < families; ++f) {
    Chunk& p = chunk(f, StateKind::kParam);
    STRATA_ASSIGN_OR_RETURN(std::byte * buffer, host_buffer(p));
    std::memset(buffer, 0, p.bytes);
    p.host_valid = true;
    p.absent = false;
  }
  STRATA_LOG_INFO("runtime: {} tensors in {} chunk families of {} elements ({:.1f}% padding)", tensors.size(),
                  families, layout.chunk_elems, 100.0 * layout.padding_fraction());
  STRATA_RETURN_IF_ERROR(adopt_plan(lock, registration_trace(families)));
  finalized = true;
  pos = SIZE_MAX;
  following = false;  // the warm-up step is traced, on demand + LRU
  return Status::Ok();
}

Result<Lease> Runtime::acquire(TensorId tensor, StateKind kind, Access access, Where where) {
  Impl& m = *impl_;
  std::unique_lock lock(m.mu);
  if (!m.background_error.ok()) return m.background_error;
  if (tensor >= m.tensors.size()) {
    return invalid_argument("acquire: tensor id {} is not registered ({} tensors)", tensor, m.tensors.size());
  }
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  TensorInfo& info = m.tensors[tensor];
  const TensorSlot& ts = m.layout.slots[tensor];
  Chunk& c = m.chunk(ts.family, kind);
  if (c.bytes == 0) {
    return failed_precondition("acquire(\"{}\", {}): this tensor has no {} state ({})", info.spec.name,
                               state_kind_name(kind), state_kind_name(kind),
                               info.spec.frozen ? "it is frozen" : "the optimizer keeps none");
  }
  if (kind == StateKind::kGrad && info.spec.frozen) {
    return failed_precondition("acquire(\"{}\", grad): the tensor is frozen and has no gradient",
                               info.spec.name);
  }
  if (kind == StateKind::kGrad && access != Access::kRead && info.written_in_micro_batch) {
    return failed_precondition(
        "acquire(\"{}\", grad) for write: its gradient was already handed over in this micro-batch; "
        "accumulate "
        "tied uses before handing it over, or start a new micro-batch with begin_micro_batch (Note [Gradient "
        "completion])",
        info.spec.name);
  }
  if (access != Access::kRead && info.write_leases > 0) {
    return failed_precondition(
        "acquire(\"{}\", {}) for write: the tensor is already leased for write; release "
        "that lease first",
        info.spec.name, state_kind_name(kind));
  }
  if (kind == StateKind::kGrad && access != Access::kWrite && !info.grad_written) {
    return failed_precondition(
        "acquire(\"{}\", grad, {}): no gradient was written since the last step; the "
        "first micro-batch must use Access::kWrite",
        info.spec.name, access == Access::kRead ? "read" : "accumulate");
  }
  if (kind != StateKind::kGrad && kind != StateKind::kParam && where == Where::kDevice &&
      m.plan.families[ts.family].optim_home != Tier::kGpu) {
    return failed_precondition(
        "acquire(\"{}\", {}) on the device: optimizer states of this family live on {}; "
        "lease them on Where::kHost between steps",
        info.spec.name, state_kind_name(kind), tier_name(m.plan.families[ts.family].optim_home));
  }
  if (kind == StateKind::kParam && access != Access::kRead && where == Where::kDevice) {
    return failed_precondition(
        "acquire(\"{}\", param) for write on the device: params change only through the "
        "optimizer or init_tensor",
        info.spec.name);
  }

  // Trace and plan bookkeeping; a planned step starts reading NVMe states ahead.
  if (m.warm && m.opt.plan.prefetch && !m.read_ahead && m.read_ahead_cursor == 0 && m.nvme != nullptr) {
    m.read_ahead = true;
    m.pump();
  }
  if (kind == StateKind::kGrad) m.in_backward = true;
  const Phase phase = m.in_backward ? Phase::kBackward : Phase::kForward;
  m.tracer.record(ts.family, phase, kind == StateKind::kGrad && access != Access::kRead);
  if (m.following) {
    const auto& uses = m.plan_trace.uses;
    auto matches = [&](std::size_t p) {
      return p < uses.size() && uses[p].family == ts.family && uses[p].phase == phase;
    };
    if (m.pos != SIZE_MAX && matches(m.pos)) {
      // same use
    } else if (matches(m.pos == SIZE_MAX ? 0 : m.pos + 1)) {
      m.pos = m.pos == SIZE_MAX ? 0 : m.pos + 1;
    } else {
      STRATA_LOG_DEBUG(
          "runtime: step {} departs from the trace at use {} (family {} {}); on-demand moves and "
          "LRU eviction for the rest of the step, re-plan after it",
          m.step_index + 1, m.pos == SIZE_MAX ? 0 : m.pos + 1, ts.family,
          phase == Phase::kForward ? "forward" : "backward");
      m.following = false;
      m.deviated = true;
    }
  }
  // A family whose optimizer is running is waited for (only an unplanned access can meet one).
  if (m.runs[ts.family].launched && !m.runs[ts.family].done) {
    const double t0 = m.timeline.now_us();
    m.cv.wait(lock, [&] { return m.runs[ts.family].done; });
    m.timeline.add_stall((m.timeline.now_us() - t0) * 1e-6);
    if (!m.background_error.ok()) return m.background_error;
  }

  std::byte* base = nullptr;
  if (where == Where::kDevice) {
    STRATA_RETURN_IF_ERROR(m.ensure_on_device(lock, c, /*load=*/!c.absent));
    DeviceSlot& slot = m.slots[static_cast<std::size_t>(c.slot)];
    STRATA_RETURN_IF_ERROR(m.device.wait(m.compute, slot.ready));
    base = slot.ptr;
  } else {
    if (m.plan.families[ts.family].optim_home == Tier::kNvme && kind != StateKind::kParam &&
        kind != StateKind::kGrad) {
      return failed_precondition(
          "acquire(\"{}\", {}) on host: the family's states live on NVMe; use read_tensor", info.spec.name,
          state_kind_name(kind));
    }
    STRATA_RETURN_IF_ERROR(m.ensure_on_host(lock, c));
    if (access != Access::kRead) {
      // A load or prefetch may still be copying from the host copy.
      STRATA_RETURN_IF_ERROR(m.device.synchronize(m.h2d));
      if (c.readers > 0)
        return failed_precondition("acquire(\"{}\") for write on host while leased on the device",
                                   info.spec.name);
      c.dev_valid = false;
      c.dev_dirty = false;
      if (c.slot >= 0 && !m.slots[static_cast<std::size_t>(c.slot)].dedicated) {
        m.slots[static_cast<std::size_t>(c.slot)].chunk = -1;
        c.slot = -1;
      }
    }
    base = c.host;
  }
  if (access != Access::kRead) {
    ++c.writers;
    ++info.write_leases;
    c.absent = false;
    if (where == Where::kDevice) c.dev_dirty = true;
  } else {
    ++c.readers;
  }
  ++m.leases_out;
  m.prefetch();

  const DType dtype = (kind == StateKind::kParam || kind == StateKind::kGrad)
                          ? m.opt.compute_dtype
                          : (kind == StateKind::kMaster ? DType::kF32 : m.opt.state_dtype);
  Lease lease;
  lease.runtime_ = this;
  lease.data_ = base + ts.offset_elems * dtype_bytes(dtype);
  lease.numel_ = ts.numel;
  lease.tensor_ = tensor;
  lease.kind_ = kind;
  lease.access_ = access;
  lease.where_ = where;
  lease.chunk_ = static_cast<std::uint32_t>(m.chunk_index(ts.family, kind));
  return lease;
}

void Runtime::release(Lease& lease) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  Chunk& c = m.chunks[lease.chunk_];
  if (lease.where_ == Where::kDevice && c.slot >= 0) {
    Status st = m.device.record(m.slots[static_cast<std::size_t>(c.slot)].fence, m.compute);
    if (!st.ok()) m.fail(st);
  }
  if (lease.access_ != Access::kRead) {
    STRATA_CHECK(c.writers > 0);
    --c.writers;
    --m.tensors[lease.tensor_].write_leases;
    if (lease.kind_ == StateKind::kGrad) {
      TensorInfo& info = m.tensors[lease.tensor_];
      info.grad_written = true;
      if (!info.written_in_micro_batch) {
        info.written_in_micro_batch = true;
        ++m.grads_written[c.family];
      }
    }
  } else {
    STRATA_CHECK(c.readers > 0);
    --c.readers;
  }
  --m.leases_out;
  // Note [Gradient completion]: the family's optimizer starts once its gradients
  // are complete and nobody holds them or its param.
  if ((lease.kind_ == StateKind::kGrad || lease.kind_ == StateKind::kParam) && !m.deferred() &&
      m.last_micro_batch && m.grads_written[c.family] > 0 &&
      m.grads_written[c.family] == m.trainable[c.family] &&
      m.chunk(c.family, StateKind::kGrad).writers == 0 && m.chunk(c.family, StateKind::kParam).readers == 0) {
    m.launch_optimizer(c.family);
  }
}

const memory::Stream& Runtime::compute_stream() const {
  return impl_->compute;
}

Status Runtime::launch(std::function<void()> fn) {
  Impl& m = *impl_;
  std::size_t use = 0;
  {
    std::lock_guard lock(m.mu);
    use = m.tracer.trace().uses.empty() ? 0 : m.tracer.trace().uses.size() - 1;
  }
  const double enqueued = m.timeline.now_us();
  return m.device.launch_host(m.compute, [&m, fn = std::move(fn), use, enqueued] {
    const double t0 = std::max(enqueued, m.timeline.now_us());
    fn();
    const double t1 = m.timeline.now_us();
    m.timeline.add(Track::kCompute, "compute", t0, t1, 0);
    m.track_end_us[static_cast<std::size_t>(Track::kCompute)].store(t1);
    std::lock_guard lock(m.compute_mu);
    if (m.compute_by_use.size() <= use) m.compute_by_use.resize(use + 1, 0.0);
    m.compute_by_use[use] += (t1 - t0) * 1e-6;
  });
}

void Runtime::set_grad_scale(float scale) {
  std::lock_guard lock(impl_->mu);
  impl_->grad_scale = scale;
  // Families that start before step() (not deferred) take the scale in effect
  // when they start; step() sets it again for the deferred ones.
  if (!impl_->deferred()) impl_->step_scale = scale;
}

Status Runtime::begin_micro_batch(bool last) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  if (m.leases_out > 0) {
    return failed_precondition("begin_micro_batch: {} leases are still held; release them first",
                               m.leases_out);
  }
  m.last_micro_batch = last;
  m.in_backward = false;  // a new forward begins
  std::fill(m.grads_written.begin(), m.grads_written.end(), 0);
  for (TensorInfo& t : m.tensors) t.written_in_micro_batch = false;
  return Status::Ok();
}

const ChunkLayout& Runtime::layout() const {
  return impl_->layout;
}
const Plan& Runtime::plan() const {
  return impl_->plan;
}
const StepTrace& Runtime::last_trace() const {
  return impl_->plan_trace;
}
const Timeline& Runtime::timeline() const {
  return impl_->timeline;
}
Status Runtime::write_chrome_trace(const std::string& path) const {
  return impl_->timeline.write_chrome_trace(path);
}

StepCost Runtime::predict(const Rates& rates) const {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  PlanInput in{.families = m.family_bytes,
               .trace = m.plan_trace,
               .budgets = m.opt.budgets,
               .options = m.opt.plan,
               .slot_bytes = m.layout.chunk_elems * dtype_bytes(m.opt.compute_dtype)};
  return predict_step(in, m.plan, rates);
}

}  // namespace strata::runtime
