#include "contract_train.hpp"

#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <memory>
#include <optional>
#include <regex>
#include <thread>

#include "strata/common/bytes.hpp"
#include "strata/common/half.hpp"
#include "strata/runtime/gradient_order.hpp"
#include "strata/strata.hpp"

namespace strata::contract {

// Note [Contract run]
// One run of strata-contract (issue #24, item 3):
// 1. Sizing: the model is registered on a runtime with room for everything and the
//    drawn layout options; its chunk layout gives the sizes the budgets are drawn
//    against (budgets_for): from below the smallest working set to past everything
//    fitting. The layout search depends on the tensor sizes alone, not on budgets.
// 2. The run under test: created with the drawn budgets and knobs, every tensor
//    registered and initialised. A failure up to here is a refusal at creation (the
//    plan from the registration order is made at the first init_tensor); it must
//    carry a message. With seek_minimum the targeted budget starts tiny and each
//    refusal's suggestion ("raise host_budget to at least X", "... needs X; raise
//    gpu_budget") is applied as printed; a suggestion refused again for the same
//    budget breaks the promise that the suggested minimum trains. A widened model in
//    the NVMe window (Note [Widened for NVMe] in contract_draw.cpp) takes its host budget
//    from the planner: two creations at a tiny host budget, with and without the NVMe
//    budget, are refused with the smallest host budget that plans; the run's host budget
//    lies between the two, where params and states must go to NVMe.
// 3. Past acceptance, K steps of synthetic forward and backward (gradients computed
//    from the params read through leases, so the trajectory depends on every update)
//    must end without an error, within every tier's budget and within the largest
//    plan the runtime adopted (Plan::gpu_bytes/host_bytes/nvme_bytes).
// 4. The all-resident reference: the same model, optimizer and steps with budgets
//    where everything sits on the (sim) GPU, and the same chunk size (LAMB/LARS trust
//    ratios and the clipping norm sum in groups aligned to the chunk, Note [Exact
//    norms]), must give the same bits: every param, fp32 master, optimizer state and
//    step counter, and the same steps applied or skipped. The sim device's optimizer
//    is the CPU kernel (gpu_optimizer_supported), so this is the same math on every tier.

namespace {

using runtime::DType;

float load(const void* p, std::uint64_t i, DType t) {
  if (t == DType::kF32) return static_cast<const float*>(p)[i];
  const std::uint16_t h = static_cast<const std::uint16_t*>(p)[i];
  return t == DType::kBF16 ? bf16_to_float(h) : f16_to_float(h);
}

void store(void* p, std::uint64_t i, DType t, float v) {
  if (t == DType::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<std::uint16_t*>(p)[i] = t == DType::kBF16 ? float_to_bf16(v) : float_to_f16(v);
  }
}

DType dtype_of(const std::string& name) {
  return name == "bf16" ? DType::kBF16 : (name == "fp16" ? DType::kF16 : DType::kF32);
}

//! A fixed pseudo-random value in [-1, 1) per (tensor, element).
float mix(std::uint64_t tensor, std::uint64_t i) {
  std::uint64_t z = (tensor + 1) * 0x9e3779b97f4a7c15ull ^ (i * 0xbf58476d1ce4e5b9ull);
  z ^= z >> 29;
  z *= 0x94d049bb133111ebull;
  z ^= z >> 32;
  return static_cast<float>(z & 0xffffff) / static_cast<float>(0x800000) - 1.0f;
}

//! What training reads back and measures.
struct Trained {
  std::vector<std::string> values;  //!< per tensor and state kind: raw bits, or "error: ..."
  std::vector<std::int64_t> tensor_steps;
  std::vector<bool> applied;
  std::uint64_t gpu_hw = 0, host_hw = 0, nvme_max = 0;
  std::uint64_t plan_gpu = 0, plan_host = 0, plan_nvme = 0;
  std::uint64_t chunk_elems = 0;
  bool late = false;                       //!< some gradients came late (TensorDraw::late)
  std::uint64_t kept_gradients = 0;        //!< kept back by runtime::GradientOrder (late gradients)
  std::uint64_t declared_no_gradient = 0;  //!< unused tensors declared at backward's end
  std::uint64_t updates_deferred = 0;      //!< updates step() left to the next forward (StepStats)
  std::uint64_t nvme_state_families = 0;   //!< the most families an adopted plan homed states on NVMe
  std::uint64_t nvme_param_families = 0;   //!< the same for params
  bool all_gpu = false;
  std::string plan_summary;
};

//! Where a training attempt stopped.
struct Attempt {
  enum class Stage { kRefused, kFailed, kDone } stage = Stage::kDone;
  Status status;
  std::string phase;
  Trained out;
};

struct Budgets3 {
  std::uint64_t gpu = 0, host = 0, nvme = 0;
  std::uint64_t host_reserve = 0;  //!< plan.host_reserve (fixed bytes: a suggestion's retry keeps it)
};

Result<Config> make_config(const Draw& d, const Budgets3& b, const std::string& nvme_dir, bool reference,
                           std::uint64_t chunk_elems) {
  const ModelDraw& m = d.model;
  const ConfigDraw& c = d.config;
  Config cfg;
  cfg.device.kind = memory::DeviceChoice::kSim;
  cfg.device.budget_bytes = b.gpu;
  STRATA_RETURN_IF_ERROR(cfg.set("optimizer.name", m.optimizer));  // first: resets the others
  cfg.runtime.hyper.lr = m.lr;
  cfg.runtime.hyper.weight_decay = m.weight_decay;
  if (m.optimizer == "sgd" || m.optimizer == "lars") cfg.runtime.hyper.momentum = m.momentum;
  cfg.runtime.hyper.nesterov = m.nesterov;
  cfg.runtime.compute_dtype = dtype_of(m.compute);
  cfg.runtime.state_dtype = dtype_of(m.states);
  cfg.runtime.clip_max_norm = m.clip_max_norm;
  cfg.runtime.loss_scaling = m.loss_scaling;
  cfg.runtime.budgets = {.gpu_bytes = b.gpu, .host_bytes = b.host, .nvme_bytes = b.nvme};
  if (b.nvme > 0) cfg.runtime.nvme_dirs = {nvme_dir};
  cfg.runtime.layout.chunk_elems = chunk_elems != 0 ? chunk_elems : c.chunk_elems;
  cfg.runtime.layout.chunk_elems_min = c.chunk_elems_min;
  cfg.runtime.layout.chunk_elems_max = c.chunk_elems_max;
  cfg.runtime.threads = static_cast<std::size_t>(c.threads);
  if (!reference) {
    cfg.runtime.io_engine = c.engine == "uring" ? "uring" : c.engine;
    cfg.runtime.plan.prefetch = c.prefetch;
    cfg.runtime.plan.prefetch_depth_max = c.prefetch_depth_max;
    cfg.runtime.plan.grad_staging_slots = c.grad_staging_slots;
    cfg.runtime.plan.nvme_families_in_flight = c.nvme_families_in_flight;
    cfg.runtime.plan.deferred_updates = c.deferred_updates;
    cfg.runtime.plan.allow_nvme_params = c.allow_nvme_params;
    cfg.runtime.plan.allow_gpu_optimizer = c.allow_gpu_optimizer;
    cfg.runtime.plan.host_reserve_bytes = b.host_reserve;
    // Declared as docs/config.md asks (strata.torch sets it from gradient_accumulation_steps):
    // a runtime that only sees begin_micro_batch(false) counts every gradient's host copy
    // from its next plan on, and that re-plan may refuse what the first plan accepted.
    cfg.runtime.plan.micro_batches = static_cast<std::uint32_t>(m.micro_batches);
  }
  return cfg;
}

//! The values every run starts from (the same for the run and its reference).
std::vector<float> initial_values(const TensorDraw& t, std::size_t index) {
  std::vector<float> v(t.numel);
  for (std::uint64_t i = 0; i < t.numel; ++i) v[i] = 0.5f * mix(index + 1000, i);
  return v;
}

// Creation: create, register, init. Any failure here is a refusal.
Status create_model(const Draw& d, Config cfg, std::unique_ptr<Runtime>& rt, std::vector<TensorId>& ids,
                    const PhaseFn& phase, const std::string& who) {
  phase(who + ": create");
  auto created = Runtime::create(std::move(cfg));
  if (!created.ok()) return created.status();
  rt = std::move(created).value();
  phase(who + ": register");
  for (const TensorDraw& t : d.model.tensors) {
    auto id = rt->register_tensor(t.name, t.shape, t.frozen);
    if (!id.ok()) return id.status();
    ids.push_back(*id);
  }
  phase(who + ": init_tensor");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    STRATA_RETURN_IF_ERROR(rt->init_tensor(ids[i], initial_values(d.model.tensors[i], i)));
  }
  return Status::Ok();
}

//! Whether the runtime adopted a plan: past this point the run was accepted.
bool accepted(Runtime* rt) {
  return rt != nullptr && !rt->plan().families.empty();
}

//! Each micro-batch's "loss": written by its forward launches, read by its backward
//! launches (one stream: ordered). One slot per micro-batch, so the host never waits
//! for the stream between micro-batches.
struct Scratch {
  std::vector<double> loss;
  //! Per tensor: its tied uses' gradients, summed (every tensor's whole gradient when
  //! some come late: Note [Gradients in pieces]).
  std::vector<std::vector<float>> pending;
  runtime::GradientOrder order;  //!< when some gradients come late
  std::uint64_t declared = 0;    //!< tensors declared gradient-less (Runtime::no_gradient)
  double& at(const ModelDraw& m, int step, int mb) {
    return loss[static_cast<std::size_t>(step * m.micro_batches + mb)];
  }
};

Status forward(Runtime& rt, const Draw& d, const std::vector<TensorId>& ids, int step, int mb,
               Scratch& scratch) {
  const DType dt = dtype_of(d.model.compute);
  for (int t : d.model.forward_order) {
    if (!d.model.used(t, step, mb)) continue;
    STRATA_ASSIGN_OR_RETURN(Lease p, rt.param(ids[static_cast<std::size_t>(t)]));
    const void* data = p.data();
    const std::uint64_t n = p.numel();
    double* loss = &scratch.at(d.model, step, mb);
    STRATA_RETURN_IF_ERROR(rt.launch([loss, data, n, dt, t] {
      double s = 0.0;
      for (std::uint64_t i = 0; i < n; ++i)
        s += double{load(data, i, dt)} * mix(static_cast<std::uint64_t>(t), i);
      *loss += s / static_cast<double>(n);
    }));
  }
  return Status::Ok();
}

//! d loss / d param of one use `k` of tensor `t` (element i, param value x).
inline float contribution(float x, float u, int step, int mb, int k, float l, float scale) {
  return scale *
         (0.5f * x + 0.1f * u + 0.03f * static_cast<float>(k) * u +
          0.05f * std::sin(0.9f * static_cast<float>(step) + 0.5f * static_cast<float>(mb) + u) + 0.01f * l);
}

// Calls use(t, k, last, p) for each use of a trainable tensor in backward, in
// reverse forward order: k counts its earlier uses in this micro-batch, last says
// it is its last, p is its param lease. (A frozen tensor's param is read too.)
template <class Use>
Status each_backward_use(Runtime& rt, const ModelDraw& m, const std::vector<TensorId>& ids, int step, int mb,
                         Use&& use) {
  std::vector<int> left(m.tensors.size(), 0), seen(m.tensors.size(), 0);
  for (int t : m.forward_order) left[static_cast<std::size_t>(t)] += m.used(t, step, mb) ? 1 : 0;
  for (auto it = m.forward_order.rbegin(); it != m.forward_order.rend(); ++it) {
    const int t = *it;
    const auto ti = static_cast<std::size_t>(t);
    if (!m.used(t, step, mb)) continue;
    STRATA_ASSIGN_OR_RETURN(Lease p, rt.param(ids[ti]));
    if (!m.trainable(t)) continue;  // frozen: read in backward too, no gradient
    const int k = seen[ti]++;
    const bool last = --left[ti] == 0;
    STRATA_RETURN_IF_ERROR(use(t, k, last, p));
  }
  return Status::Ok();
}

Status backward_ordered(Runtime& rt, const Draw& d, const std::vector<TensorId>& ids, int step, int mb,
                        Scratch& scratch, std::vector<bool>& written);

// Gradients go through runtime::GradientOrder when some come late, and in a widened
// model, whose families each pack several tensors used at random points of forward
// (Note [Widened for NVMe]): handed as backward reaches them, they would leave more
// families incomplete at once than the plan's room holds, which the runtime refuses
// naming the order (Runtime::incomplete_gradients_max); a caller hands them as
// GradientOrder does, as strata.torch's binding does.
bool ordered_gradients(const Draw& d) {
  return d.model.any_late() || d.config.widened;
}

// Backward in reverse forward order. A tied tensor's uses are summed by the caller
// (in Scratch::pending) and its gradient handed over once per micro-batch, at its
// last use (Note [Gradient completion] in runtime/src/runtime_impl.hpp: a second
// write lease in one micro-batch is refused, as torch accumulates tied uses first).
Status backward(Runtime& rt, const Draw& d, const std::vector<TensorId>& ids, int step, int mb,
                Scratch& scratch, std::vector<bool>& written) {
  if (ordered_gradients(d)) return backward_ordered(rt, d, ids, step, mb, scratch, written);
  const ModelDraw& m = d.model;
  const DType dt = dtype_of(m.compute);
  const float scale = m.loss_scaling ? m.loss_scale : 1.0f;
  const double* loss = &scratch.at(m, step, mb);
  return each_backward_use(rt, m, ids, step, mb, [&](int t, int k, bool last, const Lease& p) -> Status {
    const auto ti = static_cast<std::size_t>(t);
    float* pending = scratch.pending[ti].data();
    const void* pd = p.data();
    const std::uint64_t n = p.numel();
    if (!last) {  // a tied use before the last: summed by the caller
      return rt.launch([loss, pd, pending, n, dt, t, step, mb, k, scale] {
        const float l = static_cast<float>(std::tanh(*loss));
        for (std::uint64_t i = 0; i < n; ++i) {
          const float c =
              contribution(load(pd, i, dt), mix(static_cast<std::uint64_t>(t), i), step, mb, k, l, scale);
          pending[i] = k == 0 ? c : pending[i] + c;
        }
      });
    }
    const bool accumulate = written[ti];
    STRATA_ASSIGN_OR_RETURN(Lease g, rt.grad(ids[ti], accumulate ? Access::kAccumulate : Access::kWrite));
    written[ti] = true;
    const bool inf = m.inf_step == step && mb == 0 && m.inf_tensor == t;
    void* gd = g.data();
    return rt.launch([loss, pd, gd, pending, n, dt, t, step, mb, k, scale, accumulate, inf] {
      const float l = static_cast<float>(std::tanh(*loss));
      for (std::uint64_t i = 0; i < n; ++i) {
        float v = contribution(load(pd, i, dt), mix(static_cast<std::uint64_t>(t), i), step, mb, k, l, scale);
        if (k > 0) v += pending[i];
        if (accumulate) v += load(gd, i, dt);
        store(gd, i, dt, v);
      }
      if (inf) store(gd, 0, dt, INFINITY);
    });
  });
}

// Hands tensor `ti`'s gradient from its pending buffer (backward_ordered).
Status hand_pending(Runtime& rt, const Draw& d, TensorId id, std::size_t ti, int step, int mb,
                    Scratch& scratch, std::vector<bool>& written) {
  const DType dt = dtype_of(d.model.compute);
  const bool accumulate = written[ti];
  STRATA_ASSIGN_OR_RETURN(Lease g, rt.grad(id, accumulate ? Access::kAccumulate : Access::kWrite));
  written[ti] = true;
  const bool inf = d.model.inf_step == step && mb == 0 && d.model.inf_tensor == static_cast<int>(ti);
  void* gd = g.data();
  const float* pending = scratch.pending[ti].data();
  const std::uint64_t n = g.numel();
  return rt.launch([gd, pending, n, dt, accumulate, inf] {
    for (std::uint64_t i = 0; i < n; ++i) {
      float v = pending[i];
      if (accumulate) v += load(gd, i, dt);  // (not v + 0.0f: -0.0 stays -0.0, as in backward)
      store(gd, i, dt, v);
    }
    if (inf) store(gd, 0, dt, INFINITY);
  });
}

// Backward when some gradients come late (TensorDraw::late; Note [Gradients in
// pieces] in strata/runtime/gradient_order.hpp): each use adds its contribution to
// the tensor's pending buffer (the same sums, in the same order, as backward's), and
// at its last use the gradient is offered to runtime::GradientOrder, which hands it
// or keeps it back; the late ones are offered after every other, as torch hands the
// cached autocast casts' gradients. What is still kept is handed at the end, and the
// tensors unused in this micro-batch are declared (GradientOrder::end_backward).
Status backward_ordered(Runtime& rt, const Draw& d, const std::vector<TensorId>& ids, int step, int mb,
                        Scratch& scratch, std::vector<bool>& written) {
  const ModelDraw& m = d.model;
  const DType dt = dtype_of(m.compute);
  const float scale = m.loss_scaling ? m.loss_scale : 1.0f;
  runtime::GradientOrder& order = scratch.order;
  if (!order.has_families()) {
    std::vector<std::uint32_t> family(ids.size());
    std::vector<bool> trainable(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      family[i] = static_cast<std::uint32_t>(rt.layout().slots.at(ids[i]).family);
      trainable[i] = m.trainable(static_cast<int>(i));
    }
    order.set_families(std::move(family), trainable);
  }
  order.begin_micro_batch(rt.incomplete_gradients_max());
  std::vector<std::uint32_t> hand, late;
  const auto offer = [&](std::uint32_t t) -> Status {
    order.offer(t, scratch.pending[t].size() * sizeof(float), &hand);
    for (std::uint32_t h : hand)
      STRATA_RETURN_IF_ERROR(hand_pending(rt, d, ids[h], h, step, mb, scratch, written));
    hand.clear();
    return Status::Ok();
  };
  // Backward's end: what is still kept, and the tensors unused in this micro-batch of
  // every family some of whose gradients came, declared gradient-less (Runtime::no_gradient).
  const auto end = [&]() -> Status {
    std::vector<runtime::GradientOrder::Handing> handings;
    order.end_backward(&handings);
    for (const runtime::GradientOrder::Handing& h : handings) {
      if (h.gradient) {
        STRATA_RETURN_IF_ERROR(hand_pending(rt, d, ids[h.tensor], h.tensor, step, mb, scratch, written));
      } else {
        STRATA_RETURN_IF_ERROR(rt.no_gradient(ids[h.tensor]));
        ++scratch.declared;
      }
    }
    return Status::Ok();
  };
  const double* loss = &scratch.at(m, step, mb);
  STRATA_RETURN_IF_ERROR(
      each_backward_use(rt, m, ids, step, mb, [&](int t, int k, bool last, const Lease& p) -> Status {
        float* pending = scratch.pending[static_cast<std::size_t>(t)].data();
        const void* pd = p.data();
        const std::uint64_t n = p.numel();
        STRATA_RETURN_IF_ERROR(rt.launch([loss, pd, pending, n, dt, t, step, mb, k, scale] {
          const float l = static_cast<float>(std::tanh(*loss));
          for (std::uint64_t i = 0; i < n; ++i) {
            const float c =
                contribution(load(pd, i, dt), mix(static_cast<std::uint64_t>(t), i), step, mb, k, l, scale);
            pending[i] = k == 0 ? c : c + pending[i];
          }
        }));
        if (!last) return Status::Ok();
        if (!m.late(t, step)) return offer(static_cast<std::uint32_t>(t));
        late.push_back(static_cast<std::uint32_t>(t));
        return Status::Ok();
      }));
  for (std::uint32_t t : late) STRATA_RETURN_IF_ERROR(offer(t));
  return end();
}

void sample(Runtime& rt, Trained& out) {
  const Stats& s = rt.stats();
  // The device's own peak covers every device allocation; the runtime's gpu high water
  // counts its streaming slots only (0 when everything is on the GPU).
  out.gpu_hw = std::max({out.gpu_hw, s.gpu_high_water_bytes, rt.device().memory_info().high_water_bytes});
  out.host_hw = std::max(out.host_hw, s.host_high_water_bytes);
  out.nvme_max = std::max(out.nvme_max, s.nvme_bytes);
  const runtime::Plan& plan = rt.plan();
  out.plan_gpu = std::max(out.plan_gpu, plan.gpu_bytes);
  out.plan_host = std::max(out.plan_host, plan.host_bytes);
  out.plan_nvme = std::max(out.plan_nvme, plan.nvme_bytes);
  out.all_gpu = plan.all_gpu;
  out.plan_summary = plan.summary();
  std::uint64_t states = 0, params = 0;
  for (const runtime::FamilyPlan& f : plan.families) {
    states += f.optim_home == runtime::Tier::kNvme ? 1 : 0;
    params += f.param_home == runtime::Tier::kNvme ? 1 : 0;
  }
  out.nvme_state_families = std::max(out.nvme_state_families, states);
  out.nvme_param_families = std::max(out.nvme_param_families, params);
}

Status read_back(Runtime& rt, const Draw& d, const std::vector<TensorId>& ids, Trained& out) {
  using runtime::StateKind;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::vector<float> v(d.model.tensors[i].numel);
    for (StateKind k : {StateKind::kParam, StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      std::fill(v.begin(), v.end(), 0.0f);
      const Status st = rt.read_tensor(ids[i], k, v);
      if (st.ok()) {
        out.values.emplace_back(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
      } else if (st.code() == StatusCode::kFailedPrecondition && k != StateKind::kParam) {
        out.values.push_back("absent");  // a kind this optimizer or tensor does not have
      } else {
        return st;
      }
    }
    STRATA_ASSIGN_OR_RETURN(std::int64_t steps, rt.tensor_steps(ids[i]));
    out.tensor_steps.push_back(steps);
  }
  return Status::Ok();
}

Status train_steps(Runtime& rt, const Draw& d, const std::vector<TensorId>& ids, Scratch& scratch,
                   Trained& out, const PhaseFn& phase, const std::string& who, std::string& where) {
  const auto enter = [&](std::string at) {
    phase(at);
    where = std::move(at);
  };
  const ModelDraw& m = d.model;
  for (int step = 0; step < m.steps; ++step) {
    if (m.loss_scaling) rt.set_grad_scale(1.0f / m.loss_scale);
    std::vector<bool> written(ids.size(), false);
    for (int mb = 0; mb < m.micro_batches; ++mb) {
      if (m.micro_batches > 1) STRATA_RETURN_IF_ERROR(rt.begin_micro_batch(mb == m.micro_batches - 1));
      enter(fmt::format("{}: step {} micro-batch {} forward", who, step + 1, mb));
      STRATA_RETURN_IF_ERROR(forward(rt, d, ids, step, mb, scratch));
      enter(fmt::format("{}: step {} micro-batch {} backward", who, step + 1, mb));
      STRATA_RETURN_IF_ERROR(backward(rt, d, ids, step, mb, scratch, written));
    }
    enter(fmt::format("{}: step {} step()", who, step + 1));
    STRATA_ASSIGN_OR_RETURN(StepStats st, rt.step());
    out.applied.push_back(st.applied);
    out.updates_deferred += st.updates_deferred;
    sample(rt, out);
  }
  out.late = m.any_late();
  out.kept_gradients = scratch.order.kept_total();
  out.declared_no_gradient = scratch.declared;
  enter(who + ": flush");
  STRATA_RETURN_IF_ERROR(rt.flush());
  enter(who + ": read_tensor");
  return read_back(rt, d, ids, out);
}

Attempt train(const Draw& d, Config cfg, const PhaseFn& phase, const std::string& who) {
  Attempt a;
  auto scratch = std::make_unique<Scratch>();  // outlives the runtime (its stream's launches use it)
  scratch->loss.assign(static_cast<std::size_t>(d.model.steps * d.model.micro_batches), 0.0);
  for (const TensorDraw& t : d.model.tensors)
    scratch->pending.emplace_back(t.tied || ordered_gradients(d) ? t.numel : 0);
  std::unique_ptr<Runtime> rt;
  std::vector<TensorId> ids;
  a.status = create_model(d, std::move(cfg), rt, ids, phase, who);
  if (!a.status.ok()) {
    a.stage = accepted(rt.get()) ? Attempt::Stage::kFailed : Attempt::Stage::kRefused;
    a.phase = who + ": creation";
    phase(who + ": destroy after refusal");
    rt.reset();
    return a;
  }
  a.out.chunk_elems = rt->layout().chunk_elems;
  sample(*rt, a.out);
  a.status = train_steps(*rt, d, ids, *scratch, a.out, phase, who, a.phase);
  if (!a.status.ok()) {
    a.stage = Attempt::Stage::kFailed;
    // Named in the phase: a destructor that then hangs or crashes still shows the error.
    const std::string error = a.status.to_string();
    phase(
        fmt::format("{}: destroy after an error in {}: {}", who, a.phase, error.substr(0, error.find('\n'))));
  } else {
    phase(who + ": destroy");
  }
  rt.reset();
  return a;
}

//! The sizes the budgets are drawn against, from a runtime with room for everything.
Result<ModelSizes> size_model(const Draw& d, const std::string& nvme_dir, const PhaseFn& phase) {
  // Room for any drawn model (at most kWidenedMaxElems, Note [Widened for NVMe]) on the
  // GPU, and for its host copies; a small host budget is quick to pin.
  const Budgets3 roomy{.gpu = 256 * kMiB, .host = 24 * kMiB, .nvme = 0};
  STRATA_ASSIGN_OR_RETURN(Config cfg, make_config(d, roomy, nvme_dir, true, 0));
  std::unique_ptr<Runtime> rt;
  std::vector<TensorId> ids;
  STRATA_RETURN_IF_ERROR(create_model(d, std::move(cfg), rt, ids, phase, "sizing"));
  const runtime::ChunkLayout& layout = rt->layout();
  const runtime::RuntimeOptions& o = rt->config().runtime;
  const std::uint64_t cb = runtime::dtype_bytes(o.compute_dtype);
  const std::uint64_t sb = kernels::dtype_size(o.state_dtype);
  const std::uint64_t states = kernels::optimizer_state_count(o.hyper);
  ModelSizes s{.chunk_elems = layout.chunk_elems, .families = layout.families.size()};
  for (const runtime::FamilyLayout& f : layout.families) {
    bool trains = false;
    for (TensorId t : f.tensors) trains = trains || !d.model.tensors[t].frozen;
    const std::uint64_t param = align_up(f.capacity_elems * cb, 4096);
    const std::uint64_t master = o.compute_dtype != DType::kF32 ? align_up(f.capacity_elems * 4, 4096) : 0;
    const std::uint64_t optim = trains ? master + states * align_up(f.capacity_elems * sb, 4096) : 0;
    s.slot_bytes = std::max(s.slot_bytes, param);
    s.params_bytes += param;
    s.optim_bytes += optim;
    s.optim_max = std::max(s.optim_max, optim);
    s.all_bytes += param + (trains ? param : 0) + optim;
  }
  return s;
}

}  // namespace
}  // namespace strata::contract

