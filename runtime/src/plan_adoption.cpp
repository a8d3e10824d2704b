// Runtime::Impl: adopting a plan (planner.cpp makes it) — moving optimizer
// states whose home changes, rebuilding the device slots, and making the
// tracker and the pipeline follow the new trace.
#include <algorithm>
#include <cstring>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_caps.hpp"

namespace strata::runtime {

StepTrace registration_trace(std::size_t families) {
  StepTrace trace;
  for (std::size_t f = 0; f < families; ++f) {
    trace.uses.push_back({.family = static_cast<FamilyId>(f), .phase = Phase::kForward});
  }
  for (std::size_t f = families; f-- > 0;) {
    trace.uses.push_back(
        {.family = static_cast<FamilyId>(f), .phase = Phase::kBackward, .writes_grad = true});
  }
  return trace;
}

bool gpu_optimizer_supported(memory::DeviceKind kind, kernels::Optimizer o) {
  if (memory::device_caps(kind).layerwise_optimizers) return true;
  return o != kernels::Optimizer::kLamb && o != kernels::Optimizer::kLars && o != kernels::Optimizer::kCame;
}

Status Runtime::Impl::adopt_plan(std::unique_lock<std::mutex>& lock, StepTrace trace) {
  PlanInput in{.families = {core.chunks.family_bytes().begin(), core.chunks.family_bytes().end()},
               .trace = trace,
               .budgets = core.opt.budgets,
               .options = core.opt.plan,
               .slot_bytes = core.layout().chunk_elems * dtype_bytes(core.opt.compute_dtype)};
  // Note [Chunk budget]
  // The runtime's budgets.gpu_bytes is a budget for chunks alone: the device slots
  // (streaming and resident params, gradients, optimizer states on the GPU). The
  // caller's activations and workspaces live outside the runtime's allocator, so
  // the caller sizes gpu_bytes to leave room for them; the traced non-chunk peak
  // (which the planner subtracts when it plans a whole device, as strata-probe does)
  // is zeroed here so those bytes are not counted twice.
  in.trace.non_chunk_peak_bytes = 0;
  // What the plan counts host room for (Note [Host room] in planner.cpp).
  in.deferred_step = core.deferred();
  if (core.accumulation_seen) in.options.micro_batches = std::max<std::uint32_t>(in.options.micro_batches, 2);
  const kernels::Optimizer o = core.opt.hyper.optimizer;
  if (!gpu_optimizer_supported(core.device.kind(), o) && in.options.allow_gpu_optimizer) {
    // kernels::cuda_step_enqueue runs without the host; lamb, lars and came need it between phases.
    in.options.allow_gpu_optimizer = false;
    if (!core.finalized()) {
      STRATA_LOG_INFO(
          "runtime: {} steps run on the CPU: on a CUDA device only optimizers without a host "
          "phase (not lamb, lars, came) run on the GPU",
          kernels::optimizer_name(o));
    }
  }
  const bool first = !core.finalized();
  STRATA_ASSIGN_OR_RETURN(Plan p, make_plan(in));
  if (p.nvme_bytes > 0) STRATA_RETURN_IF_ERROR(core.ensure_nvme_store(p.nvme_bytes));
  if (first) {
    // Homes start where the plan puts them: nothing to migrate.
  } else {
    STRATA_CHECK(p.all_gpu == core.plan().all_gpu);   // sizes do not change between plans
    STRATA_RETURN_IF_ERROR(pipeline.wait_all(lock));  // write-backs end before homes move
    STRATA_RETURN_IF_ERROR(migrate_homes(lock, p));
  }
  if (first || !p.all_gpu) STRATA_RETURN_IF_ERROR(residency.build_slots(p));
  residency.adopt(p);
  core.adopt_plan(std::move(p), in.options.micro_batches > 1);
  pipeline.adopt(trace);
  tracker.adopt(std::move(trace), core.layout().families.size());
  STRATA_LOG_INFO("runtime: plan ({}): {}", first ? "from registration order" : "from the traced step",
                  core.plan().summary());
  return Status::Ok();
}

Status Runtime::Impl::migrate_homes(std::unique_lock<std::mutex>& lock, const Plan& p) {
  for (FamilyId f = 0; f < p.families.size(); ++f) {
    for (StateKind k : {StateKind::kParam, StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      const bool param = k == StateKind::kParam;
      const Tier from = param ? core.plan().families[f].param_home : core.plan().families[f].optim_home;
      const Tier to = param ? p.families[f].param_home : p.families[f].optim_home;
      if (from == to || (to != Tier::kNvme && from != Tier::kNvme)) continue;
      Chunk& c = core.chunk(f, k);
      if (c.bytes == 0) continue;
      if (param) {
        // Its staging copy goes; a clean device copy stays valid (Note [NVMe-homed params]).
        STRATA_RETURN_IF_ERROR(residency.drop_staging(lock, c));
        STRATA_RETURN_IF_ERROR(residency.wait_host_reads(c));
      }
      if (to == Tier::kNvme) {
        if (!c.absent()) {
          STRATA_RETURN_IF_ERROR(residency.ensure_on_host(c));
          STRATA_RETURN_IF_ERROR(core.nvme_transfer(lock, true, {c.host, c.bytes}, c.nvme_slots));
          c.move_value(ChunkValue::kNvme);
        }
        if (c.host != nullptr) core.host->free(c.host, c.bytes);
        c.host = nullptr;
      } else if (from == Tier::kNvme) {
        if (c.value == ChunkValue::kNvme) {
          STRATA_ASSIGN_OR_RETURN(std::byte * buffer, core.host_buffer(c));
          STRATA_RETURN_IF_ERROR(core.nvme_transfer(lock, false, {buffer, c.bytes}, c.nvme_slots));
          for (std::uint32_t s : c.nvme_slots) core.nvme.free_slot(s);
          c.nvme_slots.clear();
          c.move_value(ChunkValue::kHost);
        } else if (param && c.absent()) {
          // A host-homed param always has its home copy (zeros until init_tensor).
          STRATA_ASSIGN_OR_RETURN(std::byte * buffer, core.host_buffer(c));
          std::memset(buffer, 0, c.bytes);
          c.move_value(ChunkValue::kHost);
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace strata::runtime
