// Runtime: a tensor's state between steps — initial values, reads and writes of
// any state kind (a checkpoint's save and load), step counters and parameter
// groups (Note [Parameter groups] in runtime.hpp).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "pipeline/q8_states.hpp"
#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"

namespace strata::runtime {
namespace {

void store_values(std::byte* p, DType dtype, std::span<const float> values) {
  if (dtype == DType::kF32) {
    std::memcpy(p, values.data(), values.size() * 4);
    return;
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint16_t h =
        dtype == DType::kBF16 ? kernels::float_to_bf16(values[i]) : kernels::float_to_f16(values[i]);
    std::memcpy(p + 2 * i, &h, 2);
  }
}

void load_values(const std::byte* p, DType dtype, std::span<float> out) {
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), p, out.size() * 4);
    return;
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    out[i] = dtype == DType::kBF16 ? kernels::bf16_to_float(h) : kernels::f16_to_float(h);
  }
}

//! The map of a q8 state kind's codes: m (state0) signed, v (state1) unsigned.
kernels::Q8Map q8_map_of(StateKind kind) {
  return q8_map_of_state(static_cast<std::uint32_t>(kind) - static_cast<std::uint32_t>(StateKind::kState0));
}

//! The checks every between-steps state call makes: a registered id, `count`
//! values for its elements, no lease held. `what` names the call in the message.
Status check_state_call(const Runtime::Impl& m, TensorId tensor, std::size_t count, std::string_view what,
                        bool leases_allowed = false) {
  if (tensor >= m.core().tensors().size())
    return invalid_argument("{}: tensor id {} is not registered", what, tensor);
  const TensorInfo& info = m.core().tensors()[tensor];
  if (count != info.numel) {
    return invalid_argument("{}(\"{}\"): {} values for {} elements", what, info.spec.name, count, info.numel);
  }
  if (m.book().leases_out > 0 && !leases_allowed)
    return failed_precondition("{}(\"{}\") while leases are held", what, info.spec.name);
  return Status::Ok();
}

//! init_tensors' values for family f's tensors tensors[i] (i in `at`): the param and,
//! where the family has one, this rank's shard of the fp32 master (Note [Sharded
//! step]). Written whole, without a read first, when `at` covers every tensor of
//! the family once: the padding is zeros, as it was.
Status init_family(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, FamilyId f,
                   std::span<const std::size_t> at, std::span<const TensorId> tensors,
                   std::span<const std::span<const float>> values) {
  const FamilyLayout& fl = m.core().layout().families[f];
  std::vector<TensorId> ids;
  for (std::size_t i : at) ids.push_back(tensors[i]);
  std::sort(ids.begin(), ids.end());
  std::vector<TensorId> all(fl.tensors.begin(), fl.tensors.end());
  std::sort(all.begin(), all.end());
  const bool whole = ids == all;
  const DType cdt = m.core().opt.compute_dtype;
  STRATA_RETURN_IF_ERROR(m.with_host_copy(
      lock, f, StateKind::kParam, true,
      [&](std::byte* base) {
        for (std::size_t i : at) {
          const TensorSlot& ts = m.core().layout().slots[tensors[i]];
          store_values(base + ts.offset_elems * dtype_bytes(cdt), cdt, values[i]);
        }
      },
      whole));
  // Frozen tensors get their master too (when their family has one), so reading
  // any tensor's master gives its fp32 value.
  if (!m.core().separate_master || m.core().chunk(f, StateKind::kMaster).bytes == 0) return Status::Ok();
  return m.with_host_copy(
      lock, f, StateKind::kMaster, true,
      [&](std::byte* base) {
        for (std::size_t i : at) {
          const Core::ShardPart part = m.core().shard_part(tensors[i]);
          if (part.count > 0) std::memcpy(base + part.at * 4, values[i].data() + part.first, part.count * 4);
        }
      },
      whole);
}

}  // namespace

Status Runtime::init_tensor(TensorId tensor, std::span<const float> values) {
  return init_tensors(std::span<const TensorId>(&tensor, 1),
                      std::span<const std::span<const float>>(&values, 1));
}

