#pragma once
// The backends' constructors, as the factory sees them (Note [Backend registry] in
// device_factory.hpp). Internal to memory/.

#include <memory>

#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::memory::detail {

//! The sim backend; `options` are validated. Never fails today (Result for symmetry).
Result<std::unique_ptr<Device>> make_sim_device(const DeviceOptions& options);

//! The cuda backend: Unavailable when strata was built without CUDA or no usable GPU
//! exists (the message says why); InvalidArgument when the budget exceeds the GPU.
Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& options);

}  // namespace strata::memory::detail
