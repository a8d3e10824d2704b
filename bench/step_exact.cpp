// strata-bench step's exactness check (step_exact.hpp).
//
// Note [Exactness in the step benchmark]
// The step's own model may be larger than host memory can hold twice, and an
// all-on-host run of it would need its whole state on host, so the check trains a
// smaller copy in the same process: the same layer shape (so the same chunks,
// staging buffers and I/O sizes), fewer layers, and the host budget scaled with
// them. The NVMe pipeline's staging is a fixed number of chunks whatever the
// layer count, so the copy keeps enough layers that the scaled budget holds the
// smallest pipeline the planner allows (1 grad slot, prefetch depth 1, one NVMe
// family in flight: 7 chunks) and one param; the rest of its params, and their
// states, go to NVMe. Both runs start from the same pseudo-random values, and each
// gradient depends on the layer, the step and the param it was computed from, so
// a param read from a wrong place, or a stale slot, changes every later byte.
// The two runtimes stay alive until the end and are compared one tensor at a
// time, byte for byte (read_tensor), so the check holds two chunks, not two
// copies of the model.
#include "step_exact.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/options.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::bench {
namespace {

using runtime::Runtime;
using runtime::StateKind;
using runtime::TensorId;

constexpr int kExactSteps = 4;  // step 1 traces, step 2 adopts the plan, 3 and 4 are steady
// The host room of the smallest NVMe pipeline (Note [Host room] in runtime/plan/planner.cpp):
// a grad landing slot, a gradient copy per streaming slot (4), an NVMe chunk's temporary copy
// (2), 3 param staging buffers and one NVMe family in flight (3), + one param.
constexpr std::uint64_t kStagingChunks = 14;
constexpr std::size_t kLayersMin = 2;

// A deterministic value in [-0.5, 0.5) for element i of stream `seed`.
float pattern(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed + 1) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 29;
  return static_cast<float>(x >> 40) / static_cast<float>(1ull << 24) - 0.5f;
}

struct Trainer {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<Runtime> rt;
  std::vector<TensorId> ids;
};

Result<Trainer> train(const StepModel& m, runtime::RuntimeOptions ro) {
  Trainer t;
  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = m.gpu_budget_bytes + 64 * kMiB;
  STRATA_ASSIGN_OR_RETURN(t.device, memory::make_device(dopt));
  ro.hyper.optimizer = kernels::Optimizer::kAdamW;
  ro.hyper.lr = 1e-3f;
  ro.hyper.weight_decay = 0.01f;
  ro.layout.chunk_elems = m.params_per_layer;
  STRATA_ASSIGN_OR_RETURN(t.rt, Runtime::create(*t.device, std::move(ro)));
  for (std::size_t l = 0; l < m.layers; ++l) {
    STRATA_ASSIGN_OR_RETURN(
        TensorId id,
        t.rt->register_tensor({fmt::format("layer{}", l), {static_cast<std::int64_t>(m.params_per_layer)}}));
    t.ids.push_back(id);
  }
  std::vector<float> init(m.params_per_layer);
  for (std::size_t l = 0; l < m.layers; ++l) {
    for (std::uint64_t i = 0; i < init.size(); ++i) init[i] = pattern(l, i);
    STRATA_RETURN_IF_ERROR(t.rt->init_tensor(t.ids[l], init));
  }
  for (int s = 0; s < kExactSteps; ++s) {
    for (TensorId id : t.ids) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p, t.rt->acquire(id, StateKind::kParam, runtime::Access::kRead));
      STRATA_RETURN_IF_ERROR(t.rt->launch([] {}));
    }
    for (std::size_t l = m.layers; l-- > 0;) {
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p,
                              t.rt->acquire(t.ids[l], StateKind::kParam, runtime::Access::kRead));
      STRATA_ASSIGN_OR_RETURN(runtime::Lease g,
                              t.rt->acquire(t.ids[l], StateKind::kGrad, runtime::Access::kWrite));
      const float* param = p.as<float>();
      float* grad = g.as<float>();
      const std::size_t n = g.numel();
      const std::uint64_t seed = 1000 * (s + 1) + l;
      STRATA_RETURN_IF_ERROR(t.rt->launch([param, grad, n, seed] {
        for (std::size_t i = 0; i < n; ++i) grad[i] = 1e-2f * param[i] + 1e-3f * pattern(seed, i);
      }));
    }
    STRATA_RETURN_IF_ERROR(t.rt->step().status());
  }
  STRATA_RETURN_IF_ERROR(t.rt->flush());
  return t;
}

}  // namespace