Status Runtime::init_tensors(std::span<const TensorId> tensors,
                             std::span<const std::span<const float>> values) {
  Impl& m = *impl_;
  if (tensors.size() != values.size())
    return invalid_argument("init_tensors: {} tensors but {} value spans", tensors.size(), values.size());
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  for (std::size_t i = 0; i < tensors.size(); ++i)
    STRATA_RETURN_IF_ERROR(check_state_call(m, tensors[i], values[i].size(), "init_tensor"));
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  STRATA_RETURN_IF_ERROR(m.pipeline().wait_all(lock));
  STRATA_RETURN_IF_ERROR(m.checkpoints().wait_captured(lock, true));  // a save in flight reads the old values
  STRATA_RETURN_IF_ERROR(m.core().errors.take_prefetch());            // (once; nothing written)
  // The positions of each family's tensors in the call, families in first-seen order.
  std::vector<std::pair<FamilyId, std::vector<std::size_t>>> families;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const FamilyId f = m.core().layout().slots[tensors[i]].family;
    auto it = std::find_if(families.begin(), families.end(), [&](const auto& e) { return e.first == f; });
    if (it == families.end()) it = families.insert(families.end(), {f, {}});
    it->second.push_back(i);
  }
  for (const auto& [f, at] : families) STRATA_RETURN_IF_ERROR(init_family(m, lock, f, at, tensors, values));
  return Status::Ok();
}

Status Runtime::read_tensor(TensorId tensor, StateKind kind, std::span<float> out) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  // A read needs no lease released but a write lease on what it reads: after an
  // exception in forward, the params still leased read their last good values
  // (Note [Failed steps]).
  STRATA_RETURN_IF_ERROR(check_state_call(m, tensor, out.size(), "read_tensor", true));
  const TensorInfo& info = m.core().tensors()[tensor];
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  // After a failed step the last good state must stay readable (to checkpoint
  // it), so a background error does not stop a read.
  m.pipeline().wait_all(lock).ignore();
  const TensorSlot& ts = m.core().layout().slots[tensor];
  if (kind == StateKind::kMaster && !m.core().separate_master)
    kind = StateKind::kParam;  // fp32: the param is the master
  const Chunk& c = m.core().chunk(ts.family, kind);
  if (c.bytes == 0) {
    return failed_precondition("read_tensor(\"{}\", {}): this tensor has no such state", info.spec.name,
                               state_kind_name(kind));
  }
  if (c.writers > 0) {
    return failed_precondition(
        "read_tensor(\"{}\", {}) while a write lease holds it; release that lease first", info.spec.name,
        state_kind_name(kind));
  }
  if (kind == StateKind::kGrad && c.absent()) {
    return failed_precondition("read_tensor(\"{}\", grad): no gradient is held (it is consumed by step())",
                               info.spec.name);
  }
  const DType dtype = m.core().kind_dtype(kind);
  if (is_optim_kind(kind)) {  // this rank's shard of it (Note [Sharded step])
    const Core::ShardPart part = m.core().shard_part(tensor);
    if (part.count == 0) return Status::Ok();
    if (dtype == DType::kQ8) {  // dequantized (Note [Q8 state chunks])
      return m.with_host_copy(lock, ts.family, kind, false, [&](std::byte* base) {
        const Q8Chunk q{.chunk = base, .chunk_elems = m.core().shard_elems(ts.family)};
        kernels::q8_dequantize(q.codes(part.at), q.scales(part.at), q8_map_of(kind),
                               out.subspan(part.first, part.count));
      });
    }
    return m.with_host_copy(lock, ts.family, kind, false, [&](std::byte* base) {
      load_values(base + part.at * dtype_bytes(dtype), dtype, out.subspan(part.first, part.count));
    });
  }
  return m.with_host_copy(lock, ts.family, kind, false, [&](std::byte* base) {
    load_values(base + ts.offset_elems * dtype_bytes(dtype), dtype, out);
  });
}

