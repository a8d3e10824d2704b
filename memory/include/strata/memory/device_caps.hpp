#pragma once
// What a device can do (issue #26: "devices say what they can do"). The runtime
// asks these questions instead of switching on Device::kind(); the answers for
// each backend are one table, in device_caps.cpp, where a new backend adds its row.

#include "strata/memory/device.hpp"

namespace strata::memory {

//! A device backend's capabilities. Plain data; never fails.
struct DeviceCaps {
  //! The host may read and write device memory directly (the sim device's
  //! "device" memory is host memory; CUDA's is not).
  bool host_addressable = false;
  //! Optimizer steps are device kernels enqueued on a device stream (CUDA's
  //! multi-tensor kernels); false: the device runs a host function on its stream
  //! (the sim device runs the CPU kernel there).
  bool optimizer_kernels = false;
  //! Its optimizer steps cover the layer-wise optimizers (LAMB, LARS) and CAME;
  //! CUDA's kernels do not yet, so the runtime runs those on the CPU.
  bool layerwise_optimizers = false;
  //! Device memory is CUDA memory, which a CUDA-aware collective (NCCL) can reduce.
  bool cuda_memory = false;
};

//! The capabilities of a backend.
DeviceCaps device_caps(DeviceKind kind);
//! The capabilities of `device`'s backend.
inline DeviceCaps device_caps(const Device& device) {
  return device_caps(device.kind());
}

}  // namespace strata::memory
