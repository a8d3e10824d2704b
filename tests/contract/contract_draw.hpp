#pragma once
// strata-contract: what one run draws from its seed — a random model (tensors,
// ties, unused steps, micro-batches, optimizer, dtypes, clipping, loss scaling)
// and a random configuration (budgets, placement knobs, engine, chunk sizes).
// Everything here is a pure function of the seed, so `--seeds N` replays a run.

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace strata::contract {

//! splitmix64: a small, portable generator (std:: distributions differ between
//! standard libraries; a replayed seed must draw the same run everywhere).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  //! Uniform in [lo, hi].
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return unit() < p; }
  //! Log-uniform in [lo, hi] (lo > 0).
  double log_uniform(double lo, double hi);
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[static_cast<std::size_t>(range(0, static_cast<std::int64_t>(v.size()) - 1))];
  }

 private:
  std::uint64_t state_;
};

//! The most elements a widened model holds (Note [Widened for NVMe]); narrow ones hold 400 000.
inline constexpr std::uint64_t kWidenedMaxElems = 600000;
//! The largest tensor of a widened model, in elements.
inline constexpr std::uint64_t kWidenedLargest = 16384;

//! The seed of run `index` of a campaign started with `seed`.
std::uint64_t run_seed(std::uint64_t seed, std::uint64_t index);

struct TensorDraw {
  std::string name;
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 0;
  bool frozen = false;
  bool tied = false;      //!< used at two points of forward (and so two gradient writes)
  int unused_period = 0;  //!< 0: used in every micro-batch; else unused when (4*step+mb) % period == phase
  int unused_phase = 0;
  //! From the second step on its gradient is handed after every other tensor's, as
  //! torch hands the weights' under one autocast region over several steps (Note
  //! [Gradients in pieces]): the families it shares wait incomplete.
  bool late = false;
};

//! The model and its training: everything the all-resident reference shares.
struct ModelDraw {
  std::vector<TensorDraw> tensors;
  std::vector<int> forward_order;  //!< tensor indices in forward order (a tied one twice)
  int micro_batches = 1;
  int steps = 4;
  std::string optimizer = "adamw";  //!< adam, adamw, lamb, lars, sgd, lion, adagrad, came
  float momentum = 0.0f;            //!< sgd, lars
  bool nesterov = false;            //!< sgd
  float lr = 1e-3f;
  float weight_decay = 0.0f;
  std::string compute = "fp32";  //!< fp32, bf16, fp16
  std::string states = "fp32";   //!< fp32, bf16 (adam family)
  double clip_max_norm = 0.0;
  bool loss_scaling = false;
  float loss_scale = 1.0f;  //!< gradients are multiplied by it; set_grad_scale(1 / it)
  int inf_step = -1;        //!< with loss scaling: the step whose first micro-batch writes an Inf
  int inf_tensor = -1;
  bool used(int tensor, int step, int micro) const;
  bool trainable(int tensor) const { return !tensors[static_cast<std::size_t>(tensor)].frozen; }
  //! Some tensor's gradient comes late: every gradient goes through runtime::GradientOrder.
  bool any_late() const;
  bool late(int tensor, int step) const { return step > 0 && tensors[static_cast<std::size_t>(tensor)].late; }
};

//! The configuration under test. Budgets are drawn as positions in [0, 1] and
//! turned into bytes once the model's chunk sizes are known (budgets_for).
struct ConfigDraw {
  std::uint64_t chunk_elems = 0;  //!< 0: the runtime's search between min and max
  std::uint64_t chunk_elems_min = 4096, chunk_elems_max = 65536;
  bool prefetch = true;
  std::uint32_t prefetch_depth_max = 4;
  std::uint32_t grad_staging_slots = 2;
  std::uint32_t nvme_families_in_flight = 2;
  bool allow_nvme_params = true;
  bool allow_gpu_optimizer = true;
  double host_reserve_frac = 0.0;  //!< of the host budget
  std::string engine = "posix";
  int threads = 1;
  double gpu_pos = 0.5, host_pos = 0.5, nvme_pos = 0.5;  //!< in [0, 1]
  bool nvme = true;                                      //!< an NVMe tier at all
  //! 0: the drawn budgets; 1: host, 2: gpu — first refused at a tiny budget, then
  //! run at the minimum the refusal suggests (it must train: issue #24 item 2).
  int seek_minimum = 0;
  //! Host drawn inside the window where the planner puts states (and params) on NVMe:
  //! from the NVMe pipeline's staging up to the params and states (drawn last, so the
  //! draws before it stay as the regression seeds recorded them).
  bool nvme_window = false;
  //! plan.deferred_updates (Note [Deferred updates] in
  //! runtime/src/pipeline/deferred_updates.cpp); drawn last, after nvme_window's reason.
  std::uint32_t deferred_updates = 0;
  //! The model was widened with many small tensors in small chunks, so that states go to
  //! NVMe (Note [Widened for NVMe] in contract_draw.cpp); drawn last.
  bool widened = false;
};

struct Draw {
  std::uint64_t seed = 0;
  ModelDraw model;
  ConfigDraw config;
};

//! Draws run `seed`. `uring` says whether io_uring works here (else engines are posix/auto).
Draw draw_run(std::uint64_t seed, bool uring, int steps);

//! Sizes of the model under a layout, known after the first init (from the runtime's chunk layout).
struct ModelSizes {
  std::uint64_t chunk_elems = 0;
  std::uint64_t families = 0;
  std::uint64_t all_bytes = 0;   //!< every chunk of every family (the all-on-GPU plan)
  std::uint64_t slot_bytes = 0;  //!< the largest param or grad chunk
  std::uint64_t params_bytes = 0, optim_bytes = 0;
  std::uint64_t optim_max = 0;  //!< the largest family's master and states
};

struct Budgets {
  std::uint64_t gpu = 0, host = 0, nvme = 0;
};

//! Budgets from the draw's positions: each spans from below the smallest working
//! set (so some runs are refused) to past everything fitting.
Budgets budgets_for(const ConfigDraw& c, const ModelSizes& s);

//! A budget between lo and hi at the draw's position pos (log-scaled, whole 4 KiB pages).
std::uint64_t between(double lo, double hi, double pos);

nlohmann::json to_json(const Draw& d);

}  // namespace strata::contract
