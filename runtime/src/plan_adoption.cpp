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

// Note [A re-plan refused keeps the plan]
// The plan adopted at the first use is made from the registration order; the one
// after the warm-up step from the traced order, which may send other families to
// NVMe: larger ones, needing more whole slots than the budget holds (found by
// strata-contract: 3.00 MiB of NVMe against a 2.90 MiB budget the first plan fit).
// A plan the runtime accepted is a promise that training runs, and the step just
// traced ran within the current plan. So when the budgets refuse the re-plan, the
// current plan stays: a warning says what the re-plan needed and which budget lets
// the planner follow the traced order. Not when the current plan lacks a room the
// step showed (micro-batches undeclared and unplanned: step.cpp's `uncounted`), where
// the refusal stands. Later steps try again (the trace may change); the warning is
// logged once per refusal run.
void Runtime::Impl::keep_plan(const Status& refused) {
  if (book_.replans_refused++ == 0) {
    STRATA_LOG_WARN(
        "runtime: the plan from the traced step is refused by the budgets, so the current plan (which this "
        "step trained within) stays, and its placement follows the registration order (Note [A re-plan "
        "refused keeps the plan]): {}",
        refused.message());
  }
}

Status Runtime::Impl::adopt_plan(std::unique_lock<std::mutex>& lock, StepTrace trace, bool may_keep) {
  PlanInput in{.families = {core().chunks().family_bytes().begin(), core().chunks().family_bytes().end()},
               .trace = trace,
               .budgets = core().opt.budgets,
               .options = core().opt.plan,
               .slot_bytes = core().layout().chunk_elems * dtype_bytes(core().opt.compute_dtype),
               .working_set_families = core().working_set_families()};
  // Note [Chunk budget]
  // The runtime's budgets.gpu_bytes is a budget for chunks alone: the device slots
  // (streaming and resident params, gradients, optimizer states on the GPU). The
  // caller's activations and workspaces live outside the runtime's allocator, so
  // the caller sizes gpu_bytes to leave room for them; the traced non-chunk peak
  // (which the planner subtracts when it plans a whole device, as strata-probe does)
  // is zeroed here so those bytes are not counted twice.
  in.trace.non_chunk_peak_bytes = 0;
  // What the plan counts host room for (Note [Host room] in planner.cpp).
  in.deferred_step = core().deferred();
  if (core().accumulation_seen)
    in.options.micro_batches = std::max<std::uint32_t>(in.options.micro_batches, 2);
  const kernels::Optimizer o = core().opt.hyper.optimizer;
  if (core().opt.state_dtype == DType::kQ8 && memory::device_caps(core().device).optimizer_kernels &&
      in.options.allow_gpu_optimizer) {
    // No CUDA q8 kernel yet: the states stay on host and NVMe (Note [Q8 state chunks]).
    in.options.allow_gpu_optimizer = false;
    if (!core().finalized()) {
      STRATA_LOG_INFO(
          "runtime: q8 optimizer states stay on host and NVMe, where the CPU kernel updates them: the CUDA "
          "optimizer has no 8-bit kernel yet");
    }
  }
  if (!gpu_optimizer_supported(core().device.kind(), o) && in.options.allow_gpu_optimizer) {
    // kernels::cuda_step_enqueue runs without the host; lamb, lars and came need it between phases.
    in.options.allow_gpu_optimizer = false;
    if (!core().finalized()) {
      STRATA_LOG_INFO(
          "runtime: {} steps run on the CPU: on a CUDA device only optimizers without a host "
          "phase (not lamb, lars, came) run on the GPU",
          kernels::optimizer_name(o));
    }
  }
  const bool first = !core().finalized();
  Result<Plan> made = make_plan(in);
  if (!made.ok()) {
    if (first || !may_keep || made.status().code() != StatusCode::kOutOfBudget) return made.status();
    keep_plan(made.status());
    return Status::Ok();
  }
  Plan p = *std::move(made);
  book_.replans_refused = 0;
  if (p.nvme_bytes > 0) STRATA_RETURN_IF_ERROR(core().ensure_nvme_store(p.nvme_bytes));
  if (first) {
    // Homes start where the plan puts them: nothing to migrate.
  } else {
    STRATA_CHECK(p.all_gpu == core().plan().all_gpu);   // sizes do not change between plans
    STRATA_RETURN_IF_ERROR(pipeline().wait_all(lock));  // write-backs end before homes move
    STRATA_RETURN_IF_ERROR(migrate_homes(lock, p));
  }
  if (first || !p.all_gpu) STRATA_RETURN_IF_ERROR(residency().build_slots(p));
  residency().adopt(p);
  core().adopt_plan(std::move(p), in.options.micro_batches > 1);
  pipeline().adopt(trace);
  tracker().adopt(std::move(trace), core().layout().families.size());
  STRATA_LOG_INFO("runtime: plan ({}): {}", first ? "from registration order" : "from the traced step",
                  core().plan().summary());
  return Status::Ok();
}

