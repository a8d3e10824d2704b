#pragma once
// Whether the host may read and write device slot memory directly (the device's
// capability, memory::DeviceCaps::host_addressable: true on the sim device, whose
// "device" memory is host memory; false on CUDA). The gradient check on the device
// (grad_check.cpp) and the data-parallel reduction from the device slot
// (dp/reduce.cpp, dp/gather.cpp) ask this one question here.

#include "strata/memory/device_caps.hpp"

namespace strata::runtime {

inline bool device_memory_host_readable(const memory::Device& device) {
  return memory::device_caps(device).host_addressable;
}

}  // namespace strata::runtime
