#include "strata/runtime/planner.hpp"

#include <algorithm>
#include <numeric>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

namespace strata::runtime {
namespace {

Status budget_error(std::string_view budget, std::uint64_t have, std::uint64_t need, std::string_view what) {
  return out_of_budget("{} budget is {} but {} needs {}; raise {} (or shrink the chunk size / the model)",
                       budget, format_bytes(have), what, format_bytes(need), budget);
}

}  // namespace

std::string_view tier_name(Tier tier) {
  switch (tier) {
    case Tier::kGpu:
      return "gpu";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "unknown";
}

std::string Plan::summary() const {
  std::size_t optim[3] = {0, 0, 0};
  std::size_t param[3] = {0, 0, 0};
  std::size_t resident = 0;
  for (const FamilyPlan& f : families) {
    ++optim[static_cast<int>(f.optim_home)];
    ++param[static_cast<int>(f.param_home)];
    resident += f.param_resident_gpu ? 1 : 0;
  }
  const std::string deferred =
      deferred_update_families > 0
          ? fmt::format(", {} updates deferred into the next forward", deferred_update_families)
          : std::string();
  return fmt::format(
      "{} families; {}; params home gpu/host/nvme = {}/{}/{} ({} resident on GPU); optimizer states "
      "gpu/host/nvme = {}/{}/{}; {} GPU chunk slots, prefetch depth {}{}; planned bytes gpu {} host {} nvme "
      "{}",
      families.size(), all_gpu ? "everything on the GPU" : "streaming", param[0], param[1], param[2],
      resident, optim[0], optim[1], optim[2], gpu_cache_slots, prefetch_depth, deferred,
      format_bytes(gpu_bytes), format_bytes(host_bytes), format_bytes(nvme_bytes));
}

std::uint64_t nvme_slot_bytes(std::uint64_t largest_chunk_bytes) {
  return std::min<std::uint64_t>(align_up(std::max<std::uint64_t>(largest_chunk_bytes, 1), 4096), 64 * kMiB);
}

std::uint64_t nvme_chunk_bytes(std::uint64_t chunk_bytes, std::uint64_t slot_bytes) {
  return (chunk_bytes + slot_bytes - 1) / slot_bytes * slot_bytes;
}

namespace {

// What make_plan needs to know about the families' sizes.
struct Extents {
  std::uint64_t all_bytes = 0;   // every chunk of every family
  std::uint64_t slot_bytes = 0;  // a streaming device slot (fits any param or grad chunk)
  std::uint64_t grad_max = 0, optim_max = 0, param_max = 0;
  std::uint64_t params_total = 0, optim_total = 0, grad_total = 0;
};

Extents measure(const PlanInput& in) {
  Extents e{.slot_bytes = in.slot_bytes};
  for (const FamilyBytes& f : in.families) {
    e.all_bytes += f.param_bytes + f.grad_bytes + f.optim_bytes;
    e.slot_bytes = std::max({e.slot_bytes, f.param_bytes, f.grad_bytes});
    e.grad_max = std::max(e.grad_max, f.grad_bytes);
    e.optim_max = std::max(e.optim_max, f.optim_bytes);
    e.param_max = std::max(e.param_max, f.param_bytes);
    e.params_total += f.param_bytes;
    e.optim_total += f.optim_bytes;
    e.grad_total += f.grad_bytes;
  }
  return e;
}

// 2. GPU streaming slots, then spare GPU bytes keep params resident.
Status place_on_gpu(const PlanInput& in, const Extents& e, std::uint64_t gpu_avail, Plan& plan) {
  const PlanOptions& opt = in.options;
  const Budgets& budget = in.budgets;
  const std::uint64_t non_chunk = in.trace.non_chunk_peak_bytes;
  // Current param + current grad + the next param; a working set of tensors leased
  // together over k families (Note [Working sets] in runtime/src/core/core.cpp) holds k
  // slots while its gradient takes one more.
  const std::uint64_t kSlotsMin = std::max<std::uint64_t>(3, std::uint64_t{in.working_set_families} + 1);
  if (gpu_avail < kSlotsMin * e.slot_bytes) {
    return budget_error(
        "gpu_budget", budget.gpu_bytes, non_chunk + kSlotsMin * e.slot_bytes,
        fmt::format("the smallest working set ({} chunk slots of {}{} + non-chunk peak {})", kSlotsMin,
                    format_bytes(e.slot_bytes),
                    kSlotsMin > 3 ? fmt::format(": tensors leased together span {} families, and a gradient",
                                                in.working_set_families)
                                  : "",
                    format_bytes(non_chunk)));
  }
  const std::uint64_t slots_fit = gpu_avail / e.slot_bytes;
  const std::uint64_t slots_wanted = 2 + 2 * std::uint64_t{opt.prefetch_depth_max};
  plan.gpu_cache_slots = std::max(kSlotsMin, std::min(slots_fit, slots_wanted));
  plan.prefetch_depth = opt.prefetch ? static_cast<std::uint32_t>(std::min<std::uint64_t>(
                                           opt.prefetch_depth_max, plan.gpu_cache_slots - 2))
                                     : 0;
  std::uint64_t gpu_spare = gpu_avail - plan.gpu_cache_slots * e.slot_bytes;
  for (std::size_t i = 0; i < in.families.size(); ++i) {
    if (in.families[i].param_bytes <= gpu_spare) {
      plan.families[i].param_resident_gpu = true;
      gpu_spare -= in.families[i].param_bytes;
    }
  }
  plan.gpu_bytes = budget.gpu_bytes - gpu_spare;
  return Status::Ok();
}

// Host and NVMe bytes as make_plan places homes.
struct Usage {
  std::uint64_t host = 0, nvme = 0;
  bool optim_staging_reserved = false;
};

// Note [All-GPU host copies]
// A plan that keeps every chunk on the GPU still takes host memory: the params'
// home copies (finalize), init_tensor's fp32 master, the first optimizer step's
// zero states, the gradients a deferred step (clipping, loss scaling, data
// parallelism) checks on host, and read_tensor / state_dict's copies of GPU chunks,
// each of which may stay until the runtime closes. Until those go through bounded
// staging, the plan counts a host copy of every chunk (params, gradients, masters
// and states) plus the reserve, and takes the all-GPU placement only when the host
// budget holds that; a smaller host budget gets the streaming placement, which
// counts its own rooms (Note [Host room]). Found by strata-contract (#24).

//! The host cannot hold the params and optimizer states beside `room` (the gradient landing
//! slots, host copies and reserve) and budgets.nvme is 0, so nothing can spill.
Status no_nvme_tier(std::uint64_t host, std::uint64_t params, std::uint64_t states, std::uint64_t room) {
  return out_of_budget(
      "host_budget {} cannot hold the params ({}) and the optimizer states ({}) on top of {} for gradient "
      "landing slots, gradient host copies and the reserve (Note [Host room]), and there is no NVMe tier to "
      "spill to (budgets.nvme is 0); raise host_budget, or give budgets.nvme and nvme.dirs",
      format_bytes(host), format_bytes(params), format_bytes(states), format_bytes(room));
}

// Updates deferred into the next forward (Note [Deferred updates] in
// runtime/src/pipeline/deferred_updates.cpp): none when the optimizers wait for step().
std::uint32_t deferred_updates(const PlanInput& in) {
  return in.deferred_step ? 0 : in.options.deferred_updates;
}

// The NVMe pipeline's host room: per family in flight its states and the param
// updated beside them, and per deferred update its gradient, held across step().
std::uint64_t nvme_pipeline_room(const PlanInput& in, const Extents& e) {
  return std::uint64_t{in.options.nvme_families_in_flight} * (e.optim_max + e.param_max) +
         std::uint64_t{deferred_updates(in)} * e.grad_max;
}

// How a refusal names the deferred updates' room ("" when there are none).
std::string deferred_room_words(const PlanInput& in, const Extents& e) {
  const std::uint32_t k = deferred_updates(in);
  if (k == 0) return "";
  return fmt::format(" + {} deferred updates' gradients x {} (plan.deferred_updates: lower it)", k,
                     format_bytes(e.grad_max));
}

// 3. Host: the rooms of Note [Host room] first, then param homes.
//
// Note [Host room]
// The plan's host_bytes bounds everything the runtime takes from the host store at
// once, so a plan it accepts never runs out of host memory (Note [Backpressure] in
// residency.cpp says how the runtime stays inside each room):
//  - grad staging: grad_staging_slots x the largest gradient chunk (a family's
//    gradient lands in one from its d2h copy until its CPU kernel has read it);
//  - gradient host copies (Plan::grad_host_bytes): a gradient written back from the
//    device before its optimizer consumes it. When the optimizers run only at step()
//    (loss scaling, clipping, data parallelism: PlanInput::deferred_step) every
//    gradient comes to host first, and with micro-batches (PlanOptions::micro_batches
//    > 1) every gradient may be written back between micro-batches and wait there for
//    the last one: room for all of them. Otherwise one gradient per streaming slot (an
//    eviction takes a dirty gradient out of a slot), at most all; an eviction that
//    finds the room full waits for the optimizer pipeline to consume one. A copy is
//    the room's only while it is the gradient's value: one written back while its
//    family was incomplete and loaded again for a later piece is stale once the
//    gradient lands in staging, and is freed then (Residency::
//    drop_stale_host_copy). Kept, it held this room beside the staging copy; a
//    deferred update's family (parked across step(), its gradient in its own room
//    below) held it into the next forward, and with as many parked as this room
//    holds, no write-back fit and nothing in flight could free one: OutOfBudget
//    mid-backward (#47: deferred updates, tensors unused on some steps or widened
//    families, whose gradients come in pieces, and states on NVMe);
//  - param homes and optimizer states kept on host;
//  - param staging (Note [NVMe param staging]) and the NVMe pipeline's staging (per
//    family in flight: its states and the param updated beside them; per deferred
//    update, PlanOptions::deferred_updates, its gradient held across step());
//  - one chunk's temporary host copy when anything lives on NVMe (read_tensor,
//    write_tensor, init_tensor and state_dict of an NVMe chunk, between steps);
//  - plan.host_reserve.
// A checkpoint save copies into its own memory (Note [Overlapped save]), and data
// parallelism reduces gradients in their host copies (counted by deferred_step).
Status place_params(const PlanInput& in, const Extents& e, Plan& plan, Usage& used) {
  const PlanOptions& opt = in.options;
  const Budgets& budget = in.budgets;
  const std::uint64_t grad_staging = std::uint64_t{opt.grad_staging_slots} * e.grad_max;
  const bool all_grads = in.deferred_step || opt.micro_batches > 1;
  plan.grad_host_bytes = all_grads ? e.grad_total : std::min(e.grad_total, plan.gpu_cache_slots * e.grad_max);
  used.host = grad_staging + plan.grad_host_bytes + opt.host_reserve_bytes;
  if (used.host > budget.host_bytes) {
    return budget_error("host_budget", budget.host_bytes, used.host,
                        fmt::format("the gradient landing slots, host copies of {} and the reserve",
                                    all_grads ? "every gradient (micro-batches, loss scaling, clipping or "
                                                "data parallelism hold them to the step)"
                                              : "one gradient per GPU streaming slot"));
  }
  // A temporary host copy of one NVMe chunk, when anything may go to NVMe (Note [Host room]).
  const bool all_fit = used.host + e.params_total + e.optim_total <= budget.host_bytes;
  if (!all_fit && budget.nvme_bytes > 0) used.host += std::max(e.param_max, e.optim_max);
  // Note [NVMe param staging]
  // When the params do not all fit, the ones that spill are read from NVMe into a
  // bounded pool of host staging buffers (prefetch depth + 2 of the largest param
  // chunk: the next uses, the current one and the one being loaded), and their
  // families' optimizer states go to NVMe with them, so the optimizer pipeline's
  // staging (states and the param updated beside them, per family in flight) is
  // needed too. Both are reserved before any home, so the budget can never be
  // exceeded by staging the plan did not count.
  // Params spill when they do not fit beside what the optimizer states need at
  // least: all of them, or the NVMe pipeline's staging when they go to NVMe.
  const std::uint64_t optim_staging = nvme_pipeline_room(in, e);
  const std::uint64_t with_params = used.host + e.params_total;
  const std::uint64_t optim_least =
      with_params + e.optim_total <= budget.host_bytes ? e.optim_total : optim_staging;
  const bool spill = opt.allow_nvme_params && with_params + optim_least > budget.host_bytes;
  // Without an NVMe tier nothing can spill: say so here, before any NVMe staging is counted.
  if (budget.nvme_bytes == 0 && with_params + e.optim_total > budget.host_bytes)
    return no_nvme_tier(budget.host_bytes, e.params_total, e.optim_total, used.host);
  if (spill) {
    const std::uint64_t param_buffers = std::uint64_t{plan.prefetch_depth} + 2;
    const std::uint64_t param_staging = param_buffers * e.param_max;
    if (used.host + param_staging + optim_staging > budget.host_bytes) {
      return out_of_budget(
          "host_budget {} is smaller than the staging NVMe-homed params need: {} = {} param staging buffers "
          "x "
          "{} + {} NVMe families in flight x {} (states and param){}, on top of {} for gradient landing "
          "slots, gradient host copies and the reserve (Note [Host room]); raise host_budget (or shrink the "
          "chunk size)",
          format_bytes(budget.host_bytes), format_bytes(param_staging + optim_staging), param_buffers,
          format_bytes(e.param_max), opt.nvme_families_in_flight, format_bytes(e.optim_max + e.param_max),
          deferred_room_words(in, e), format_bytes(used.host));
    }
    used.host += param_staging + optim_staging;
    used.optim_staging_reserved = true;
    plan.param_staging_buffers = static_cast<std::uint32_t>(param_buffers);
  }
  bool spilled = false;  // from the first param that does not fit on, the rest go to NVMe too
  for (std::size_t i = 0; i < in.families.size(); ++i) {
    const FamilyBytes& f = in.families[i];
    if (!spilled && (used.host + f.param_bytes <= budget.host_bytes || !opt.allow_nvme_params)) {
      plan.families[i].param_home = Tier::kHost;
      used.host += f.param_bytes;
    } else {
      spilled = true;
      plan.families[i].param_home = Tier::kNvme;
      used.nvme += f.param_nvme_bytes != 0 ? f.param_nvme_bytes : f.param_bytes;
    }
  }
  if (used.host > budget.host_bytes) {
    return budget_error("host_budget", budget.host_bytes, used.host,
                        "every param's home copy (plan.allow_nvme_params is off) with the gradient landing "
                        "slots, gradient host copies and the reserve (Note [Host room])");
  }
  return Status::Ok();
}

// 4. Optimizer states: host while it lasts, the rest on NVMe.
Status place_optimizer_states(const PlanInput& in, const Extents& e, Plan& plan, Usage& used) {
  const PlanOptions& opt = in.options;
  const Budgets& budget = in.budgets;
  const std::size_t n = in.families.size();
  bool params_on_nvme = false;
  for (const FamilyPlan& f : plan.families) params_on_nvme = params_on_nvme || f.param_home == Tier::kNvme;
  if (!params_on_nvme && used.host + e.optim_total <= budget.host_bytes) {
    used.host += e.optim_total;
    return Status::Ok();
  }
  // Some optimizer states go to NVMe: reserve the pipeline's staging first
  // (states, and the param updated beside them until they are written).
  plan.nvme_staging_families = opt.nvme_families_in_flight;
  plan.deferred_update_families = deferred_updates(in);
  if (!used.optim_staging_reserved) used.host += nvme_pipeline_room(in, e);
  if (used.host > budget.host_bytes) {
    return budget_error("host_budget", budget.host_bytes, used.host,
                        fmt::format("staging for {} NVMe optimizer families in flight{}",
                                    opt.nvme_families_in_flight, deferred_room_words(in, e)));
  }
  // Families completing last in backward stay on host (Note [Placement policy]).
  std::vector<long> done = last_backward_use(in.trace, n);
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return done[a] > done[b]; });
  std::uint64_t nvme_family_max = 0;
  for (std::size_t i : order) {
    const FamilyBytes& f = in.families[i];
    // An NVMe-homed param is updated where its states are: on NVMe's staging.
    const bool param_nvme = plan.families[i].param_home == Tier::kNvme;
    if (!param_nvme && used.host + f.optim_bytes <= budget.host_bytes) {
      plan.families[i].optim_home = Tier::kHost;
      used.host += f.optim_bytes;
    } else {
      plan.families[i].optim_home = Tier::kNvme;
      const std::uint64_t on_disk = f.optim_nvme_bytes != 0 ? f.optim_nvme_bytes : f.optim_bytes;
      used.nvme += on_disk;
      // Copy-on-write room: the states, and the param when it lives on NVMe too.
      const std::uint64_t param_on_disk =
          param_nvme ? (f.param_nvme_bytes != 0 ? f.param_nvme_bytes : f.param_bytes) : 0;
      nvme_family_max = std::max(nvme_family_max, on_disk + param_on_disk);
    }
  }
  // Fresh slots for the families being written (Note [Copy-on-write NVMe slots]),
  // and for one chunk written by write_tensor / init_tensor meanwhile (Core::nvme_transfer).
  used.nvme += std::uint64_t{opt.nvme_families_in_flight} * nvme_family_max;
  std::uint64_t chunk_on_disk = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const FamilyBytes& f = in.families[i];
    if (plan.families[i].param_home == Tier::kNvme)
      chunk_on_disk = std::max(chunk_on_disk, f.param_nvme_bytes != 0 ? f.param_nvme_bytes : f.param_bytes);
    if (plan.families[i].optim_home == Tier::kNvme)
      chunk_on_disk = std::max(chunk_on_disk, f.optim_nvme_bytes != 0 ? f.optim_nvme_bytes : f.optim_bytes);
  }
  used.nvme += chunk_on_disk;
  return Status::Ok();
}

