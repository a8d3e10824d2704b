#pragma once
// strata.hpp: the C++ face of strata. A Runtime built from a Config places a
// model's state (params, grads, optimizer states) in chunks on the GPU, pinned
// host memory and NVMe, moves it ahead of use and runs the optimizer where the
// states live. A complete trainer:
//
//   #include <strata/strata.hpp>
//
//   int main() {
//     // 1. Settings: in code, or from a JSON file (docs/config.md lists every key).
//     auto config = strata::Config::from_json_text(R"({
//         "device":    {"kind": "sim", "budget": "64MiB", "h2d_bandwidth": "12GiB"},
//         "budgets":   {"gpu": "32MiB", "host": "256MiB", "nvme": "1GiB"},
//         "nvme":      {"dirs": ["/tmp/strata-nvme"]},
//         "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01}})");
//     if (!config.ok()) { fmt::print(stderr, "{}\n", config.status().to_string()); return 1; }
//
//     // 2. The runtime owns the device (sim or cuda) and every tier.
//     auto rt = strata::Runtime::create(*config);
//     if (!rt.ok()) { ... }
//     strata::Runtime& r = **rt;
//
//     // 3. Register every tensor, then give them initial values (the first
//     //    init_tensor, lease or step fixes the chunk layout).
//     strata::TensorId w = *r.register_tensor("fc.weight", {512, 512});
//     std::vector<float> init(512 * 512, 0.01f);
//     r.init_tensor(w, init);
//
//     // 4. Train: leases pin a tensor's state on a tier for as long as they live.
//     for (int step = 0; step < 100; ++step) {
//       {  // forward
//         auto p = *r.param(w);                       // device memory on cuda, host on sim
//         r.launch([&] { forward(p.as<float>()); });  // runs on the compute stream
//       }
//       {  // backward: the first gradient lease marks the start of backward
//         auto p = *r.param(w);
//         auto g = *r.grad(w);                        // Access::kWrite: overwrite
//         r.launch([&] { backward(p.as<float>(), g.as<float>()); });
//       }
//       auto stats = r.step();                        // optimizer, re-planning
//       if (!stats.ok()) { ... }
//     }
//     r.write_chrome_trace("trace.json");             // chrome://tracing / Perfetto
//   }
//
// Ownership: Runtime::create returns a unique_ptr the caller owns; it owns the
// device and all memory. Leases borrow from the Runtime and must be destroyed
// before it (checked). TensorIds are plain indices.
//
// Threading: one training thread makes every call (as runtime::Runtime; see
// Note [Runtime threading] in runtime/runtime.hpp). Functions given to launch()
// run on the device's compute stream thread (sim) or as host callbacks (cuda).
//
// Failure: every call that can fail returns Status or Result<T> with a message
// naming the setting, tensor, budget or path and what to do. Misuse (a lease
// outliving its Runtime, an id from another Runtime) is a checked programmer error.
// No exceptions are thrown.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/kernels/hyper.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata {

using runtime::Access;
using runtime::Lease;
using runtime::StateKind;
using runtime::StepStats;
using runtime::TensorId;
using runtime::Where;

//! Every setting of a Runtime. Plain value: fill it in code, or read it from JSON
//! (docs/config.md). `device` is the device factory's, `runtime` the chunk
//! runtime's own options (budgets, optimizer and hyperparameters, dtypes, NVMe
//! directories, layout and plan knobs); Runtime::create validates both.
struct Config {
  memory::DeviceOptions device;
  runtime::RuntimeOptions runtime;

