// Each device backend's capabilities (device_caps.hpp): the one place that maps a
// DeviceKind to what it can do.
#include "strata/memory/device_caps.hpp"

namespace strata::memory {

DeviceCaps device_caps(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kSim:
      return {.host_addressable = true,
              .optimizer_kernels = false,
              .layerwise_optimizers = true,
              .cuda_memory = false};
    case DeviceKind::kCuda:
      return {.host_addressable = false,
              .optimizer_kernels = true,
              .layerwise_optimizers = false,
              .cuda_memory = true};
  }
  return {};
}

}  // namespace strata::memory
