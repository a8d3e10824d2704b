// strata-probe --verify; see verify.hpp (Note [Verify on the sim device]).
#include "verify.hpp"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::probe {
namespace {

namespace fs = std::filesystem;
using runtime::Access;
using runtime::StateKind;

void sleep_s(double s) {
  std::this_thread::sleep_for(std::chrono::duration<double>(s));
}

// Note [Largest verify model]
// When the asked size does not fit, the message gives the largest *verify* model
// that does: the same 16 layers and vocabulary 12 * hidden, the hidden size
// bisected. (It once gave estimate()'s bisection over the layer count at the
// oversized model's hidden size, a different family of shapes: the probe refused
// 1.7B saying the placement "holds at most 567M params" just after verifying
// 1.69B on it.)
Status too_large(const VerifyOptions& o, const Status& why) {
  const std::uint64_t seq = o.spec.shape.seq, batch = o.spec.shape.batch;
  auto fits = [&](std::uint64_t hidden) {
    TrainSpec t = o.spec;
    t.shape = {.layers = 16, .hidden = hidden, .seq = seq, .batch = batch, .vocab = 12 * hidden};
    return shape_params(t.shape).ok() && plan_fits(t, o.placement, o.capacity).ok();
  };
  std::uint64_t lo = 0, hi = o.spec.shape.hidden / 64;  // in units of 64; hi does not fit
  while (hi - lo > 1) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    (fits(mid * 64) ? lo : hi) = mid;
  }
  const std::uint64_t params = 12 * 17 * (lo * 64) * (lo * 64);
  return out_of_budget(
      "--verify-params {}: the verify model (16 layers of hidden {}) does not fit placement {} here ({}); {}",
      format_count(shape_params(o.spec.shape).value()), o.spec.shape.hidden, placement_name(o.placement),
      why.message(),
      lo == 0 ? std::string("no verify model fits it")
              : fmt::format("the largest that fits has hidden {}: --verify-params {} or less", lo * 64,
                            format_count(params)));
}

}  // namespace