  //! Defaults with the optimizer's own default hyperparameters (torch's).
  Config();
  //! Sets one setting from text by its JSON path, e.g. ("budgets.gpu", "256MiB"),
  //! ("optimizer.name", "lamb"), ("optimizer.lr", "3e-4"), ("nvme.dirs", "/a,/b").
  //! InvalidArgument names the key and the value and says what is accepted
  //! (unknown keys are listed with the known ones of their section).
  Status set(std::string_view key, std::string_view value);
  //! Parses a JSON object (sections device, budgets, nvme, optimizer, precision,
  //! plan, layout and top-level keys; docs/config.md). Rejects unknown keys, wrong
  //! JSON types and bad values by name. Never throws.
  static Result<Config> from_json_text(std::string_view text);
  //! Reads `path` and parses it as from_json_text; NotFound / PermissionDenied name the
  //! path; InvalidArgument when it is not a regular file of at most kConfigBytesMax.
  static Result<Config> from_json_file(const std::filesystem::path& path);
  //! Applies the keys of a JSON object over this config (keys it does not name
  //! keep their values), with the checks of from_json_text. All or nothing: on an
  //! error this config is unchanged.
  Status update_from_json_text(std::string_view text);
  //! update_from_json_text with the text of `path` (as from_json_file).
  Status update_from_json_file(const std::filesystem::path& path);
  //! Bound on a config file's size.
  static constexpr std::uint64_t kConfigBytesMax = 1 << 20;
  //! The keys set() and the JSON loader accept, in "section.key" form.
  static std::vector<std::string> keys();
  //! Every check Runtime::create applies, without creating anything: the
  //! device's (DeviceOptions::validate), the runtime's
  //! (runtime::validate_options: ranges, alignment, min <= max, directories that
  //! exist and are writable, budgets that fit, supported combinations) and
  //! budgets.gpu <= device.budget. Touches the file system read-only.
  //! InvalidArgument / NotFound / PermissionDenied / NoSpace naming the key.
  Status validate() const;
};

//! Totals since the Runtime was created (per-step figures are in StepStats).
struct Stats {
  std::uint64_t steps = 0;
  std::uint64_t steps_skipped = 0;  //!< Inf/NaN gradients with loss scaling
  std::uint64_t bytes_h2d = 0, bytes_d2h = 0, bytes_disk_read = 0, bytes_disk_write = 0;
  double stall_s = 0.0;  //!< host time blocked inside acquire()
  double step_s = 0.0;   //!< wall time in steps
  std::uint64_t gpu_high_water_bytes = 0, host_high_water_bytes = 0, nvme_bytes = 0;
  std::uint64_t prefetch_errors = 0;  //!< failed reads ahead of use (not fatal: StepStats)
};

//! The runtime facade. Not copyable or movable (held by unique_ptr). One training
//! thread; see the header comment for ownership and failure.
class Runtime {
 public:
  //! Creates the device (config.device; auto = cuda when usable, else sim, logged)
  //! and the chunk runtime. Fails: InvalidArgument naming a bad setting,
  //! Unavailable (cuda forced and no GPU), the NVMe directory's Status
  //! (NotFound, PermissionDenied, NoSpace). Blocks while tiers are reserved.
  static Result<std::unique_ptr<Runtime>> create(Config config);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  //! Registers a tensor in the compute dtype. Before the first init_tensor, lease or step.
  //! Fails: InvalidArgument (empty or overflowing shape, duplicate name),
  //! FailedPrecondition after the first lease.
  Result<TensorId> register_tensor(std::string name, std::vector<std::int64_t> shape, bool frozen = false);
  //! Looks a tensor up by name (NotFound otherwise).
  Result<TensorId> find_tensor(std::string_view name) const;
  //! Sets a tensor's initial value (values.size() == its element count, else
  //! InvalidArgument). Between steps. Blocks (may write NVMe).
  Status init_tensor(TensorId tensor, std::span<const float> values);
  //! Copies one state of a tensor into `out` as fp32 (runtime::Runtime::read_tensor;
  //! the argument order of it and of the C ABI: tensor, state, buffer). Between steps. Blocks.
  Status read_tensor(TensorId tensor, StateKind kind, std::span<float> out);
  //! The param, as read_tensor(tensor, StateKind::kParam, out).
  Status read_tensor(TensorId tensor, std::span<float> out) {
    return read_tensor(tensor, StateKind::kParam, out);
  }

  //! A read lease on the param, on `where` (device by default). Fails as acquire().
  Result<Lease> param(TensorId tensor, Where where = Where::kDevice);
  //! A write (or accumulate) lease on the gradient. Fails as acquire().
  Result<Lease> grad(TensorId tensor, Access access = Access::kWrite, Where where = Where::kDevice);
  //! Any lease (runtime::Runtime::acquire: may block for the chunk's optimizer
  //! step or a free slot; OutOfBudget when every slot is pinned).
  Result<Lease> acquire(TensorId tensor, StateKind kind, Access access, Where where = Where::kDevice);
  //! Runs fn on the compute stream, ordered after the leases taken so far.
  //! fn must not throw. Fails when the stream refuses work (device error).
  Status launch(std::function<void()> fn);
  //! Waits for everything launched so far. Blocks.
  Status synchronize();

