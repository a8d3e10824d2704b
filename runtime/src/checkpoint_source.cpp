// The runtime as the checkpoint library's source (checkpoint_source.hpp), and the
// public calls that save and load (Runtime::save_checkpoint, begin_checkpoint,
// finish_checkpoint, checkpoint_in_flight, load_checkpoint), which take the lock
// and hand the work to the Checkpointer (runtime/checkpoint/).
#include "checkpoint_source.hpp"

#include <cstring>

#include "dp/data_parallel.hpp"
#include "runtime_impl.hpp"

namespace strata::runtime {

std::mutex& CheckpointSource::mutex() {
  return m_.core().mu;
}

std::condition_variable& CheckpointSource::changed() {
  return m_.core().cv;
}

int CheckpointSource::ranks() const {
  return m_.core().dp_ranks();
}

int CheckpointSource::rank() const {
  return m_.core().dp_rank();
}

const std::vector<std::string>& CheckpointSource::nvme_dirs() const {
  return m_.core().opt.nvme_dirs;
}

bool CheckpointSource::leased() const {
  return m_.book().leases_out > 0;
}

Status CheckpointSource::finalize(std::unique_lock<std::mutex>& lock) {
  return m_.finalize(lock);
}

Status CheckpointSource::wait_updates(std::unique_lock<std::mutex>& lock) {
  return m_.pipeline().wait_all(lock);
}

Status CheckpointSource::background_error() {
  return m_.core().errors.background();
}

checkpoint::Description CheckpointSource::describe() const {
  const Core& core = m_.core();
  checkpoint::Description d;
  const ChunkLayout& layout = core.layout();
  for (FamilyId f = 0; f < layout.families.size(); ++f) {
    checkpoint::FamilyEntry e{.tensors = layout.families[f].tensors};
    for (std::size_t k = 0; k < kStateKindCount; ++k) e.chunk_bytes[k] = core.chunk(f, StateKind(k)).bytes;
    e.shard_elems = core.shard_elems(f);
    e.owned = core.owns(f);
    e.optim_on_nvme = core.on_nvme(f);
    d.families.push_back(std::move(e));
  }
  for (TensorId id = 0; id < core.tensors().size(); ++id) {
    const TensorInfo& info = core.tensors()[id];
    const TensorSlot& slot = layout.slots[id];
    const Core::ShardPart part = core.shard_part(id);
    d.tensors.push_back({.name = info.spec.name,
                         .shape = info.spec.shape,
                         .frozen = info.spec.frozen,
                         .numel = info.numel,
                         .family = slot.family,
                         .offset_elems = slot.offset_elems,
                         .shard = {.first = part.first, .count = part.count, .at = part.at},
                         .steps = info.updates,
                         .group = info.group});
  }
  for (std::uint32_t g = 0; g < core.groups().size(); ++g) {
    const GroupHyper& h = core.groups()[g];
    if (h.set) d.groups.push_back({.group = g, .lr = h.lr, .weight_decay = h.weight_decay});
  }
  for (std::size_t k = 0; k < kStateKindCount; ++k) d.kind_dtype[k] = core.kind_dtype(StateKind(k));
  d.separate_master = core.separate_master;
  d.compute_dtype = core.opt.compute_dtype;
  d.state_dtype = core.opt.state_dtype;
  d.state_count = core.state_count;
  d.optimizer = std::string(kernels::optimizer_name(core.opt.hyper.optimizer));
  d.step_index = static_cast<std::int64_t>(m_.tracker().step_index());
  d.host_budget_bytes = core.host->budget_bytes();
  d.planned_host_bytes = core.plan().host_bytes;
  return d;
}

bool CheckpointSource::writing_back(FamilyId f) const {
  return m_.pipeline().writing_back(f);
}

bool CheckpointSource::updates_pending(FamilyId f) const {
  const Core& core = m_.core();
  for (TensorId t : core.layout().families[f].tensors) {
    if (core.tensors()[t].grad_written && !core.tensors()[t].spec.frozen) return true;
  }
  return false;
}

checkpoint::ChunkPlace CheckpointSource::place(FamilyId f, StateKind k) const {
  const Chunk& c = m_.core().chunk(f, k);
  using Place = checkpoint::ChunkPlace::Where;
  switch (c.value) {
    case ChunkValue::kNvme:
      return {.where = Place::kNvme, .slots = c.nvme_slots};
    case ChunkValue::kHost:
      return {.where = Place::kHost, .host = c.host};
    default:
      return {};
  }
}

Status CheckpointSource::copy_value(FamilyId f, StateKind k, std::byte* dst) {
  Core& core = m_.core();
  const Chunk& c = core.chunk(f, k);
  switch (c.value) {
    case ChunkValue::kHost:
      std::memcpy(dst, c.host, c.bytes);
      return Status::Ok();
    case ChunkValue::kAbsent:  // optimizer states start as zeros
      std::memset(dst, 0, c.bytes);
      return Status::Ok();
    case ChunkValue::kDevice: {  // the device copy is the only one: copy it, as a write-back would
      DeviceSlot& slot = m_.residency().slot_of(c);
      STRATA_RETURN_IF_ERROR(core.device.wait(core.d2h, slot.fence));
      STRATA_RETURN_IF_ERROR(
          core.device.copy_async(core.d2h, dst, slot.ptr, c.bytes, memory::CopyKind::kDeviceToHost));
      STRATA_RETURN_IF_ERROR(core.device.record(slot.fence, core.d2h));
      return core.device.synchronize(core.d2h);
    }
    default:
      return internal_error("checkpoint save: family {} {} is in the optimizer pipeline's staging", f,
                            state_kind_name(k));
  }
}

void CheckpointSource::pin_slot(std::uint32_t slot) {
  m_.core().nvme.pin_slot(slot);
}

void CheckpointSource::unpin_slot(std::uint32_t slot) {
  m_.core().nvme.unpin_slot(slot);
}

std::shared_ptr<NvmeStore> CheckpointSource::nvme_store() const {
  return m_.core().nvme.shared();
}

void CheckpointSource::launch_update(FamilyId f) {
  m_.pipeline().launch_optimizer(f);
}

Status CheckpointSource::read_chunk(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k,
                                    const std::function<void(const std::byte*)>& fn) {
  return m_.with_host_copy(lock, f, k, /*write=*/false, [&](std::byte* p) { fn(p); });
}

Status CheckpointSource::overwrite_chunk(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k,
                                         const std::function<void(std::byte*)>& fn) {
  return m_.with_host_copy(lock, f, k, /*write=*/true, fn, /*whole=*/true);
}

Status CheckpointSource::all_ok(std::unique_lock<std::mutex>& lock, Status mine, std::string_view what) {
  return m_.dp().all_ok(lock, std::move(mine), what);
}

Result<std::int64_t> CheckpointSource::max(std::unique_lock<std::mutex>& lock, std::int64_t value) {
  return m_.dp().max(lock, value);
}

Result<std::vector<std::string>> CheckpointSource::exchange_text(std::unique_lock<std::mutex>& lock,
                                                                 const std::string& text) {
  return m_.dp().exchange_text(lock, text);
}

Status CheckpointSource::broadcast_initial(std::unique_lock<std::mutex>& lock) {
  return m_.dp().broadcast_initial(lock);
}

Status CheckpointSource::finish_gathers(std::unique_lock<std::mutex>& lock) {
  return m_.dp().finish_all_gathers(lock);
}

Status CheckpointSource::all_gather(std::unique_lock<std::mutex>& lock, std::byte* whole,
                                    std::uint64_t shard_bytes) {
  std::byte* mine = whole + static_cast<std::uint64_t>(m_.core().dp_rank()) * shard_bytes;
  return dp_detail::run_collective(
      lock, m_.core().opt.comm->all_gather(mine, whole, shard_bytes / 4, comm::DType::kF32));
}

void CheckpointSource::abort_ranks(const std::string& why) {
  m_.core().opt.comm->abort(why);
}

Status CheckpointSource::open_nvme_store() {
  return m_.core().ensure_nvme_store();
}

HostStore& CheckpointSource::host_store() {
  return *m_.core().host;
}

void CheckpointSource::replace_slots(FamilyId f, StateKind k, std::vector<std::uint32_t> slots) {
  Chunk& c = m_.core().chunk_mut(f, k);
  m_.pipeline().drop_read_ahead(f);
  for (std::uint32_t old : c.nvme_slots) m_.core().nvme.free_slot(old);
  c.nvme_slots = std::move(slots);
  c.move_value(ChunkValue::kNvme);
}

void CheckpointSource::set_counters(TensorId t, std::int64_t steps, std::uint32_t group) {
  m_.core().restore_updates(t, steps);
  m_.core().assign_group(t, group);
}

void CheckpointSource::set_group(const checkpoint::GroupEntry& g) {
  m_.core().set_group(g.group, GroupHyper{.set = true, .lr = g.lr, .weight_decay = g.weight_decay});
}

// --- The public calls -------------------------------------------------------

Status Runtime::save_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  return m.checkpoints().save(lock, dir);
}

Status Runtime::begin_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  return m.checkpoints().begin(lock, dir);
}

Status Runtime::finish_checkpoint() {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  return m.checkpoints().finish(lock);
}

Result<bool> Runtime::checkpoint_in_flight() {
  Impl& m = *impl_;
  std::lock_guard lock(m.core().mu);
  return m.checkpoints().in_flight();
}

Status Runtime::load_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  return m.checkpoints().load(lock, dir);
}

}  // namespace strata::runtime