// Long on purpose (issue #11's 80-line rule): one training run on the sim
// device, from set-up through the timed steps to the comparison, in order.
Result<VerifyResult> verify(const VerifyOptions& o) {
  if (o.steps < 1 || o.steps > kVerifyStepsMax) {
    return invalid_argument("--verify-steps = {}: use 1 .. {} (the median of the timed steps is reported)",
                            o.steps, kVerifyStepsMax);
  }
  VerifyResult r;
  const TrainSpec& spec = o.spec;
  STRATA_ASSIGN_OR_RETURN(r.params, shape_params(spec.shape));
  if (Status fits = plan_fits(spec, o.placement, o.capacity); !fits.ok()) return too_large(o, fits);
  // The synthetic layers sleep for their modelled compute: bound it, or a slow
  // --tflops with a long --seq is a run of hours that looks like a hang.
  const double compute_s = 6.0 * static_cast<double>(r.params) * static_cast<double>(spec.shape.seq) *
                           static_cast<double>(spec.shape.batch) / spec.device_flops_per_s;
  if (!(compute_s <= kVerifyStepSecondsMax)) {
    return invalid_argument(
        "--verify: a step of the verify model would model {:.0f} s of compute (--seq {} --batch {} at "
        "--tflops {}); "
        "at most {:.0f} s: lower --seq, --batch or --verify-params, or raise --tflops",
        compute_s, spec.shape.seq, spec.shape.batch, spec.device_flops_per_s / 1e12, kVerifyStepSecondsMax);
  }
  STRATA_ASSIGN_OR_RETURN(Estimate predicted, estimate_at(spec, o.placement, o.capacity, o.rates));
  // Note [Verify budgets]: the runtime's host budget is the probe's plus a reserve
  // (PlanOptions::host_reserve_bytes, 25%) that its planner keeps free, so both
  // planners place the same states, and the runtime has room for what its plan
  // does not count (the pinned arena fragments; the warm-up step is unplanned). The
  // budgets_held check is against the runtime's budget. The GPU budget the runtime
  // gets leaves out the modelled activations, which this synthetic model does not
  // allocate (the runtime does not trace a non-chunk peak on the sim device), so
  // the runtime's plan sees the same free GPU bytes as the probe's.
  STRATA_ASSIGN_OR_RETURN(r.budgets, tight_budgets(spec, o.placement, o.capacity, o.rates));
  // The prediction at the budgets the runtime will get.
  Capacity tight{r.budgets.gpu_bytes, r.budgets.host_bytes, r.budgets.nvme_bytes};
  STRATA_ASSIGN_OR_RETURN(predicted, estimate_at(spec, o.placement, tight, o.rates));
  r.predicted_s = predicted.cost.step_s * o.prediction_scale;
  r.bottleneck = predicted.cost.bottleneck;

  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  STRATA_ASSIGN_OR_RETURN(std::uint64_t activations, activation_peak_bytes(spec));
  dopt.budget_bytes = r.budgets.gpu_bytes + 64 * kMiB;
  dopt.h2d_bytes_per_s = o.link_bytes_per_s;
  dopt.d2h_bytes_per_s = o.link_bytes_per_s;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<memory::Device> device, memory::make_device(dopt));

  runtime::RuntimeOptions ro = runtime_options(spec);
  ro.budgets = r.budgets;
  ro.budgets.gpu_bytes = r.budgets.gpu_bytes - activations;
  r.gpu_chunk_budget_bytes = ro.budgets.gpu_bytes;
  ro.plan.host_reserve_bytes = align_up(r.budgets.host_bytes / 4, kMiB);
  ro.budgets.host_bytes = r.budgets.host_bytes + ro.plan.host_reserve_bytes;
  r.host_budget_bytes = ro.budgets.host_bytes;
  // The probe's least NVMe budget already counts whole slots and the
  // copy-on-write room (Note [Copy-on-write NVMe slots]): no extra headroom.
  ro.budgets.nvme_bytes = r.budgets.nvme_bytes;
  if (r.budgets.nvme_bytes > 0) {
    // The swap files go straight into the directory (Note [Stable scratch layout]):
    // a crashed run's are found and reclaimed by the next.
    if (o.nvme_dir.empty())
      return invalid_argument("--verify at {}: needs --nvme DIR", placement_name(o.placement));
    ro.nvme_dirs = {o.nvme_dir};
  }
  const std::uint64_t per_layer = 12 * spec.shape.hidden * spec.shape.hidden;
  ro.layout.chunk_elems = align_up(per_layer, 4096);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<runtime::Runtime> rt, runtime::Runtime::create(*device, ro));

  std::vector<runtime::TensorId> ids;
  std::vector<std::uint64_t> numels;
  const auto embed = static_cast<std::int64_t>(spec.shape.vocab * spec.shape.hidden);
  STRATA_ASSIGN_OR_RETURN(runtime::TensorId e, rt->register_tensor({"embed", {embed}, spec.compute_dtype}));
  ids.push_back(e);
  numels.push_back(static_cast<std::uint64_t>(embed));
  for (std::uint64_t l = 0; l < spec.shape.layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(runtime::TensorId id, rt->register_tensor({fmt::format("layer{}", l),
                                                                       {static_cast<std::int64_t>(per_layer)},
                                                                       spec.compute_dtype}));
    ids.push_back(id);
    numels.push_back(per_layer);
  }
  const double tokens = static_cast<double>(spec.shape.seq * spec.shape.batch);
  auto fwd_s = [&](std::size_t i) {
    return runtime::forward_flops(static_cast<double>(numels[i]), tokens) / spec.device_flops_per_s;
  };
  const std::uint64_t esize = runtime::dtype_bytes(spec.compute_dtype);

  std::vector<double> steady;
  runtime::StepStats last{};
  for (int s = 0; s < o.warmup_steps + o.steps; ++s) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p, rt->acquire(ids[i], StateKind::kParam, Access::kRead));
      STRATA_RETURN_IF_ERROR(rt->launch([t = fwd_s(i)] { sleep_s(t); }));
    }
    for (std::size_t i = ids.size(); i-- > 0;) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p, rt->acquire(ids[i], StateKind::kParam, Access::kRead));
      STRATA_ASSIGN_OR_RETURN(runtime::Lease g, rt->acquire(ids[i], StateKind::kGrad, Access::kWrite));
      auto* grad = static_cast<std::byte*>(g.data());
      const std::size_t bytes = g.numel() * esize;
      STRATA_RETURN_IF_ERROR(rt->launch([grad, bytes, t = 2 * fwd_s(i)] {
        const auto t0 = std::chrono::steady_clock::now();
        std::memset(grad, 0, bytes);  // the kernel's output: a (zero) gradient
        std::this_thread::sleep_until(t0 + std::chrono::duration<double>(t));
      }));
    }
    STRATA_ASSIGN_OR_RETURN(runtime::StepStats st, rt->step());
    if (s >= o.warmup_steps) {
      steady.push_back(st.step_s);
      r.gpu_high_water_bytes = std::max(r.gpu_high_water_bytes, st.gpu_high_water_bytes);
      r.host_high_water_bytes = std::max(r.host_high_water_bytes, st.host_high_water_bytes);
      r.nvme_bytes = std::max(r.nvme_bytes, st.nvme_bytes);
      last = st;
    }
  }
  STRATA_CHECK(!steady.empty());  // steps >= 1, checked above
  std::sort(steady.begin(), steady.end());
  r.measured_s = steady[steady.size() / 2];
  r.ratio = r.measured_s / r.predicted_s;
  r.plan = rt->plan().summary();
  r.plan_matches = plan_matches(rt->plan(), o.placement);
  r.runtime_predicted_s = rt->predict(o.rates).step_s * o.prediction_scale;
  r.budgets_held = r.gpu_high_water_bytes <= ro.budgets.gpu_bytes &&
                   r.host_high_water_bytes <= ro.budgets.host_bytes &&
                   (ro.budgets.nvme_bytes == 0 || r.nvme_bytes <= ro.budgets.nvme_bytes);
  STRATA_LOG_DEBUG("probe verify: last step h2d {} d2h {} disk r/w {} / {}; busy s: {}", last.bytes_h2d,
                   last.bytes_d2h, last.bytes_disk_read, last.bytes_disk_write, fmt::join(last.busy_s, " "));
  STRATA_LOG_DEBUG("probe verify: stall {:.3f} s", last.stall_s);
  return r;
}

}  // namespace strata::probe