Status Runtime::write_tensor(TensorId tensor, StateKind kind, std::span<const float> values) {
  if (kind == StateKind::kParam) return init_tensor(tensor, values);
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  STRATA_RETURN_IF_ERROR(check_state_call(m, tensor, values.size(), "write_tensor"));
  const TensorInfo& info = m.core().tensors()[tensor];
  if (kind == StateKind::kGrad) {
    return failed_precondition("write_tensor(\"{}\", grad): gradients are written through leases",
                               info.spec.name);
  }
  STRATA_RETURN_IF_ERROR(m.finalize(lock));
  STRATA_RETURN_IF_ERROR(m.pipeline().wait_all(lock));
  STRATA_RETURN_IF_ERROR(m.checkpoints().wait_captured(lock, true));  // a save in flight reads the old values
  const TensorSlot& ts = m.core().layout().slots[tensor];
  if (kind == StateKind::kMaster && !m.core().separate_master) {
    // fp32 compute: the param is the master.
    lock.unlock();
    return init_tensor(tensor, values);
  }
  const Chunk& c = m.core().chunk(ts.family, kind);
  if (c.bytes == 0 || info.spec.frozen) {
    return failed_precondition("write_tensor(\"{}\", {}): this tensor has no such state ({})", info.spec.name,
                               state_kind_name(kind),
                               info.spec.frozen ? "it is frozen" : "the optimizer keeps none");
  }
  const DType dtype = m.core().kind_dtype(kind);
  const Core::ShardPart part = m.core().shard_part(tensor);  // this rank's shard (Note [Sharded step])
  if (part.count == 0) return Status::Ok();
  if (dtype == DType::kQ8) {  // quantized, the tensor's blocks alone (Note [Q8 state chunks])
    std::vector<std::uint8_t> codes(part.count);
    std::vector<float> scales(kernels::q8_blocks(part.count));
    Status quantized = kernels::q8_quantize(values.subspan(part.first, part.count), q8_map_of(kind),
                                            codes.data(), scales.data());
    if (!quantized.ok()) {
      return quantized.with_context(
          fmt::format("write_tensor(\"{}\", {})", info.spec.name, state_kind_name(kind)));
    }
    return m.with_host_copy(lock, ts.family, kind, true, [&](std::byte* base) {
      const Q8Chunk q{.chunk = base, .chunk_elems = m.core().shard_elems(ts.family)};
      std::memcpy(q.codes(part.at), codes.data(), codes.size());
      std::memcpy(q.scales(part.at), scales.data(), scales.size() * 4);
    });
  }
  return m.with_host_copy(lock, ts.family, kind, true, [&](std::byte* base) {
    store_values(base + part.at * dtype_bytes(dtype), dtype, values.subspan(part.first, part.count));
  });
}

Result<Runtime::StateRange> Runtime::state_range(TensorId tensor) const {
  Impl& m = *impl_;
  std::lock_guard lock(m.core().mu);
  if (tensor >= m.core().tensors().size())
    return invalid_argument("state_range: tensor id {} is not registered", tensor);
  if (!m.core().finalized()) {
    return failed_precondition(
        "state_range(\"{}\"): the layout is fixed at the first acquire/init/step; call it after",
        m.core().tensors()[tensor].spec.name);
  }
  const Core::ShardPart part = m.core().shard_part(tensor);
  return StateRange{.first = part.first, .count = part.count};
}

Result<std::int64_t> Runtime::tensor_steps(TensorId tensor) const {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  if (tensor >= m.core().tensors().size())
    return invalid_argument("tensor_steps: tensor id {} is not registered", tensor);
  // The last step's updates carried into this forward count once they ran (Note [Deferred updates]).
  if (m.pipeline().carried() > 0) {
    const FamilyId f = m.core().layout().slots[tensor].family;
    m.core().cv.wait(lock, [&] { return !m.pipeline().updating(f) || !m.core().errors.background().ok(); });
  }
  return m.core().tensors()[tensor].updates;
}

