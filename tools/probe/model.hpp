#pragma once
// strata-probe's model side: a GPT-like shape, its bytes per tier, and for each
// placement the largest trainable size and its predicted step time, from the
// runtime's own planner (runtime::make_plan) and cost model (runtime::predict_step).
//
// Note [Probe placements]
// The planner picks a placement from budgets; it has no "placement" knob. The
// probe asks it five questions by choosing the budgets and PlanOptions, and
// accepts a plan only when it is the placement named:
//   all-gpu            everything on the GPU (plan.all_gpu)
//   optim-host         params and grads resident on the GPU, optimizer on the CPU
//                      (every family param_resident_gpu, every optim_home host)
//   params-optim-host  params stream from host, optimizer on the CPU (no NVMe tier)
//   optim-nvme         params on host, optimizer states (some or all) on NVMe
//   all-nvme           params and optimizer states may live on NVMe (the runtime
//                      reads NVMe-homed params through counted staging buffers)
// The largest size is found by bisection over the layer count (with the hidden
// size, vocabulary, sequence and batch fixed): feasibility is monotone in layers.
// The same budgets (shrunk to the chosen size) drive `--verify`, so the plan it
// runs is the one the prediction was made for.
//
// Note [Probe activations]
// A trainer's device memory also holds activations and workspaces, which the
// planner sees as the traced non-chunk peak. The probe models them as Megatron's
// activation-recomputation paper does (Korthikanti et al. 2022) with full
// recomputation and a fused attention kernel (FlashAttention, so no s^2 scores are
// kept): each layer keeps its input (s*b*h values), the layer being recomputed
// needs about 34*s*b*h bytes at 16 bits (scaled to the compute dtype), and the
// loss needs the logits (s*b*vocab values in fp32).

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/kernels/dtype.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/runtime/cost_model.hpp"
#include "strata/runtime/layout.hpp"
#include "strata/runtime/planner.hpp"
#include "strata/runtime/tensor.hpp"