StepModel exact_check_model(const StepModel& full) {
  StepModel m = full;
  const std::uint64_t layer_bytes = full.params_per_layer * sizeof(float);
  // The fewest layers whose share of the host budget holds the staging and a param.
  const std::uint64_t host = std::max<std::uint64_t>(full.host_budget_bytes, 1);
  const std::uint64_t wanted = (kStagingChunks * layer_bytes * full.layers + host - 1) / host;
  m.layers = static_cast<std::size_t>(
      std::clamp<std::uint64_t>(wanted, std::min(kLayersMin, full.layers), full.layers));
  m.host_budget_bytes =
      std::max(full.host_budget_bytes / full.layers * m.layers, kStagingChunks * layer_bytes);
  return m;
}

Result<ExactResult> check_bit_identical(const StepModel& full, const std::filesystem::path& dir) {
  const StepModel m = exact_check_model(full);
  const std::uint64_t layer_bytes = m.params_per_layer * sizeof(float);
  ExactResult r;
  r.layers = m.layers;
  r.host_budget_bytes = m.host_budget_bytes;
  r.steps = kExactSteps;

  // The smallest pipeline the planner allows, in both runs (Note [Exactness in the step benchmark]).
  runtime::RuntimeOptions base;
  base.plan.prefetch_depth_max = 1;
  base.plan.nvme_families_in_flight = 1;
  base.plan.grad_staging_slots = 1;

  runtime::RuntimeOptions on_host = base;
  // param, grad and two Adam states a layer, the grad slot and room for evicted grads.
  on_host.budgets = {.gpu_bytes = m.gpu_budget_bytes, .host_bytes = (4 * m.layers + 8) * layer_bytes};
  STRATA_ASSIGN_OR_RETURN(Trainer host, train(m, std::move(on_host)));

  runtime::RuntimeOptions on_nvme = base;
  on_nvme.budgets = {.gpu_bytes = m.gpu_budget_bytes,
                     .host_bytes = m.host_budget_bytes,
                     .nvme_bytes = 2 * 4 * m.layers * layer_bytes};
  on_nvme.nvme_dirs = {dir.string()};
  STRATA_ASSIGN_OR_RETURN(Trainer nvme, train(m, std::move(on_nvme)));
  for (runtime::FamilyId f = 0; f < nvme.rt->plan().families.size(); ++f) {
    if (nvme.rt->plan().families[f].param_home == runtime::Tier::kNvme)
      r.params_nvme_bytes += nvme.rt->layout().families[f].capacity_elems * sizeof(float);
  }
  if (r.params_nvme_bytes == 0) {
    return failed_precondition(
        "exactness check: {} layers under host_budget {} kept every param on host, so it would not test "
        "NVMe-homed params",
        m.layers, format_bytes(m.host_budget_bytes));
  }

  std::vector<float> a(m.params_per_layer), b(m.params_per_layer);
  constexpr std::array kKinds = {StateKind::kParam, StateKind::kState0, StateKind::kState1};
  r.identical = true;
  for (std::size_t l = 0; l < m.layers && r.identical; ++l) {
    for (StateKind kind : kKinds) {
      STRATA_RETURN_IF_ERROR(host.rt->read_tensor(host.ids[l], kind, a));
      STRATA_RETURN_IF_ERROR(nvme.rt->read_tensor(nvme.ids[l], kind, b));
      if (std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) != 0) {
        const auto at = std::mismatch(a.begin(), a.end(), b.begin(),
                                      [](float x, float y) { return std::memcmp(&x, &y, sizeof x) == 0; })
                            .first -
                        a.begin();
        r.identical = false;
        r.first_difference = fmt::format("layer {} {} element {}: {} on host, {} with NVMe", l,
                                         runtime::state_kind_name(kind), at, a[at], b[at]);
        break;
      }
    }
  }
  return r;
}

}  // namespace strata::bench
