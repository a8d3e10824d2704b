#include "contract_draw.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace strata::contract {

double Rng::log_uniform(double lo, double hi) {
  if (hi <= lo) return lo;
  return std::exp(std::log(lo) + unit() * (std::log(hi) - std::log(lo)));
}

std::uint64_t run_seed(std::uint64_t seed, std::uint64_t index) {
  Rng r(seed ^ (index * 0xd1b54a32d192ed03ull));
  return r.next() >> 1;  // < 2^63: prints the same as a signed or unsigned JSON number
}

bool ModelDraw::used(int tensor, int step, int micro) const {
  const TensorDraw& t = tensors[static_cast<std::size_t>(tensor)];
  if (t.unused_period == 0) return true;
  return (4 * step + micro) % t.unused_period != t.unused_phase;
}

namespace {

std::uint64_t draw_numel(Rng& r) {
  const double u = r.unit();
  if (u < 0.2) return static_cast<std::uint64_t>(r.range(1, 64));  // odd and tiny sizes
  if (u < 0.55) return static_cast<std::uint64_t>(r.range(65, 5000));
  if (u < 0.9) return static_cast<std::uint64_t>(r.range(5001, 40000));
  return static_cast<std::uint64_t>(r.range(40001, 150000));  // larger than small chunks: a family of its own
}

void draw_tensors(Rng& r, ModelDraw& m) {
  const int n = static_cast<int>(r.range(1, 10));
  std::uint64_t total = 0;
  for (int i = 0; i < n; ++i) {
    TensorDraw t;
    t.name = fmt::format("t{}", i);  // (not "t" + to_string: GCC 12 -Wrestrict)
    std::uint64_t numel = draw_numel(r);
    if (total + numel > 400000) numel = static_cast<std::uint64_t>(r.range(1, 3000));
    total += numel;
    if (numel > 16 && r.chance(0.4)) {  // 2-D: rows x cols with the remainder dropped
      const std::uint64_t rows = static_cast<std::uint64_t>(r.range(2, 97));
      const std::uint64_t cols = std::max<std::uint64_t>(1, numel / rows);
      t.shape = {static_cast<std::int64_t>(rows), static_cast<std::int64_t>(cols)};
      t.numel = rows * cols;
    } else {
      t.shape = {static_cast<std::int64_t>(numel)};
      t.numel = numel;
    }
    t.frozen = r.chance(0.1);
    t.tied = r.chance(0.2);
    if (r.chance(0.2)) {
      t.unused_period = static_cast<int>(r.range(2, 5));
      t.unused_phase = static_cast<int>(r.range(0, t.unused_period - 1));
    }
    m.tensors.push_back(std::move(t));
  }
  m.tensors[static_cast<std::size_t>(r.range(0, n - 1))].frozen = false;  // at least one trains
  for (int i = 0; i < n; ++i) m.forward_order.push_back(i);
  for (int i = n - 1; i > 0; --i) std::swap(m.forward_order[i], m.forward_order[r.range(0, i)]);
  for (int i = 0; i < n; ++i) {
    if (!m.tensors[static_cast<std::size_t>(i)].tied) continue;
    const auto first = std::find(m.forward_order.begin(), m.forward_order.end(), i);
    const auto after = first - m.forward_order.begin() + 1;
    const auto span = static_cast<std::int64_t>(m.forward_order.size()) - after;
    m.forward_order.insert(m.forward_order.begin() + after + r.range(0, span), i);
  }
}

void draw_training(Rng& r, ModelDraw& m) {
  m.micro_batches = static_cast<int>(r.range(1, 4));
  // CAME: the runtime refuses it at creation by design (docs/config.md, "optimizer"):
  // drawn rarely, it checks that refusal and its message.
  m.optimizer = r.chance(0.04)
                    ? "came"
                    : r.pick<std::string>({"adamw", "adam", "lamb", "lars", "sgd", "lion", "adagrad"});
  if (m.optimizer == "sgd") {
    m.momentum = r.chance(0.3) ? 0.0f : 0.9f;
    m.nesterov = m.momentum > 0.0f && r.chance(0.5);
  } else if (m.optimizer == "lars") {
    m.momentum = r.chance(0.5) ? 0.0f : 0.9f;
  }
  m.lr = static_cast<float>(r.log_uniform(1e-4, 1e-2)) * (m.optimizer == "lion" ? 0.1f : 1.0f);
  m.weight_decay = r.chance(0.5) ? 0.0f : 0.01f;
  const double c = r.unit();
  m.compute = c < 0.6 ? "fp32" : (c < 0.85 ? "bf16" : "fp16");
  const bool adam_family = m.optimizer == "adam" || m.optimizer == "adamw" || m.optimizer == "lamb";
  m.states = adam_family && r.chance(0.4) ? "bf16" : "fp32";
  m.clip_max_norm = r.chance(0.3) ? r.log_uniform(0.05, 5.0) : 0.0;
  m.loss_scaling = r.chance(0.3);
  if (m.loss_scaling) {
    m.loss_scale = std::ldexp(1.0f, static_cast<int>(r.range(0, 12)));
    if (r.chance(0.5)) {
      m.inf_step = static_cast<int>(r.range(0, m.steps - 1));
      std::vector<int> trainable;
      for (int t = 0; t < static_cast<int>(m.tensors.size()); ++t)
        if (m.trainable(t)) trainable.push_back(t);
      m.inf_tensor = r.pick(trainable);
    }
  }
}

void draw_config(Rng& r, ConfigDraw& c, bool uring) {
  if (r.chance(0.5)) {
    c.chunk_elems = 0;
    c.chunk_elems_min = std::uint64_t{4096} << r.range(0, 3);
    c.chunk_elems_max = c.chunk_elems_min << r.range(0, 4);
  } else {
    c.chunk_elems = 4096 * static_cast<std::uint64_t>(r.range(1, 16));
  }
  c.prefetch = r.chance(0.85);
  c.prefetch_depth_max = static_cast<std::uint32_t>(c.prefetch ? r.range(1, 6) : r.range(0, 3));
  c.grad_staging_slots = static_cast<std::uint32_t>(r.range(1, 4));
  c.nvme_families_in_flight = static_cast<std::uint32_t>(r.range(1, 4));
  c.allow_nvme_params = r.chance(0.85);
  c.allow_gpu_optimizer = r.chance(0.9);
  c.host_reserve_frac = r.chance(0.8) ? 0.0 : 0.3 * r.unit();
  c.engine = uring ? r.pick<std::string>({"uring", "posix", "auto"}) : r.pick<std::string>({"posix", "auto"});
  c.threads = static_cast<int>(r.range(1, 2));
  c.gpu_pos = r.unit();
  c.host_pos = r.unit();
  c.nvme_pos = r.unit();
  c.nvme = r.chance(0.75);
  if (r.chance(0.2)) c.seek_minimum = r.chance(0.6) ? 1 : 2;
  c.nvme_window = c.nvme && r.chance(0.5);
  if (c.nvme_window && r.chance(0.5)) c.nvme_families_in_flight = 1;  // a wider window
}

//! Note [Widened for NVMe]
//! The narrow models drawn above (1 to 10 tensors, chunks up to 64 K elements) are so
//! small that the NVMe pipeline's staging (landing slots, prefetch slots, the families in
//! flight and the held gradients: a dozen slots or more) needs more host room than keeping
//! every param and state on host, so the planner rarely homes states on NVMe (2 of 600 runs
//! in the fifteenth session) and the NVMe paths went untested by the campaign. A widened
//! model cuts its tensors to at most 16 K elements, adds 16 to 48 more no larger than its
//! largest, and searches chunks of 4 K to 16 K elements, so that the staging is a small
//! share of the params and states. It stays below kWidenedMaxElems, which size_model's
//! roomy budgets hold. Its host budget in the NVMe window is the planner's own: between the
//! smallest host budget that plans with the drawn GPU and NVMe budgets and the smallest
//! that plans without NVMe (Note [Contract run], 2), so that states really go to NVMe.
void widen_for_nvme(Rng& r, Draw& d) {
  ModelDraw& m = d.model;
  std::uint64_t total = 0, largest = 0;
  for (TensorDraw& t : m.tensors) {
    if (t.numel > kWidenedLargest) {  // one large tensor's slot would make the staging large again
      const auto rows = t.shape.size() == 2 ? static_cast<std::uint64_t>(t.shape[0]) : 1;
      const std::uint64_t cols = std::max<std::uint64_t>(1, kWidenedLargest / rows);
      t.shape = t.shape.size() == 2 ? std::vector<std::int64_t>{static_cast<std::int64_t>(rows),
                                                                static_cast<std::int64_t>(cols)}
                                    : std::vector<std::int64_t>{static_cast<std::int64_t>(kWidenedLargest)};
      t.numel = rows * cols;
    }
    total += t.numel;
    largest = std::max(largest, t.numel);
  }
  const bool late = m.any_late();
  const auto hi = static_cast<std::int64_t>(std::clamp<std::uint64_t>(largest, 2048, kWidenedLargest));
  const auto extra = r.range(16, 48);
  for (std::int64_t i = 0; i < extra; ++i) {
    const auto numel = static_cast<std::uint64_t>(r.range(hi / 4, hi));
    if (total + numel > kWidenedMaxElems) break;
    total += numel;
    TensorDraw t;
    t.name = fmt::format("t{}", m.tensors.size());
    t.shape = {static_cast<std::int64_t>(numel)};
    t.numel = numel;
    t.frozen = r.chance(0.05);
    t.late = late && r.chance(0.5);
    const auto index = static_cast<int>(m.tensors.size());
    m.tensors.push_back(std::move(t));
    const auto at = r.range(0, static_cast<std::int64_t>(m.forward_order.size()));
    m.forward_order.insert(m.forward_order.begin() + at, index);
  }
  d.config.chunk_elems = 0;
  d.config.chunk_elems_min = 4096;
  d.config.chunk_elems_max = std::uint64_t{4096} << r.range(0, 2);
  d.config.widened = true;
}

}  // namespace