Result<Plan> plan_once(const PlanInput& in) {
  const std::size_t n = in.families.size();
  if (n == 0) return invalid_argument("planner: no chunk families (register tensors before the first step)");
  const Budgets& budget = in.budgets;
  const Extents e = measure(in);
  const std::uint64_t non_chunk = in.trace.non_chunk_peak_bytes;
  if (non_chunk >= budget.gpu_bytes) {
    return budget_error("gpu_budget", budget.gpu_bytes, non_chunk + e.slot_bytes * 3,
                        "the traced non-chunk peak (activations, workspaces) plus 3 chunk slots");
  }
  const std::uint64_t gpu_avail = budget.gpu_bytes - non_chunk;

  Plan plan;
  plan.families.assign(n, FamilyPlan{});

  // 1. Everything on the GPU, when the host holds a copy of every chunk too
  // (Note [All-GPU host copies]); otherwise the streaming placement below.
  const std::uint64_t all_gpu_host = e.all_bytes + in.options.host_reserve_bytes;
  if (in.options.allow_gpu_optimizer && e.all_bytes <= gpu_avail && all_gpu_host <= budget.host_bytes) {
    for (FamilyPlan& f : plan.families)
      f = {.param_home = Tier::kGpu, .optim_home = Tier::kGpu, .param_resident_gpu = true};
    plan.all_gpu = true;
    plan.gpu_bytes = non_chunk + e.all_bytes;
    plan.grad_host_bytes = e.grad_total;
    plan.host_bytes = all_gpu_host;
    return plan;
  }
  STRATA_RETURN_IF_ERROR(place_on_gpu(in, e, gpu_avail, plan));
  Usage used;
  STRATA_RETURN_IF_ERROR(place_params(in, e, plan, used));
  STRATA_RETURN_IF_ERROR(place_optimizer_states(in, e, plan, used));
  // budgets.nvme 0 with state left for NVMe was refused by place_params (no_nvme_tier).
  if (used.nvme > budget.nvme_bytes) {
    return budget_error(
        "nvme_budget", budget.nvme_bytes, used.nvme,
        fmt::format("the params and optimizer states that do not fit on host, in whole NVMe slots, and "
                    "copy-on-write room for {} families in flight",
                    in.options.nvme_families_in_flight));
  }
  plan.host_bytes = used.host;
  plan.nvme_bytes = used.nvme;
  return plan;
}

