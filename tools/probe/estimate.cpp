// strata-probe's estimates: the largest model each placement trains, its
// predicted step, and the least budgets a model needs (model.hpp; Note [Probe
// placements], Note [Probe layer bound]). The model's shape and the plan input
// are in model.cpp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "model.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

namespace strata::probe {

namespace {

// The plan for `layers`, or the reason there is none for `placement`.
Result<runtime::Plan> try_plan(const TrainSpec& spec, std::uint64_t layers, Placement placement,
                               const Capacity& capacity, runtime::PlanInput* input_out = nullptr) {
  STRATA_ASSIGN_OR_RETURN(runtime::PlanInput in, plan_input(spec, layers, placement, capacity));
  STRATA_ASSIGN_OR_RETURN(runtime::Plan plan, runtime::make_plan(in));
  if (!plan_matches(plan, placement)) {
    return out_of_budget("not even {} layer(s) of hidden {} fit {}: with these budgets the planner picks {}",
                         layers, spec.shape.hidden, placement_name(placement), plan.summary());
  }
  if (input_out != nullptr) *input_out = std::move(in);
  return plan;
}

}  // namespace

std::string short_reason(std::string_view why, Placement placement) {
  // The planner's budget errors read "<which> budget is <have> but ..." (planner.cpp).
  for (std::string_view budget : {"gpu", "host", "nvme"}) {
    if (why.starts_with(fmt::format("{} budget is", budget)) ||
        why.starts_with(fmt::format("{}_budget", budget))) {
      return fmt::format("1 layer exceeds the {} budget", budget);
    }
  }
  if (why.starts_with("not even")) {
    return placement == Placement::kAllGpu || placement == Placement::kOptimHost
               ? "GPU too small for 1 layer + activations"
               : "planner picks another placement";
  }
  constexpr std::size_t kShort = 40;
  return why.size() <= kShort ? std::string(why) : std::string(why.substr(0, kShort - 3)) + "...";
}

Status plan_fits(const TrainSpec& spec, Placement placement, const Capacity& capacity) {
  return try_plan(spec, spec.shape.layers, placement, capacity).status();
}

Estimate estimate(const TrainSpec& spec, Placement placement, const Capacity& capacity,
                  const runtime::Rates& rates) {
  Estimate e;
  e.placement = placement;
  if ((placement == Placement::kOptimNvme || placement == Placement::kAllNvme) && capacity.nvme_bytes == 0) {
    e.why = "no NVMe tier (give --nvme DIR)";
    e.reason = "no NVMe tier (--nvme DIR)";
    return e;
  }
  if (placement == Placement::kAllGpu && !spec.gpu_optimizer) {
    e.why =
        "the runtime runs optimizer steps on the CPU with this device (the CUDA optimizer is not wired into "
        "it yet), so it cannot train everything on the GPU";
    e.reason = "runtime has no GPU optimizer here";
    return e;
  }
  auto first = try_plan(spec, 1, placement, capacity);
  if (!first.ok()) {
    e.why = first.status().message();
    e.reason = short_reason(e.why, placement);
    return e;
  }
  // Note [Probe layer bound]
  // The probe plans one family per layer, and the planner and cost model do work
  // quadratic in the family count (the Belady simulation scans every family per
  // use). A tiny layer (--hidden 1: 12 params) fits by the million, so an
  // unbounded search planned a million families and never finished. The layer
  // count is bounded by kLayersMax (deeper than any trained transformer; divided
  // by the families a layer splits into, Note [Probe chunk size]); a placement that
  // still fits there reports its size as a lower bound.
  const std::uint64_t layers_max =
      std::max<std::uint64_t>(1, kLayersMax / families_of(spec, 12 * spec.shape.hidden * spec.shape.hidden));
  std::uint64_t lo = 1, hi = 2;  // lo fits; find an hi that does not
  while (hi <= layers_max && try_plan(spec, hi, placement, capacity).ok()) {
    lo = hi;
    hi *= 2;
  }
  e.capped = hi > layers_max && lo == layers_max;
  hi = std::min(hi, layers_max + 1);
  while (hi - lo > 1) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    (try_plan(spec, mid, placement, capacity).ok() ? lo : hi) = mid;
  }
  runtime::PlanInput in;
  auto plan = try_plan(spec, lo, placement, capacity, &in);
  STRATA_CHECK(plan.ok());
  ModelShape shape = spec.shape;
  shape.layers = lo;
  e.feasible = true;
  e.layers = lo;
  e.max_params = shape_params(shape).value();
  e.plan = *plan;
  e.cost = runtime::predict_step(in, e.plan, rates);
  return e;
}

Result<Estimate> estimate_at(const TrainSpec& spec, Placement placement, const Capacity& capacity,
                             const runtime::Rates& rates) {
  STRATA_ASSIGN_OR_RETURN(std::uint64_t params, shape_params(spec.shape));
  runtime::PlanInput in;
  auto plan = try_plan(spec, spec.shape.layers, placement, capacity, &in);
  if (!plan.ok()) {
    Estimate most = estimate(spec, placement, capacity, rates);
    return out_of_budget(
        "{} params ({} layers) do not fit placement {} on this machine: {}; at hidden {} it holds at most {}",
        format_count(params), spec.shape.layers, placement_name(placement), plan.status().message(),
        spec.shape.hidden,
        most.feasible ? format_count(most.max_params) + " params (" + std::to_string(most.layers) + " layers)"
                      : "nothing (" + most.why + ")");
  }
  Estimate e;
  e.placement = placement;
  e.feasible = true;
  e.layers = spec.shape.layers;
  e.max_params = params;
  e.plan = *plan;
  e.cost = runtime::predict_step(in, e.plan, rates);
  return e;
}

Result<runtime::Budgets> tight_budgets(const TrainSpec& spec, Placement placement, const Capacity& capacity,
                                       const runtime::Rates& rates, double slack) {
  STRATA_RETURN_IF_ERROR(estimate_at(spec, placement, capacity, rates).status());
  Capacity c = capacity;
  if (placement != Placement::kOptimNvme && placement != Placement::kAllNvme) c.nvme_bytes = 0;
  // Shrink each budget in turn to the least that still gives the placement.
  for (std::uint64_t Capacity::*field :
       {&Capacity::gpu_bytes, &Capacity::host_bytes, &Capacity::nvme_bytes}) {
    if (c.*field == 0) continue;
    std::uint64_t lo = 0, hi = c.*field;  // hi fits
    while (hi - lo > kMiB) {
      const std::uint64_t mid = lo + (hi - lo) / 2;
      Capacity t = c;
      t.*field = mid;
      (try_plan(spec, spec.shape.layers, placement, t).ok() ? hi : lo) = mid;
    }
    c.*field =
        std::min(c.*field, align_up(static_cast<std::uint64_t>(static_cast<double>(hi) * (1 + slack)), kMiB));
  }
  if (placement == Placement::kOptimNvme || placement == Placement::kAllNvme) {
    STRATA_ASSIGN_OR_RETURN(runtime::Plan plan, try_plan(spec, spec.shape.layers, placement, c));
    if (plan.nvme_bytes == 0) {
      return failed_precondition(
          "placement {} at {} layers: even at the least host budget the planner keeps every state on host "
          "(staging NVMe families would cost more host memory than the states); choose a larger size",
          placement_name(placement), spec.shape.layers);
    }
  }
  return runtime::Budgets{.gpu_bytes = c.gpu_bytes, .host_bytes = c.host_bytes, .nvme_bytes = c.nvme_bytes};
}

}  // namespace strata::probe