std::uint64_t between(double lo, double hi, double pos) {
  const double v = hi <= lo ? lo : std::exp(std::log(lo) + pos * (std::log(hi) - std::log(lo)));
  return (static_cast<std::uint64_t>(v) + 4095) / 4096 * 4096;
}

bool ModelDraw::any_late() const {
  return std::any_of(tensors.begin(), tensors.end(), [](const TensorDraw& t) { return t.late; });
}

Draw draw_run(std::uint64_t seed, bool uring, int steps) {
  Draw d;
  d.seed = seed;
  Rng r(seed);
  d.model.steps = steps;
  draw_tensors(r, d.model);
  draw_training(r, d.model);
  draw_config(r, d.config, uring);
  // Drawn last, so the draws before it stay as the regression seeds recorded them.
  if (r.chance(0.35)) {
    for (TensorDraw& t : d.model.tensors) t.late = r.chance(0.5);
  }
  if (r.chance(0.5)) d.config.deferred_updates = static_cast<std::uint32_t>(r.range(1, 4));
  if (d.config.nvme && r.chance(0.5)) widen_for_nvme(r, d);  // Note [Widened for NVMe]
  return d;
}

Budgets budgets_for(const ConfigDraw& c, const ModelSizes& s) {
  Budgets b;
  const double slot = static_cast<double>(s.slot_bytes);
  const double state = static_cast<double>(s.params_bytes + s.optim_bytes);
  // GPU: from two slots (below the three every plan needs) to past everything on the GPU.
  b.gpu = between(2.5 * slot, 1.25 * static_cast<double>(s.all_bytes) + slot, c.gpu_pos);
  // Host: from a tenth of the params and states (32 KiB at least) to three times them with
  // room for staging (a few slots per prefetch and NVMe family in flight).
  b.host = between(std::max(32768.0, 0.1 * state), 3.0 * state + 16.0 * slot, c.host_pos);
  // NVMe: from a quarter of the params and states to four times them.
  b.nvme = c.nvme ? between(0.25 * state + 4096.0, 4.0 * state + 8.0 * slot, c.nvme_pos) : 0;
  if (c.nvme_window) {
    // What the planner reserves before it places homes when states go to NVMe
    // (planner.cpp: landing slots, param staging, NVMe families in flight).
    const double in_flight = static_cast<double>(c.nvme_families_in_flight);
    const double staging = static_cast<double>(c.grad_staging_slots + c.deferred_updates) * slot +
                           in_flight * (static_cast<double>(s.optim_max) + slot) +
                           (c.allow_nvme_params ? static_cast<double>(c.prefetch_depth_max + 2) * slot : 0.0);
    // Below the landing slots, params and states: something must go to NVMe.
    const double all_host = static_cast<double>(c.grad_staging_slots) * slot + state;
    b.host = between(std::min(staging, 0.9 * all_host), all_host - 4096.0, c.host_pos);
    b.nvme = between(state + in_flight * (static_cast<double>(s.optim_max) + slot), 4.0 * state + 8.0 * slot,
                     c.nvme_pos);
  }
  return b;
}