namespace strata::probe {

//! Parses a parameter count: an integer or decimal with an optional K, M, B or T
//! suffix (powers of 1000), e.g. "1.3B", "350M", "125000". InvalidArgument names
//! `setting`, the text and the accepted forms (unknown suffix, negative, zero,
//! overflow past 2^62).
Result<std::uint64_t> parse_count(std::string_view text, std::string_view setting = "--params");

//! "1.30B", "350M", "12.5K", "999".
std::string format_count(std::uint64_t count);

//! A GPT-like model: params = 12 * layers * hidden^2 + vocab * hidden.
struct ModelShape {
  std::uint64_t layers = 0;
  std::uint64_t hidden = 0;
  std::uint64_t seq = 1024;
  std::uint64_t batch = 4;
  std::uint64_t vocab = 50257;
};

//! Parameter count of `shape`; InvalidArgument (naming the field) when a field is
//! zero or the count (or the activations) overflow 2^62.
Result<std::uint64_t> shape_params(const ModelShape& shape);

//! A shape near `params` with the given seq/batch/vocab: hidden a multiple of 64
//! about cbrt(params * 128 / 12) (depth ~ hidden / 128, as GPT-3's family), then
//! the layer count that comes closest. InvalidArgument when params is smaller than
//! the smallest such model (one layer of hidden 64).
Result<ModelShape> shape_for_params(std::uint64_t params, std::uint64_t seq, std::uint64_t batch,
                                    std::uint64_t vocab);

//! The synthetic model --verify trains near `params`: 16 equal layers and a vocabulary
//! of 12 * hidden (so the embedding is one layer's size and no family dwarfs the
//! others), hidden a multiple of 64. InvalidArgument below 16 layers of hidden 64.
Result<ModelShape> shape_for_verify(std::uint64_t params, std::uint64_t seq, std::uint64_t batch);

//! What is trained and how.
struct TrainSpec {
  ModelShape shape;
  runtime::DType compute_dtype = runtime::DType::kF32;
  kernels::Optimizer optimizer = kernels::Optimizer::kAdamW;
  kernels::DType state_dtype = kernels::DType::kF32;
  double device_flops_per_s = 400e12;  //!< sustained compute rate of the device (assumed)
  //! The runtime runs optimizer steps on the device (runtime::gpu_optimizer_supported):
  //! without it the all-gpu placement is not offered.
  bool gpu_optimizer = true;
  //! Data-parallel ranks (Note [Sharded step] in runtime/src/dp/data_parallel.cpp):
  //! family f's master and optimizer states live on rank f % ranks only. The
  //! probe plans rank 0, which holds the most families (params and gradients are
  //! whole on every rank).
  std::uint32_t ranks = 1;
  //! Note [Probe chunk size]: 0, one chunk family per layer (and one for the
  //! embedding); else the runtime's chunk size in elements, as a trainer whose
  //! layout search chose it (strata.torch reports it): each layer and the embedding
  //! are split evenly into families of at most this many elements.
  std::uint64_t chunk_elems = 0;
  //! plan.deferred_updates of the trainer (Note [Deferred updates] in
  //! runtime/src/pipeline/deferred_updates.cpp): NVMe families updated during the next forward.
  std::uint32_t deferred_updates = 0;
};

//! Families a layer (or the embedding) of `numel` elements splits into at chunk_elems
//! (Note [Probe chunk size]): at most kFamiliesPerLayerMax, checked by model_spec.
std::uint64_t families_of(const TrainSpec& spec, std::uint64_t numel);
inline constexpr std::uint64_t kFamiliesPerLayerMax = 16;

//! Bytes of model state per parameter for `spec` (param + grad + master when the
//! compute dtype is not fp32 + optimizer states; q8 states count their block
//! scales, so the figure may be fractional: 2 + 8 / 256 for q8 AdamW's two).
double state_bytes_per_param(const TrainSpec& spec);

//! Memory the placements may use, in bytes. nvme_bytes = 0: no NVMe tier.
struct Capacity {
  std::uint64_t gpu_bytes = 0;
  std::uint64_t host_bytes = 0;
  std::uint64_t nvme_bytes = 0;
};

//! Host and NVMe capacity of one of `ranks_per_node` ranks sharing one node's
//! (each rank has its own GPU).
Capacity per_rank_capacity(Capacity node, std::uint32_t ranks_per_node);

//! Bytes of masters and optimizer states rank 0 of spec.ranks holds at the
//! spec's own layer count (the planner's optim bytes of its families).
Result<std::uint64_t> rank_state_bytes(const TrainSpec& spec);

//! See Note [Probe placements].
enum class Placement : std::uint8_t { kAllGpu, kOptimHost, kParamsOptimHost, kOptimNvme, kAllNvme };
inline constexpr Placement kPlacements[] = {Placement::kAllGpu, Placement::kOptimHost,
                                            Placement::kParamsOptimHost, Placement::kOptimNvme,
                                            Placement::kAllNvme};
//! "all-gpu", "optim-host", "params-optim-host", "optim-nvme", "all-nvme".
std::string_view placement_name(Placement placement);
//! Parses a placement name; InvalidArgument lists the names.
Result<Placement> parse_placement(std::string_view text);

//! The planner's input for `spec` at `layers` layers: one family per layer (its
//! 12h^2 weights) plus one for the embedding, a forward-then-backward trace with
//! compute time from the FLOPs (6 * params * tokens), and the activation peak
//! (Note [Probe activations]) as the non-chunk peak. Budgets and options are set
//! for `placement` from `capacity`. InvalidArgument on overflow.
Result<runtime::PlanInput> plan_input(const TrainSpec& spec, std::uint64_t layers, Placement placement,
                                      const Capacity& capacity);

//! The modelled device bytes of activations and workspaces for `spec` at its own
//! layer count (Note [Probe activations]); InvalidArgument on overflow.
Result<std::uint64_t> activation_peak_bytes(const TrainSpec& spec);

//! True when `plan` is the placement named (Note [Probe placements]).
bool plan_matches(const runtime::Plan& plan, Placement placement);

//! One row of the probe's table.
struct Estimate {
  Placement placement = Placement::kAllGpu;
  bool feasible = false;
  std::uint64_t layers = 0;      //!< largest layer count that fits (hidden fixed)
  std::uint64_t max_params = 0;  //!< params at that layer count
  runtime::StepCost cost;        //!< predicted step at max_params
  runtime::Plan plan;
  std::string why;     //!< when infeasible: the planner's message or the missing tier
  std::string reason;  //!< when infeasible: a few words for the table cell (why has the rest)
  //! The bisection stopped at kLayersMax layers: max_params is a lower bound.
  bool capped = false;
};

//! A few words for a table cell from a reason `estimate` failed (the planner's
//! budget error names its budget; a plan of another placement means the GPU
//! cannot hold one layer with its activations); other text is cut to 40 characters.
std::string short_reason(std::string_view why, Placement placement);

//! Bound on the layer counts the probe plans (Note [Probe layer bound]).
inline constexpr std::uint64_t kLayersMax = 4096;

//! Whether `spec` at its own layer count takes `placement` within `capacity`:
//! OK, or the planner's reason (OutOfBudget / the placement it picks instead).
Status plan_fits(const TrainSpec& spec, Placement placement, const Capacity& capacity);

//! The largest trainable size for `placement` and its predicted step (bisection over
//! the layer count up to kLayersMax, at most 26 planner calls). Never fails: an infeasible placement
//! has feasible = false and `why`.
Estimate estimate(const TrainSpec& spec, Placement placement, const Capacity& capacity,
                  const runtime::Rates& rates);

//! Plans `spec` as given (its own layer count) for `placement`: the plan and its
//! prediction, or the reason it does not fit (OutOfBudget, naming the placement
//! and the largest size that fits).
Result<Estimate> estimate_at(const TrainSpec& spec, Placement placement, const Capacity& capacity,
                             const runtime::Rates& rates);

//! Budgets just large enough for `spec` at its own layer count to take `placement`
//! (plus `slack` as a fraction), within `capacity`: what `--verify` runs with.
//! For the NVMe placements the plan at those budgets must put state on NVMe;
//! FailedPrecondition otherwise (a model this small is cheaper to keep on host than
//! to stage through NVMe: the message says to pick a larger size).
Result<runtime::Budgets> tight_budgets(const TrainSpec& spec, Placement placement, const Capacity& capacity,
                                       const runtime::Rates& rates, double slack = 0.05);

}  // namespace strata::probe
