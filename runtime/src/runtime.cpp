// Runtime: options, creation, registration and the layout (finalize); leases are
// in leases.cpp, step() in step.cpp.
#include "strata/runtime/runtime.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <exception>

#include "runtime_impl.hpp"
#include "strata/comm/caps.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_caps.hpp"
#include "strata/runtime/options.hpp"

namespace strata::runtime {

// --- Lease ---------------------------------------------------------------

Lease::Lease(Lease&& other) noexcept {
  *this = std::move(other);
}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    release();
    runtime_ = std::exchange(other.runtime_, nullptr);
    uncaught_ = other.uncaught_;
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
  if (std::uncaught_exceptions() > uncaught_) {
    abandon();  // Note [Failed steps]
    return;
  }
  release();
}

void Lease::abandon() {
  if (runtime_ == nullptr) return;
  runtime_->abandon(*this);
  runtime_ = nullptr;
}

void* Lease::data() const {
  STRATA_CHECK_MSG(runtime_ != nullptr, "data() of an empty or released lease");
  return data_;
}

Released Lease::release() {
  if (runtime_ == nullptr) return Released::kUnpinned;
  const Released r = runtime_->release(*this);
  runtime_ = nullptr;
  return r;
}

// --- Runtime -------------------------------------------------------------

Runtime::Runtime() = default;

Result<std::unique_ptr<Runtime>> Runtime::create(memory::Device& device, RuntimeOptions options) {
  std::unique_ptr<Runtime> rt(new Runtime());
  STRATA_RETURN_IF_ERROR(rt->start(device, std::move(options)));
  return rt;
}

