// CRC32C hardware path for targets without SSE4.2: none; the table serves.
#include "strata/common/assert.hpp"
#include "strata/offload/crc32c.hpp"

namespace strata::offload {

bool crc32c_hardware_available() {
  return false;
}

std::uint32_t crc32c_hardware(std::span<const std::byte>, std::uint32_t) {
  STRATA_CHECK_MSG(false, "crc32c_hardware called on a target without SSE4.2");
  return 0;
}

}  // namespace strata::offload
