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
using Stats = runtime::RunStats;

namespace detail {
//! strata::Runtime's device, a base so that it is built before the runtime that
//! runs on it and destroyed after it.
struct OwnedDevice {
  std::unique_ptr<memory::Device> owned_device;
};
}  // namespace detail

//! The runtime, made from a Config, owning its device. It is runtime::Runtime
//! (every call of that class, one argument order: tensor, state, buffer) with
//! what a Config adds; nothing is forwarded. Not copyable or movable (held by
//! unique_ptr). One training thread; see the header comment for ownership and
//! failure.
class Runtime : private detail::OwnedDevice, public runtime::Runtime {
 public:
  //! Creates the device (config.device; auto = cuda when usable, else sim, logged)
  //! and the chunk runtime. Fails: InvalidArgument naming a bad setting,
  //! Unavailable (cuda forced and no GPU), the NVMe directory's Status
  //! (NotFound, PermissionDenied, NoSpace). Blocks while tiers are reserved.
  static Result<std::unique_ptr<Runtime>> create(Config config);
  //! Ends the runtime (runtime::Runtime's destructor), then frees the device.
  ~Runtime();

  //! The device (sim or cuda) this runtime runs on.
  memory::Device& device() { return *owned_device; }
  //! The settings in effect.
  const Config& config() const { return config_; }

 private:
  Runtime(Config config, std::unique_ptr<memory::Device> device);
  Config config_;
};

}  // namespace strata
