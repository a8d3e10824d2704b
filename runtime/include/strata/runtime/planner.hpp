#pragma once
// The Planner: from a traced step, the budgets and measured rates, where each
// family's state lives, how many GPU chunk slots stream params and grads, and how
// far ahead to prefetch. The cost model (cost_model.hpp) predicts a plan's step time.
//
// Note [Placement policy]
// 1. If every family's param, grad and optimizer state fit in the GPU budget
//    (after the traced non-chunk peak), everything stays on the GPU.
// 2. Otherwise the GPU keeps a cache of compute-dtype chunk slots (params and
//    grads stream through it; eviction by farthest next use, Note [Cyclic access
//    sequence]), and spare GPU bytes keep some families' params resident.
// 3. Host memory first holds the rooms the runtime needs whatever the placement
//    (gradient landing slots, gradients' host copies; Note [Host room] in
//    planner.cpp), then every param's home copy (params are needed twice a
//    step, in forward on the critical path), then optimizer states (master and
//    moments) for as many families as fit. The families whose gradients complete
//    *first* in backward go to NVMe, because they have the rest of backward to
//    hide the read-update-write pipeline; those completing last stay on host.
// 4. Params that do not fit on host live on NVMe too (PlanOptions::allow_nvme_params),
//    in registration order from the first that does not fit, and so do those
//    families' optimizer states (a param is updated where its states are). The
//    host then holds a bounded pool of param staging buffers (prefetch depth + 2,
//    each the largest param chunk) that NVMe-homed params are read ahead into,
//    and the optimizer pipeline's staging; both are counted before any home.
// NVMe bytes count whole slots, and room for the copy-on-write slots of the
// families in flight (Note [Copy-on-write NVMe slots]: updated states and
// NVMe-homed params go to fresh slots before the old ones are freed).
// A budget that cannot hold the smallest working set is an error that says how
// many bytes are needed and which budget to raise.

#include <cstdint>
#include <string>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/runtime/trace.hpp"