  //! Blocks the host until a device lease's memory holds its tensor, for math run
  //! on the host thread instead of through launch() (torch CPU ops on the sim device).
  Status wait(const Lease& lease);
  //! Starts a micro-batch; with last = false no optimizer runs and gradients are
  //! kept for the next micro-batch to accumulate into (Access::kAccumulate).
  //! FailedPrecondition while leases are held.
  Status begin_micro_batch(bool last);
  //! The tensor gets no gradient in this micro-batch (an unused branch): its family
  //! may complete before step() (runtime::Runtime::no_gradient).
  Status no_gradient(TensorId tensor);

  //! Overwrites one state of a tensor from fp32 values (param, master, state0/1;
  //! runtime::Runtime::write_tensor, same argument order). Between steps. Blocks.
  Status write_tensor(TensorId tensor, StateKind kind, std::span<const float> values);
  //! Optimizer steps applied to a tensor (its bias-correction counter).
  Result<std::int64_t> tensor_steps(TensorId tensor) const;
  //! Sets a tensor's step counter (a checkpoint's load). Between steps.
  Status set_tensor_steps(TensorId tensor, std::int64_t steps);
  //! Writes a crash-safe checkpoint of every state into `dir`
  //! (runtime::Runtime::save_checkpoint). Between steps. Blocks.
  Status save_checkpoint(const std::string& dir);
  //! Starts an overlapped save (runtime::Runtime::begin_checkpoint); returns at once.
  Status begin_checkpoint(const std::string& dir);
  //! Waits for the save begun by begin_checkpoint; its outcome.
  Status finish_checkpoint();
  //! True while the save begun by begin_checkpoint runs; its error when it failed.
  Result<bool> checkpoint_in_flight();
  //! Loads the checkpoint published in `dir`, refusing a bad one whole
  //! (runtime::Runtime::load_checkpoint). Between steps. Blocks.
  Status load_checkpoint(const std::string& dir);
  //! Puts a tensor in a parameter group (Note [Parameter groups] in runtime/runtime.hpp).
  Status set_tensor_group(TensorId tensor, std::uint32_t group);
  //! Sets a group's lr and weight decay; between step() and the next backward.
  Status set_group_hyper(std::uint32_t group, float lr, float weight_decay);

  //! Multiplies every gradient by `scale` in the next optimizer step (1/loss_scale).
  void set_grad_scale(float scale);
  //! Ends the step: optimizer, Inf/NaN check, re-planning. Blocks. Fails with the
  //! first background error (NVMe EIO, corrupt chunk) or the error an earlier call
  //! of the step met; the step is then discarded (abort_step) and the next one
  //! starts clean, while every state keeps its last good value.
  Result<StepStats> step();
  //! Discards the step in progress after an error or an exception in the
  //! caller's forward or backward (runtime::Runtime::abort_step; Note [Failed
  //! steps]): the next step starts clean. step() does it itself when it fails.
  //! FailedPrecondition while leases are held. Blocks.
  Status abort_step();
  //! Waits until every state the last step updated is on its home tier (NVMe
  //! write-backs go on after step() returns, overlapping the next forward).
  //! Returns the first background error; a failed write-back keeps that step's
  //! states in host memory, where read_tensor still reads them. Blocks.
  //! read_tensor and the destructor flush by themselves.
  Status flush();

  //! Totals since creation.
  const Stats& stats() const { return stats_; }
  //! Chrome trace (chrome://tracing, Perfetto) of the recorded timeline; the
  //! path's Status on failure.
  Status write_chrome_trace(const std::string& path) const;
  //! "device sim (...); plan: ..." for a progress line or a log.
  std::string describe() const;

  //! The device (sim or cuda) this runtime runs on.
  memory::Device& device() { return *device_; }
  //! The chunk runtime underneath, for what the facade does not wrap.
  runtime::Runtime& core() { return *core_; }
  //! The settings in effect.
  const Config& config() const { return config_; }

 private:
  Runtime(Config config, std::unique_ptr<memory::Device> device, std::unique_ptr<runtime::Runtime> core);
  Config config_;
  std::unique_ptr<memory::Device> device_;  // declared before core_: destroyed after it
  std::unique_ptr<runtime::Runtime> core_;
  Stats stats_;
};

}  // namespace strata
