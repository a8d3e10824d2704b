// The cuda backend's stand-in when CMake found no nvcc (STRATA_HAVE_CUDA off):
// see Note [Backend registry] in device_factory.hpp.

#include "backends.hpp"

namespace strata::memory::detail {

Result<std::unique_ptr<Device>> make_cuda_device(const DeviceOptions& /*options*/) {
  return unavailable(
      "strata was built without CUDA (nvcc was not found when CMake configured, or STRATA_CUDA=OFF); "
      "rebuild with the CUDA toolkit installed to use a GPU");
}

}  // namespace strata::memory::detail