// Note [Migration order]
// A re-plan moves some chunks to NVMe and others off it. Both plans fit the budgets,
// but the way between them need not: moved in family order, a chunk written to NVMe
// before another is read back holds slots the old plan and the new one each count
// once (found by strata-contract: the NVMe tier full at step 1 with 36 planned slots
// of 37); read back first, a chunk takes host room before another frees it. So each
// pass makes every move whose destination has room now within the larger of the two
// plans (the promise the contract checks: no tier above its plan), and the next pass
// retries the rest: the chunks read off NVMe free slots for the ones written to it,
// and those free host room for the reads. Where no move has room within the plans,
// one move is made within the budgets alone (the stores refuse past them), and the
// passes go on. A move that finds no room changes nothing. A pass in which nothing
// moves ends the migration with the last refusal: never reached while both plans fit,
// since the copy-on-write room and the pipeline's staging, idle between steps, are in
// both.
Status Runtime::Impl::migrate_homes(std::unique_lock<std::mutex>& lock, const Plan& p) {
  struct Move {
    FamilyId family;
    StateKind kind;
    Tier to;
  };
  std::vector<Move> moves;
  for (FamilyId f = 0; f < p.families.size(); ++f) {
    for (StateKind k : {StateKind::kParam, StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      const bool param = k == StateKind::kParam;
      const Tier from = param ? core().plan().families[f].param_home : core().plan().families[f].optim_home;
      const Tier to = param ? p.families[f].param_home : p.families[f].optim_home;
      if (from == to || (to != Tier::kNvme && from != Tier::kNvme)) continue;
      if (core().chunk(f, k).bytes == 0) continue;
      moves.push_back({f, k, to});
    }
  }
  const std::uint64_t host_limit = std::max(p.host_bytes, core().plan().host_bytes);
  const std::uint64_t nvme_limit = std::max(p.nvme_bytes, core().plan().nvme_bytes);
  const auto within_plans = [&](const Move& m) {
    const Chunk& c = core().chunk(m.family, m.kind);
    if (m.to != Tier::kNvme) return c.host != nullptr || core().host->used_bytes() + c.bytes <= host_limit;
    const std::uint64_t slot = core().nvme.store().slot_bytes();
    return c.absent() || core().nvme.store().used_bytes() + (c.bytes + slot - 1) / slot * slot <= nvme_limit;
  };
  bool strict = true;
  while (!moves.empty()) {
    Status refused;
    const std::size_t before = moves.size();
    for (auto it = moves.begin(); it != moves.end();) {
      if (strict && !within_plans(*it)) {
        ++it;
        continue;
      }
      const Status st =
          migrate_chunk(lock, core().chunk_mut(it->family, it->kind), it->kind == StateKind::kParam, it->to);
      if (!st.ok() && st.code() != StatusCode::kOutOfBudget) return st;
      if (!st.ok()) {
        refused = st;
        ++it;
        continue;
      }
      it = moves.erase(it);
      if (!strict) break;  // one move past the plans, then within them again
    }
    if (moves.size() < before) {
      strict = true;
    } else if (strict) {
      strict = false;
    } else {
      refused.with_context(fmt::format("re-plan: {} chunks could not move to their new homes", moves.size()));
      return refused;
    }
  }
  return Status::Ok();
}

Status Runtime::Impl::migrate_chunk(std::unique_lock<std::mutex>& lock, Chunk& c, bool param, Tier to) {
  if (param) {
    // Its staging copy goes; a clean device copy stays valid (Note [NVMe-homed params]).
    STRATA_RETURN_IF_ERROR(residency().drop_staging(lock, c));
    STRATA_RETURN_IF_ERROR(residency().wait_host_reads(c));
  }
  if (to == Tier::kNvme) {
    if (!c.absent()) {
      STRATA_RETURN_IF_ERROR(residency().ensure_on_host(c));
      STRATA_RETURN_IF_ERROR(core().nvme_transfer(lock, true, {c.host, c.bytes}, c.nvme_slots));
      c.move_value(ChunkValue::kNvme);
    }
    if (c.host != nullptr) core().host->free(c.host, c.bytes);
    c.host = nullptr;
    return Status::Ok();
  }
  if (c.value == ChunkValue::kNvme) {  // (from NVMe)
    STRATA_ASSIGN_OR_RETURN(std::byte * buffer, core().host_buffer(c));
    STRATA_RETURN_IF_ERROR(core().nvme_transfer(lock, false, {buffer, c.bytes}, c.nvme_slots));
    for (std::uint32_t s : c.nvme_slots) core().nvme.free_slot(s);
    c.nvme_slots.clear();
    c.move_value(ChunkValue::kHost);
  } else if (param && c.absent()) {
    // A host-homed param always has its home copy (zeros until init_tensor).
    STRATA_ASSIGN_OR_RETURN(std::byte * buffer, core().host_buffer(c));
    std::memset(buffer, 0, c.bytes);
    c.move_value(ChunkValue::kHost);
  }
  return Status::Ok();
}

}  // namespace strata::runtime