namespace strata::runtime {

//! A storage tier.
enum class Tier : std::uint8_t { kGpu, kHost, kNvme };
std::string_view tier_name(Tier tier);

//! Bytes one family needs per state kind.
struct FamilyBytes {
  std::uint64_t numel = 0;        //!< elements updated by the optimizer (0 for frozen-only families)
  std::uint64_t param_bytes = 0;  //!< compute-dtype param chunk
  std::uint64_t grad_bytes = 0;   //!< compute-dtype grad chunk (0 when all tensors are frozen)
  std::uint64_t optim_bytes = 0;  //!< fp32 master (when separate) + optimizer states
  //! optim_bytes as the NVMe tier stores them (each chunk rounded up to whole
  //! slots, nvme_chunk_bytes); 0 = optim_bytes.
  std::uint64_t optim_nvme_bytes = 0;
  //! param_bytes as the NVMe tier stores them (whole slots); 0 = param_bytes.
  std::uint64_t param_nvme_bytes = 0;
};

//! The NVMe tier's slot: the largest optimizer chunk (4 KiB aligned), at most
//! 64 MiB (larger chunks take several slots).
std::uint64_t nvme_slot_bytes(std::uint64_t largest_chunk_bytes);
//! Bytes a chunk of `chunk_bytes` takes on the NVMe tier: whole slots.
std::uint64_t nvme_chunk_bytes(std::uint64_t chunk_bytes, std::uint64_t slot_bytes);

//! Hard limits per tier. nvme_bytes = 0 means there is no NVMe tier.
struct Budgets {
  std::uint64_t gpu_bytes = 0;
  std::uint64_t host_bytes = 0;
  std::uint64_t nvme_bytes = 0;
};

//! Knobs of the plan; all bounded.
struct PlanOptions {
  //! false: no move starts before the compute that needs it is reached (a load
  //! waits for the compute enqueued before its acquire, as a runtime without
  //! prefetch moves chunks on the compute stream), and NVMe states are read only
  //! when their gradients are complete. The baseline that shows what prefetch buys.
  bool prefetch = true;
  std::uint32_t prefetch_depth_max = 4;       //!< uses ahead
  std::uint32_t nvme_families_in_flight = 2;  //!< optimizer pipeline depth for NVMe states
  std::uint32_t grad_staging_slots = 2;       //!< host slots grads land in for CPU optimizers
  bool allow_gpu_optimizer = true;            //!< everything-on-GPU placement allowed
  //! Params whose home copy does not fit on host may live on NVMe (Note
  //! [Placement policy] 4; the runtime reads them ahead into counted staging
  //! buffers, Note [NVMe-homed params] in residency.hpp). false keeps every param
  //! on host and refuses a host budget too small for them.
  bool allow_nvme_params = true;
  //! Host bytes kept free for what the plan does not schedule (a caller's own use of
  //! the host store, e.g. a fake store in a test).
  std::uint64_t host_reserve_bytes = 0;
  //! Backward passes per step (begin_micro_batch): with more than one, a gradient
  //! accumulates across micro-batches and may be written back to host between them,
  //! so the plan counts host room for every gradient (Note [Host room] in planner.cpp).
  //! The torch binding sets it from gradient_accumulation_steps; a runtime that sees
  //! begin_micro_batch(false) counts accumulation from its next plan on.
  std::uint32_t micro_batches = 1;
  //! NVMe families whose optimizer update is deferred into the next step's forward
  //! (Note [Deferred updates] in runtime/src/pipeline/deferred_updates.cpp): the
  //! ones whose gradients complete first in backward, whose params the next forward
  //! uses last. Each holds its gradient on host across step(), so the plan counts
  //! this many of the largest gradient chunk. 0: none (every update ends in its step).
  std::uint32_t deferred_updates = 0;
};

//! What the plan decides for one family.
struct FamilyPlan {
  Tier param_home = Tier::kHost;    //!< authoritative compute-dtype param copy
  Tier optim_home = Tier::kHost;    //!< master + states; also where the optimizer runs (NVMe -> CPU)
  bool param_resident_gpu = false;  //!< param stays on the GPU for the whole step
};

//! Inputs the Planner reads.
struct PlanInput {
  std::vector<FamilyBytes> families;
  StepTrace trace;
  Budgets budgets;
  PlanOptions options;
  std::uint64_t slot_bytes = 0;  //!< size of one compute-dtype chunk slot (param or grad)
  //! The most families one working set of tensors leased together spans (Note [Working
  //! sets] in runtime/src/core/core.cpp): the plan keeps a streaming slot for each, and
  //! one for a gradient; 1 when none is declared.
  std::uint32_t working_set_families = 1;
  //! The optimizers run only at step() (loss scaling, clipping, data parallelism):
  //! every gradient is brought to host first (Note [Host room] in planner.cpp).
  bool deferred_step = false;
};

//! A plan. Plain value; `summary()` is one readable paragraph.
struct Plan {
  std::vector<FamilyPlan> families;
  std::uint64_t gpu_cache_slots = 0;  //!< streaming slots (0 when everything is GPU-resident)
  std::uint32_t prefetch_depth = 0;   //!< uses ahead
  std::uint32_t nvme_staging_families = 0;
  //! NVMe families whose update runs in the next forward (PlanOptions::deferred_updates
  //! when optimizer states go to NVMe and the optimizers do not wait for step(); else 0).
  std::uint32_t deferred_update_families = 0;
  //! Host buffers NVMe-homed params are read ahead into (0 when every param is on host).
  std::uint32_t param_staging_buffers = 0;
  //! Host room for gradients' host copies (written back from the device before their
  //! optimizer consumes them): the runtime waits rather than exceed it (Note [Backpressure]
  //! in residency.cpp). Part of host_bytes.
  std::uint64_t grad_host_bytes = 0;
  //! The planned peak per tier: an upper bound on what the run holds (Note [Host room]
  //! in planner.cpp; checked at every step's end in checked builds).
  std::uint64_t gpu_bytes = 0;
  std::uint64_t host_bytes = 0;
  std::uint64_t nvme_bytes = 0;
  bool all_gpu = false;
  std::string summary() const;
};

//! Makes a plan. Fails with OutOfBudget (naming the budget, the bytes needed and
//! the bytes available) when no placement fits, InvalidArgument on empty input. A
//! host refusal names the smallest host budget the planner accepts for the same
//! input ("raise host_budget to at least X"): a budget that trains.
Result<Plan> make_plan(const PlanInput& input);

}  // namespace strata::runtime