Status Runtime::set_tensor_steps(TensorId tensor, std::int64_t steps) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (tensor >= m.core().tensors().size())
    return invalid_argument("set_tensor_steps: tensor id {} is not registered", tensor);
  if (steps < 0 || steps >= (std::int64_t{1} << 47)) {
    return invalid_argument("set_tensor_steps(\"{}\", {}): a step counter is in [0, 2^47)",
                            m.core().tensors()[tensor].spec.name, steps);
  }
  if (m.book().leases_out > 0)
    return failed_precondition("set_tensor_steps(\"{}\") while leases are held",
                               m.core().tensors()[tensor].spec.name);
  STRATA_RETURN_IF_ERROR(m.pipeline().wait_step_work(lock));
  m.core().restore_updates(tensor, steps);
  return Status::Ok();
}

Status Runtime::set_tensor_group(TensorId tensor, std::uint32_t group) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (tensor >= m.core().tensors().size())
    return invalid_argument("set_tensor_group: tensor id {} is not registered", tensor);
  if (group >= 65536) {
    return invalid_argument("set_tensor_group(\"{}\", {}): group ids are below 65536",
                            m.core().tensors()[tensor].spec.name, group);
  }
  if (m.book().leases_out > 0 || m.pipeline().busy_this_step()) {
    return failed_precondition(
        "set_tensor_group(\"{}\"): only between steps (leases or optimizer steps in flight)",
        m.core().tensors()[tensor].spec.name);
  }
  // The last step's updates carried into this forward keep its groups (Note [Deferred updates]).
  STRATA_RETURN_IF_ERROR(m.pipeline().wait_step_work(lock));
  m.core().assign_group(tensor, group);
  return Status::Ok();
}

Status Runtime::add_to_working_set(TensorId tensor, std::uint32_t set) {
  Core& core = impl_->core();
  std::lock_guard lock(core.mu);  // (no chunk or lease state changes: nothing to check after)
  if (tensor >= core.tensors().size())
    return invalid_argument("add_to_working_set: tensor id {} is not registered", tensor);
  core.working_sets.emplace_back(set, tensor);  // the next plan counts it (Note [Working sets])
  return Status::Ok();
}

Status Runtime::set_group_hyper(std::uint32_t group, float lr, float weight_decay) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core().mu);
  InvariantCheck check(m, &lock);
  if (group >= 65536) return invalid_argument("set_group_hyper: group {} (group ids are below 65536)", group);
  if (!std::isfinite(lr) || lr < 0.0f || !std::isfinite(weight_decay) || weight_decay < 0.0f) {
    return invalid_argument(
        "set_group_hyper(group {}): lr = {} and weight_decay = {} must be finite and >= 0", group, lr,
        weight_decay);
  }
  // (The last step's updates carried into this forward took its values: Note [Deferred updates].)
  if (m.pipeline().busy_this_step()) {
    return failed_precondition(
        "set_group_hyper(group {}): an optimizer step is running; set lr and weight decay between step() "
        "and backward (Note [Parameter groups])",
        group);
  }
  m.core().set_group(group, GroupHyper{.set = true, .lr = lr, .weight_decay = weight_decay});
  return Status::Ok();
}

Status Runtime::wait(const Lease& lease) {
  Impl& m = *impl_;
  if (!lease.valid()) return invalid_argument("wait: the lease is empty or released");
  if (lease.where_ == Where::kHost) return Status::Ok();  // host leases are ready when acquire returns
  memory::Event* ready = nullptr;
  {
    std::lock_guard lock(m.core().mu);
    InvariantCheck check(m);
    const Chunk& c = m.core().chunks().at(lease.chunk_);
    STRATA_CHECK(c.device_slot >= 0);  // a leased chunk keeps its slot
    ready = &m.residency().slot_of(c).ready;
  }
  // Slots are rebuilt only in step(), which needs every lease released, so the
  // event outlives this wait.
  const double t0 = m.core().timeline.now_us();
  Status st = m.core().device.synchronize(*ready);
  m.core().timeline.add_stall((m.core().timeline.now_us() - t0) * 1e-6);
  return st;
}

}  // namespace strata::runtime