Status Runtime::start(memory::Device& device, RuntimeOptions options) {
  STRATA_CHECK_MSG(impl_ == nullptr, "Runtime::start of a runtime already started");
  STRATA_RETURN_IF_ERROR(validate_options(options));
  if (options.comm != nullptr && comm::needs_cuda_memory(*options.comm) &&
      !memory::device_caps(device).cuda_memory) {
    return invalid_argument(
        "comm: the nccl backend reduces CUDA device memory, but this runtime's device is {} (host memory); "
        "use the local or mpi backend with it (Note [Sharded step])",
        memory::device_kind_name(device.kind()));
  }
  auto impl = std::make_unique<Impl>(device, std::move(options));
  Impl& m = *impl;
  STRATA_ASSIGN_OR_RETURN(m.core().pool, ThreadPool::create({.threads = m.core().opt.threads}));
  if (m.core().opt.host_store != nullptr) {
    m.core().host = m.core().opt.host_store;
  } else {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<HostStore> host,
                            make_host_store(m.core().opt.budgets.host_bytes, &device));
    m.core().host = std::move(host);
  }
  STRATA_ASSIGN_OR_RETURN(m.core().compute, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(m.core().h2d, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(m.core().d2h, device.create_stream());
  STRATA_ASSIGN_OR_RETURN(m.core().opt_stream, device.create_stream());
  STRATA_RETURN_IF_ERROR(m.residency().init());
  STRATA_LOG_INFO(
      "runtime: device {}; host tier {}; gpu budget {}, host budget {}, nvme budget {}; {} workers",
      device.name(), m.core().host->describe(), format_bytes(m.core().opt.budgets.gpu_bytes),
      format_bytes(m.core().opt.budgets.host_bytes), format_bytes(m.core().opt.budgets.nvme_bytes),
      m.core().pool->size());
  impl_ = std::move(impl);
  return Status::Ok();
}

Runtime::~Runtime() {
  if (impl_ == nullptr) return;  // start() failed (strata::Runtime::create)
  Impl& m = *impl_;
  {
    std::unique_lock lock(m.core().mu);
    // A save in flight ends first (its error was for finish_checkpoint).
    m.checkpoints().finish(lock).ignore();
    m.pipeline().wait_all(lock).ignore();
    m.residency().wait_staging_reads(lock);
  }
  m.core().device.synchronize().ignore();
  m.residency().release_staging();
  for (const Chunk& c : m.core().chunks()) {
    if (c.host != nullptr) m.core().host->free(c.host, c.bytes);
    if (m.core().nvme.is_open()) {
      for (std::uint32_t s : c.nvme_slots) m.core().nvme.free_slot(s);
    }
  }
  m.residency().clear();
}

Result<TensorId> Runtime::register_tensor(TensorSpec spec) {
  Impl& m = *impl_;
  std::lock_guard lock(m.core().mu);
  InvariantCheck check(m);
  if (m.core().finalized()) {
    return failed_precondition(
        "register_tensor(\"{}\") after the first acquire/init/step: register every tensor before the first "
        "step",
        spec.name);
  }
  STRATA_ASSIGN_OR_RETURN(std::uint64_t numel, shape_numel(spec.name, spec.shape));
  if (spec.dtype != m.core().opt.compute_dtype) {
    return invalid_argument(
        "tensor \"{}\" has dtype {} but the runtime's compute_dtype is {}; register it as {}", spec.name,
        runtime::dtype_name(spec.dtype), runtime::dtype_name(m.core().opt.compute_dtype),
        runtime::dtype_name(m.core().opt.compute_dtype));
  }
  if (m.core().tensors().contains(spec.name))
    return invalid_argument("tensor \"{}\" is already registered", spec.name);
  return m.core().add_tensor(std::move(spec), numel);
}

Result<TensorId> Runtime::register_tensor(std::string name, std::vector<std::int64_t> shape, bool frozen) {
  return register_tensor({.name = std::move(name),
                          .shape = std::move(shape),
                          .dtype = impl_->core().opt.compute_dtype,
                          .frozen = frozen});
}

Result<TensorId> Runtime::find_tensor(std::string_view name) const {
  std::lock_guard lock(impl_->core().mu);
  std::optional<TensorId> id = impl_->core().tensors().find(std::string(name));
  if (!id) return not_found("no tensor named \"{}\" is registered", name);
  return *id;
}

std::size_t Runtime::tensor_count() const {
  std::lock_guard lock(impl_->core().mu);
  return impl_->core().tensors().size();
}

namespace {

//! The layout options a q8 run packs with (Note [Q8 state chunks] in
//! pipeline/q8_states.cpp): tensor offsets and chunk sizes on whole scale blocks.
static_assert(kQ8BlockElems == kernels::kQ8BlockElems, "the runtime's q8 block is the kernel's");
LayoutOptions q8_layout_options(const LayoutOptions& options) {
  LayoutOptions o = options;
  o.offset_align_elems = std::max<std::uint64_t>(o.offset_align_elems, kQ8BlockElems);
  o.chunk_align_elems = std::max<std::uint64_t>(o.chunk_align_elems, o.offset_align_elems);
  return o;
}

//! Note [Sharded step]: every chunk splits into W equal, aligned shards. The
//! same on every rank (DataParallel::check_config compares chunk_elems and the ranks).
//! With q8 states a shard is whole scale blocks (Note [Q8 state chunks]).
void pad_to_shards(ChunkLayout& layout, int ranks, std::uint64_t align) {
  const std::uint64_t unit = static_cast<std::uint64_t>(ranks) * align;
  auto round_up = [unit](std::uint64_t x) { return (x + unit - 1) / unit * unit; };  // W need not be 2^k
  layout.chunk_elems = round_up(layout.chunk_elems);
  layout.capacity_total_elems = 0;
  for (FamilyLayout& fl : layout.families) {
    fl.capacity_elems = round_up(fl.capacity_elems);
    layout.capacity_total_elems += fl.capacity_elems;
  }
}

}  // namespace

Status Runtime::Impl::finalize(std::unique_lock<std::mutex>& lock) {
  if (core().finalized()) return Status::Ok();
  if (core().tensors().empty())
    return failed_precondition("no tensors are registered; register them before the first step");
  std::vector<std::uint64_t> numels;
  std::vector<TensorId> order;
  for (TensorId t = 0; t < core().tensors().size(); ++t) {
    numels.push_back(core().tensors()[t].numel);
    order.push_back(t);
  }
  // q8 states: tensors and chunks on whole scale blocks (Note [Q8 state chunks]).
  const LayoutOptions layout_options =
      core().opt.state_dtype == DType::kQ8 ? q8_layout_options(core().opt.layout) : core().opt.layout;
  STRATA_ASSIGN_OR_RETURN(ChunkLayout layout, build_layout(numels, order, layout_options));
  if (core().dp_ranks() > 1)
    pad_to_shards(layout, core().dp_ranks(), shard_align_elems(core().opt.state_dtype));
  core().set_layout(std::move(layout));
  STRATA_RETURN_IF_ERROR(dp().check_config(lock));
  const std::uint64_t cb = dtype_bytes(core().opt.compute_dtype);
  const std::size_t families = core().layout().families.size();
  pipeline().init(families);
  std::vector<std::array<std::uint64_t, kStateKindCount>> bytes(families);
  std::vector<std::uint64_t> trainable(families);
  for (FamilyId f = 0; f < families; ++f) {
    const FamilyLayout& fl = core().layout().families[f];
    std::uint64_t trainable_numel = 0;
    for (TensorId t : fl.tensors) {
      trainable_numel += core().tensors()[t].spec.frozen ? 0 : core().tensors()[t].numel;
      pipeline().trainable[f] += core().tensors()[t].spec.frozen ? 0 : 1;
    }
    const std::uint64_t cap = fl.capacity_elems;
    std::array<std::uint64_t, kStateKindCount>& b = bytes[f];
    b[static_cast<int>(StateKind::kParam)] = cap * cb;
    if (trainable_numel > 0) b[static_cast<int>(StateKind::kGrad)] = cap * cb;
    if (trainable_numel > 0) {  // this rank's shard of them (Note [Sharded step])
      const std::uint64_t shard = core().shard_elems(f);
      if (core().separate_master) b[static_cast<int>(StateKind::kMaster)] = shard * 4;
      for (std::uint32_t i = 0; i < core().state_count; ++i)
        b[static_cast<int>(StateKind::kState0) + i] = state_chunk_bytes(core().opt.state_dtype, shard);
    }
    trainable[f] = trainable_numel;
  }
  core().lay_out_chunks(bytes, trainable);
  STRATA_LOG_INFO("runtime: {} tensors in {} chunk families of {} elements ({:.1f}% padding)",
                  core().tensors().size(), families, core().layout().chunk_elems,
                  100.0 * core().layout().padding_fraction());
  STRATA_RETURN_IF_ERROR(adopt_plan(lock, registration_trace(families)));
  // Every param the plan keeps off NVMe has a host home (zeros until init_tensor);
  // an NVMe-homed one starts absent (zeros too, Note [NVMe-homed params]).
  for (FamilyId f = 0; f < families; ++f) {
    if (core().param_on_nvme(f)) continue;
    Chunk& p = core().chunk_mut(f, StateKind::kParam);
    STRATA_ASSIGN_OR_RETURN(std::byte * buffer, core().host_buffer(p));
    std::memset(buffer, 0, p.bytes);
    p.move_value(ChunkValue::kHost);
  }
  core().finalize();  // the warm-up step is traced, on demand + LRU (StepTracker starts not following)
  return Status::Ok();
}

const RunStats& Runtime::stats() const {
  return impl_->book().totals;
}
std::string Runtime::describe() const {
  std::lock_guard lock(impl_->core().mu);
  return fmt::format("device {}; plan: {}", impl_->core().device.name(), impl_->core().plan().summary());
}
Status Runtime::synchronize() {
  return impl_->core().device.synchronize(impl_->core().compute);
}
const ChunkLayout& Runtime::layout() const {
  return impl_->core().layout();
}
std::uint64_t Runtime::state_bytes() const {
  std::lock_guard lock(impl_->core().mu);
  std::uint64_t total = 0;
  for (const Chunk& c : impl_->core().chunks()) total += is_optim_kind(c.kind) ? c.bytes : 0;
  return total;
}
const Plan& Runtime::plan() const {
  return impl_->core().plan();
}
std::size_t Runtime::incomplete_gradients_max() const {
  std::lock_guard lock(impl_->core().mu);
  return impl_->residency().incomplete_gradients_max();
}
const StepTrace& Runtime::last_trace() const {
  return impl_->tracker().plan_trace();
}
HotPathCounters Runtime::hot_path_counters() const {
  const Core& core = impl_->core();
  std::shared_ptr<NvmeStore> nvme;
  {
    std::lock_guard lock(impl_->core().mu);  // (the store is created on first use)
    nvme = core.nvme.shared();
  }
  return {.copy_records = core.copy_records_created(),
          .launch_records = core.launch_records_created(),
          .timeline_spans = core.timeline.recorded(),
          .timeline_spans_dropped = core.timeline.dropped(),
          .pool_handler_blocks = core.pool->handler_memory().blocks_created(),
          .pool_handlers_oversized = core.pool->handler_memory().oversized(),
          .nvme_io_records = core.nvme.records_created(),
          .nvme_slot_op_records = nvme != nullptr ? nvme->io_records() : 0};
}

const Timeline& Runtime::timeline() const {
  return impl_->core().timeline;
}
Status Runtime::write_chrome_trace(const std::string& path) const {
  return impl_->core().timeline.write_chrome_trace(path);
}

void Runtime::check_invariants() const {
  std::lock_guard lock(impl_->core().mu);
  impl_->check_invariants();
}

StepCost Runtime::predict(const Rates& rates) const {
  Impl& m = *impl_;
  std::lock_guard lock(m.core().mu);
  PlanInput in{.families = {m.core().chunks().family_bytes().begin(), m.core().chunks().family_bytes().end()},
               .trace = m.tracker().plan_trace(),
               .budgets = m.core().opt.budgets,
               .options = m.core().opt.plan,
               .slot_bytes = m.core().layout().chunk_elems * dtype_bytes(m.core().opt.compute_dtype),
               .working_set_families = m.core().working_set_families()};
  return predict_step(in, m.core().plan(), rates);
}

}  // namespace strata::runtime