namespace strata::contract {
namespace {

//! A refusal's suggested budget: which one and its size as printed.
struct Suggestion {
  char budget = 0;  // 'g', 'h', 'n'
  std::uint64_t bytes = 0;
  std::string text;
};

std::optional<Suggestion> parse_suggestion(const std::string& message) {
  // The budget and the size come from one phrase: a refusal may name two ways out
  // ("gpu_budget ... needs X; raise gpu_budget. With these gpu and nvme budgets, raise
  // host_budget to at least Y"), and Y belongs to host_budget, not to the first budget named.
  static const std::regex least_re(
      R"(raise (host_budget|gpu_budget|nvme_budget|budgets\.(gpu|host|nvme)) to at least ([0-9.]+ ?[KMGT]?i?B))");
  static const std::regex needs_re(
      R"(needs ([0-9.]+ ?[KMGT]?i?B); raise (host_budget|gpu_budget|nvme_budget|budgets\.(gpu|host|nvme)))");
  std::smatch m;
  std::string name, size;
  if (std::regex_search(message, m, least_re)) {
    name = m[1].str();
    size = m[3].str();
  } else if (std::regex_search(message, m, needs_re)) {
    name = m[2].str();
    size = m[1].str();
  } else {
    return std::nullopt;
  }
  const std::string printed = size;
  std::erase(size, ' ');
  auto bytes = parse_bytes(size);
  if (!bytes.ok()) return std::nullopt;
  const char which =
      name.find("gpu") != std::string::npos ? 'g' : (name.find("host") != std::string::npos ? 'h' : 'n');
  return Suggestion{.budget = which, .bytes = *bytes, .text = name + " " + printed};
}

std::string first_line(const std::string& s) {
  std::string line = s.substr(0, s.find('\n'));
  return line.empty() ? "(empty message)" : line;
}

std::uint64_t& budget_of(Budgets3& b, char which) {
  return which == 'g' ? b.gpu : (which == 'h' ? b.host : b.nvme);
}

//! The smallest host budget that plans under `b`'s GPU and NVMe budgets, as the planner's
//! refusal at a tiny host budget states it ("... the smallest that plans"), or 0.
std::uint64_t smallest_host(const Draw& d, Budgets3 b, const std::string& nvme_dir, const PhaseFn& phase) {
  b.host = b.host_reserve + 4096;
  auto cfg = make_config(d, b, nvme_dir, false, 0);
  if (!cfg.ok()) return 0;
  std::unique_ptr<Runtime> rt;
  std::vector<TensorId> ids;
  const Status st = create_model(d, *std::move(cfg), rt, ids, phase, "nvme window");
  static const std::regex re(
      R"(raise host_budget to at least [^(]*\(([0-9]+) bytes\), the smallest that plans)");
  std::smatch m;
  const std::string message = st.message();
  if (st.ok() || !std::regex_search(message, m, re)) return 0;
  return std::stoull(m[1].str());
}

//! A widened model's host budget in the NVMe window (Note [Contract run], 2).
void host_in_nvme_window(const Draw& d, Budgets3& b, const std::string& nvme_dir, const PhaseFn& phase,
                         RunReport& r) {
  const std::uint64_t lo = smallest_host(d, b, nvme_dir, phase);
  Budgets3 without_nvme = b;
  without_nvme.nvme = 0;
  const std::uint64_t hi = smallest_host(d, without_nvme, nvme_dir, phase);
  r.details["nvme_window"] = {{"smallest_host", lo}, {"smallest_host_without_nvme", hi}};
  if (lo == 0 || hi <= lo + 4096) return;  // no window: the drawn host budget stands
  b.host = between(static_cast<double>(lo), static_cast<double>(hi - 4096), d.config.host_pos);
}

//! Trains under `b`; with seek_minimum the targeted budget starts tiny and each
//! refusal's suggestion is applied as printed (Note [Contract run], 2).
Attempt run_under_test(const Draw& d, Budgets3& b, const std::string& nvme_dir, const PhaseFn& phase,
                       RunReport& r) {
  if (d.config.seek_minimum == 1) b.host = b.host_reserve + 4096;
  if (d.config.seek_minimum == 2) b.gpu = 4096;
  nlohmann::json applied = nlohmann::json::array();
  char last = 0;
  StatusCode last_code = StatusCode::kOk;
  for (int tries = 0;; ++tries) {
    auto cfg = make_config(d, b, nvme_dir, false, 0);
    if (!cfg.ok())
      return Attempt{.stage = Attempt::Stage::kRefused, .status = cfg.status(), .phase = "config"};
    Attempt a = train(d, *std::move(cfg), phase, "run");
    if (d.config.seek_minimum == 0 || a.stage != Attempt::Stage::kRefused || tries == 6) return a;
    const std::optional<Suggestion> s = parse_suggestion(a.status.message());
    if (!s) return a;  // a refusal without a budget to raise: a plain refusal
    // Runtime::create's check (validate_options: 3 slots of layout.chunk_elems) runs
    // before any tensor is registered, so its figure is a lower bound: a tensor larger
    // than the chunk gets a chunk of its own, which only the plan sees. A refusal that
    // follows a create-time one may raise the same budget again; a refusal after a
    // planner's minimum (OutOfBudget, Note [Host room]) may not.
    if (s->budget == last && last_code != StatusCode::kInvalidArgument) {
      r.outcome = "bad_refusal";
      r.reason = fmt::format("the suggested minimum {} is refused again: {}",
                             applied.back().get<std::string>(), first_line(a.status.to_string()));
      r.details["suggestions_applied"] = applied;
      return a;
    }
    budget_of(b, s->budget) = s->bytes;
    applied.push_back(s->text);
    last = s->budget;
    last_code = a.status.code();
  }
}

//! The first difference between the run's read-back and the reference's, or "".
std::string compare(const Draw& d, const Trained& run, const Trained& ref) {
  static const char* kKinds[] = {"param", "master", "state0", "state1"};
  if (run.applied != ref.applied) return "steps applied/skipped differ from the reference";
  for (std::size_t i = 0; i < run.values.size() && i < ref.values.size(); ++i) {
    if (run.values[i] == ref.values[i]) continue;
    const std::string& name = d.model.tensors[i / 4].name;
    const char* kind = kKinds[i % 4];
    if (run.values[i].size() != ref.values[i].size())
      return fmt::format("{} {}: {} vs {} in the reference", name, kind,
                         run.values[i] == "absent" ? "absent" : "present",
                         ref.values[i] == "absent" ? "absent" : "present");
    std::size_t e = 0;
    while (e + 4 <= run.values[i].size() && std::memcmp(&run.values[i][e], &ref.values[i][e], 4) == 0) e += 4;
    std::uint32_t a = 0, b = 0;
    std::memcpy(&a, &run.values[i][e], 4);
    std::memcpy(&b, &ref.values[i][e], 4);
    float fa = 0, fb = 0;
    std::memcpy(&fa, &a, 4);
    std::memcpy(&fb, &b, 4);
    return fmt::format("{} {}[{}] = {:#010x} ({}) vs {:#010x} ({}) in the all-resident reference", name, kind,
                       e / 4, a, fa, b, fb);
  }
  if (run.values.size() != ref.values.size()) return "read-back sizes differ";
  for (std::size_t t = 0; t < run.tensor_steps.size(); ++t) {
    if (run.tensor_steps[t] != ref.tensor_steps[t])
      return fmt::format("{}: {} optimizer steps vs {} in the reference", d.model.tensors[t].name,
                         run.tensor_steps[t], ref.tensor_steps[t]);
  }
  return "";
}

void check_tiers(const Trained& t, const Budgets3& b, RunReport& r) {
  std::string over, above;
  const auto check = [&](const char* tier, std::uint64_t hw, std::uint64_t budget, std::uint64_t plan) {
    if (hw > budget)
      over += fmt::format("{}{} high water {} > budget {}", over.empty() ? "" : "; ", tier, hw, budget);
    if (hw > plan)
      above += fmt::format("{}{} high water {} > plan {}", above.empty() ? "" : "; ", tier, hw, plan);
  };
  check("gpu", t.gpu_hw, b.gpu, t.plan_gpu);
  check("host", t.host_hw, b.host, t.plan_host);
  check("nvme", t.nvme_max, b.nvme, t.plan_nvme);
  r.budget_overrun = !over.empty();
  r.overrun_reason = over;
  r.above_plan = !above.empty();
  r.above_plan_reason = above;
}

nlohmann::json trained_json(const Trained& t) {
  return {{"chunk_elems", t.chunk_elems},
          {"gpu_high_water", t.gpu_hw},
          {"host_high_water", t.host_hw},
          {"nvme_bytes_max", t.nvme_max},
          {"plan_gpu_max", t.plan_gpu},
          {"plan_host_max", t.plan_host},
          {"plan_nvme_max", t.plan_nvme},
          {"all_gpu", t.all_gpu},
          {"plan", t.plan_summary},
          {"late", t.late},
          {"kept_gradients", t.kept_gradients},
          {"declared_no_gradient", t.declared_no_gradient},
          {"updates_deferred", t.updates_deferred},
          {"nvme_state_families", t.nvme_state_families},
          {"nvme_param_families", t.nvme_param_families}};
}

void compare_with_reference(const Draw& d, const Trained& run, const ModelSizes& sizes, const PhaseFn& phase,
                            Inject inject, RunReport& r) {
  const std::uint64_t roomy = align_up(sizes.all_bytes + sizes.all_bytes / 4 + 4 * sizes.slot_bytes, kMiB);
  const Budgets3 ref_budgets{.gpu = roomy, .host = roomy + 2 * kMiB, .nvme = 0};
  auto cfg = make_config(d, ref_budgets, "", true, run.chunk_elems);
  Attempt ref = cfg.ok()
                    ? train(d, *std::move(cfg), phase, "reference")
                    : Attempt{.stage = Attempt::Stage::kFailed, .status = cfg.status(), .phase = "config"};
  if (ref.stage != Attempt::Stage::kDone || !ref.out.all_gpu) {
    // Not the runtime under test: the reference itself. Reported as a failure all the same.
    r.outcome = "failed";
    r.phase = ref.phase;
    r.reason = ref.stage != Attempt::Stage::kDone
                   ? "all-resident reference: " + first_line(ref.status.to_string())
                   : "all-resident reference was not planned all on the GPU: " + ref.out.plan_summary;
    return;
  }
  r.details["reference"] = trained_json(ref.out);
  r.details["compared"] = {{"states", ref.out.values.size()}, {"steps", ref.out.applied.size()}};
  Trained mine = run;
  if (inject == Inject::kInexact && !mine.values.empty() && !mine.values[0].empty()) mine.values[0][0] ^= 1;
  r.inexact_reason = compare(d, mine, ref.out);
  r.inexact = !r.inexact_reason.empty();
}

}  // namespace

RunReport execute_run(const Draw& d, const std::string& nvme_dir, const PhaseFn& phase, Inject inject) {
  RunReport r;
  r.seed = d.seed;
  Result<ModelSizes> sizes = size_model(d, nvme_dir, phase);
  if (!sizes.ok()) {  // (CAME: refused by design, docs/config.md)
    r.outcome = sizes.status().message().empty() ? "bad_refusal" : "refused";
    r.reason = first_line(sizes.status().to_string());
    r.phase = "sizing";
    return r;
  }
  const Budgets drawn = budgets_for(d.config, *sizes);
  Budgets3 b{.gpu = drawn.gpu, .host = drawn.host, .nvme = drawn.nvme};
  b.host_reserve =
      static_cast<std::uint64_t>(d.config.host_reserve_frac * static_cast<double>(b.host)) / 4096 * 4096;
  r.details["sizes"] = {{"chunk_elems", sizes->chunk_elems},   {"families", sizes->families},
                        {"all_bytes", sizes->all_bytes},       {"slot_bytes", sizes->slot_bytes},
                        {"params_bytes", sizes->params_bytes}, {"optim_bytes", sizes->optim_bytes},
                        {"optim_max", sizes->optim_max}};
  if (d.config.widened && d.config.nvme_window && d.config.seek_minimum == 0)
    host_in_nvme_window(d, b, nvme_dir, phase, r);
  Attempt a = run_under_test(d, b, nvme_dir, phase, r);
  r.details["budgets"] = {
      {"gpu", b.gpu}, {"host", b.host}, {"nvme", b.nvme}, {"host_reserve", b.host_reserve}};
  if (r.outcome == "bad_refusal") return r;
  if (a.stage == Attempt::Stage::kRefused) {
    r.outcome = a.status.message().empty() ? "bad_refusal" : "refused";
    r.reason = first_line(a.status.to_string());
    return r;
  }
  r.details["run"] = trained_json(a.out);
  if (a.stage == Attempt::Stage::kFailed) {
    r.outcome = "failed";
    r.reason = first_line(a.status.to_string());
    r.phase = a.phase;
    return r;
  }
  if (inject == Inject::kHang) {
    phase("run: hanging on purpose (--inject hang)");
    for (;;) ::pause();
  }
  if (inject == Inject::kCrash) std::raise(SIGSEGV);
  if (inject == Inject::kAbovePlan) a.out.gpu_hw = std::max(a.out.gpu_hw, a.out.plan_gpu + 1);
  r.outcome = "trained";
  // The checks' own tests: a measurement past the budget or the plan must be reported.
  if (inject == Inject::kOverrun) a.out.host_hw = b.host + 1;
  check_tiers(a.out, b, r);
  compare_with_reference(d, a.out, *sizes, phase, inject, r);
  return r;
}

nlohmann::json to_json(const RunReport& r) {
  nlohmann::json j = {{"seed", r.seed}, {"outcome", r.outcome}, {"reason", r.reason}, {"phase", r.phase}};
  j["budget_overrun"] = r.budget_overrun;
  j["above_plan"] = r.above_plan;
  j["inexact"] = r.inexact;
  j["overrun_reason"] = r.overrun_reason;
  j["above_plan_reason"] = r.above_plan_reason;
  j["inexact_reason"] = r.inexact_reason;
  j["details"] = r.details;
  return j;
}

}  // namespace strata::contract