// The smallest host budget plan_once accepts with the other inputs unchanged, or 0
// when no host budget would do. Not assumed monotone: the answer is one plan_once
// accepted, rounded up to 64 KiB when that is accepted too.
std::uint64_t smallest_host_budget(PlanInput in) {
  const std::uint64_t refused = in.budgets.host_bytes;
  std::uint64_t lo = refused, hi = std::max<std::uint64_t>(refused, 64 * kKiB);
  for (;;) {  // doubling: at most 64 rounds
    if (hi >= (std::uint64_t{1} << 52)) return 0;
    hi *= 2;
    in.budgets.host_bytes = hi;
    if (plan_once(in).ok()) break;
    lo = hi;
  }
  while (hi - lo > 1) {  // lo refused, hi accepted
    const std::uint64_t mid = lo + (hi - lo) / 2;
    in.budgets.host_bytes = mid;
    (plan_once(in).ok() ? hi : lo) = mid;
  }
  in.budgets.host_bytes = align_up(hi, 64 * kKiB);
  return plan_once(in).ok() ? in.budgets.host_bytes : hi;
}

}  // namespace

Result<Plan> make_plan(const PlanInput& in) {
  Result<Plan> plan = plan_once(in);
  if (plan.ok() || plan.status().code() != StatusCode::kOutOfBudget) return plan;
  // Note [Host room]: the minimum a refusal names is one the planner accepts.
  const std::uint64_t least = smallest_host_budget(in);
  if (least == 0) return plan;
  Status s = plan.status();
  return out_of_budget(
      "{}. With these gpu and nvme budgets, raise host_budget to at least {} ({} bytes), the smallest that "
      "plans",
      s.message(), format_bytes(least), least);
}

}  // namespace strata::runtime
