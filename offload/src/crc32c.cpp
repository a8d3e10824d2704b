#include "strata/offload/crc32c.hpp"

#include <array>
#include <cstring>

namespace strata::offload {

namespace {

constexpr std::uint32_t kPolynomial = 0x82F63B78u;  // reflected Castagnoli

using Tables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Tables make_tables() {
  Tables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[0][i] = c;
  }
  for (std::uint32_t i = 0; i < 256; ++i) {
    for (std::size_t s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
  return t;
}

constexpr Tables kTables = make_tables();

using Crc32cFn = std::uint32_t (*)(std::span<const std::byte>, std::uint32_t);

// Note [CRC32C dispatch]: chosen once, on first use, by CPUID (like the kernels'
// SIMD dispatch); the same function pointer serves every later call.
Crc32cFn pick() {
  return crc32c_hardware_available() ? &crc32c_hardware : &crc32c_table;
}

}  // namespace

std::uint32_t crc32c_table(std::span<const std::byte> data, std::uint32_t crc) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  std::size_t n = data.size();
  crc = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian, as the x86 and arm64 targets are
    word ^= crc;
    crc = kTables[7][word & 0xFF] ^ kTables[6][(word >> 8) & 0xFF] ^ kTables[5][(word >> 16) & 0xFF] ^
          kTables[4][(word >> 24) & 0xFF] ^ kTables[3][(word >> 32) & 0xFF] ^
          kTables[2][(word >> 40) & 0xFF] ^ kTables[1][(word >> 48) & 0xFF] ^ kTables[0][word >> 56];
  }
  for (; n > 0; --n, ++p) crc = (crc >> 8) ^ kTables[0][(crc ^ *p) & 0xFF];
  return ~crc;
}

std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc) {
  static const Crc32cFn fn = pick();
  return fn(data, crc);
}

std::string_view crc32c_implementation() {
  return crc32c_hardware_available() ? "sse4.2" : "table";
}

}  // namespace strata::offload
