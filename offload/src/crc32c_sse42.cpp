// CRC32C with the SSE4.2 crc32 instruction. Built on x86-64 only (the CMake
// file picks this or crc32c_none.cpp: the platform choice lives there).
#include <nmmintrin.h>

#include <cstring>

#include "strata/offload/crc32c.hpp"

namespace strata::offload {

bool crc32c_hardware_available() {
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
}

__attribute__((target("sse4.2"))) std::uint32_t crc32c_hardware(std::span<const std::byte> data,
                                                                std::uint32_t crc) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  std::size_t n = data.size();
  std::uint64_t c = ~crc;
  // Three independent streams would hide the instruction's 3-cycle latency; one
  // stream already checksums several GB/s, well above one device's bandwidth.
  for (; n >= 32; n -= 32, p += 32) {
    std::uint64_t w[4];
    std::memcpy(w, p, 32);
    c = _mm_crc32_u64(c, w[0]);
    c = _mm_crc32_u64(c, w[1]);
    c = _mm_crc32_u64(c, w[2]);
    c = _mm_crc32_u64(c, w[3]);
  }
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  auto c32 = static_cast<std::uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}

}  // namespace strata::offload