nlohmann::json to_json(const Draw& d) {
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorDraw& t : d.model.tensors) {
    tensors.push_back({{"name", t.name},
                       {"shape", t.shape},
                       {"frozen", t.frozen},
                       {"tied", t.tied},
                       {"unused_period", t.unused_period},
                       {"unused_phase", t.unused_phase},
                       {"late", t.late}});
  }
  const ModelDraw& m = d.model;
  const ConfigDraw& c = d.config;
  return {{"seed", d.seed},
          {"model",
           {{"tensors", tensors},
            {"forward_order", m.forward_order},
            {"micro_batches", m.micro_batches},
            {"steps", m.steps},
            {"optimizer", m.optimizer},
            {"momentum", m.momentum},
            {"nesterov", m.nesterov},
            {"lr", m.lr},
            {"weight_decay", m.weight_decay},
            {"compute", m.compute},
            {"states", m.states},
            {"clip_max_norm", m.clip_max_norm},
            {"loss_scaling", m.loss_scaling},
            {"loss_scale", m.loss_scale},
            {"inf_step", m.inf_step},
            {"inf_tensor", m.inf_tensor}}},
          {"config",
           {{"chunk_elems", c.chunk_elems},
            {"chunk_elems_min", c.chunk_elems_min},
            {"chunk_elems_max", c.chunk_elems_max},
            {"prefetch", c.prefetch},
            {"prefetch_depth_max", c.prefetch_depth_max},
            {"grad_staging_slots", c.grad_staging_slots},
            {"nvme_families_in_flight", c.nvme_families_in_flight},
            {"allow_nvme_params", c.allow_nvme_params},
            {"allow_gpu_optimizer", c.allow_gpu_optimizer},
            {"host_reserve_frac", c.host_reserve_frac},
            {"engine", c.engine},
            {"threads", c.threads},
            {"nvme", c.nvme},
            {"seek_minimum", c.seek_minimum == 0 ? "no" : (c.seek_minimum == 1 ? "host" : "gpu")},
            {"nvme_window", c.nvme_window},
            {"deferred_updates", c.deferred_updates},
            {"widened", c.widened}}}};
}

}  // namespace strata::contract
