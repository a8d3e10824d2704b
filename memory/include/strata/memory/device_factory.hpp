#pragma once
// make_device(): the one place where strata chooses between device backends.
//
// Note [Backend registry]
// The factory knows two backends. `sim` is always built. `cuda` is provided by
// memory/src/cuda/cuda_device.cpp when CMake found nvcc (STRATA_HAVE_CUDA), and by
// memory/src/cuda/cuda_absent.cpp otherwise, which answers Unavailable ("built without
// CUDA"). CMake picks the source file, so no code has an #ifdef. `auto` tries cuda and
// falls back to sim only when cuda is Unavailable (no driver, no device, not built); any
// other cuda failure (a budget larger than the GPU, say) is returned, not hidden. The
// choice and its reason are logged at info: "device: sim (no CUDA driver: ...)".

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "strata/common/bytes.hpp"
#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"

namespace strata::memory {

//! Which backend make_device() should create.
enum class DeviceChoice : std::uint8_t { kAuto, kSim, kCuda };

//! Parses "auto", "sim" or "cuda" (setting `device.kind`); InvalidArgument otherwise.
Result<DeviceChoice> parse_device_choice(std::string_view text);

//! Slowest sim copy throttle validate() accepts, bytes per second: below it one chunk's
//! copy takes seconds and a step minutes (a PCIe link moves GiB/s), so a mistyped rate
//! ("1k") would look like a hang.
inline constexpr std::uint64_t kSimBandwidthMinBytesPerS = 64 * kMiB;

//! Settings of make_device(). Plain data; validate() checks them, set() parses strings.
struct DeviceOptions {
  DeviceChoice kind = DeviceChoice::kAuto;
  //! Hard limit of device memory (device.budget). For sim it is host memory, so it must
  //! not exceed the machine's RAM; for cuda it must not exceed the GPU's memory.
  std::uint64_t budget_bytes = 4 * kGiB;
  //! sim copy throttle per direction in bytes per second (device.h2d_bandwidth, ...);
  //! 0 = unthrottled. See Note [Sim copy throttle] in memory/src/sim/sim_device.cpp.
  std::uint64_t h2d_bytes_per_s = 0;
  std::uint64_t d2h_bytes_per_s = 0;
  std::uint64_t d2d_bytes_per_s = 0;
  //! sim: operations a stream holds before enqueueing blocks (device.stream_queue_depth).
  std::size_t stream_queue_depth = 1024;
  //! Streams a device may have at once (device.streams_max).
  std::size_t streams_max = 64;
  //! cuda: which GPU (device.cuda_ordinal).
  int cuda_ordinal = 0;

  //! Sets one option from text: kind, budget, h2d_bandwidth, d2h_bandwidth, d2d_bandwidth
  //! (sizes per second, e.g. "16GiB"), stream_queue_depth, streams_max, cuda_ordinal.
  //! InvalidArgument naming `device.<key>`, the value and the accepted forms.
  Status set(std::string_view key, std::string_view value);

  //! Checks ranges: budget > 0 and <= the machine's RAM for sim (the GPU's memory is checked
  //! when the cuda device opens), queue depth and stream count in [1, 1<<20], each copy
  //! throttle 0 or at least kSimBandwidthMinBytesPerS.
  //! InvalidArgument naming the setting, the value and what to do.
  Status validate() const;
};

//! Creates the device `options.kind` asks for (Note [Backend registry]) and logs which
//! backend runs and why; `why` (may be null) receives the same reason. Fails with the
//! validation error, or Unavailable when `cuda` is forced and no usable GPU exists (the
//! message says to use device.kind=sim or install the driver). Blocks while the backend
//! starts (cuda: context creation).
Result<std::unique_ptr<Device>> make_device(const DeviceOptions& options, std::string* why = nullptr);

//! Physical RAM of this machine in bytes (sysconf), for budget validation.
std::uint64_t physical_memory_bytes();

}  // namespace strata::memory
