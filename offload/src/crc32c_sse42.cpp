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

// Note [Three CRC streams]
// The crc32 instruction takes 3 cycles and issues one per cycle: one stream of it
// checksummed about 8 GB/s here, and a save or load checksums every byte it
// writes or reads on the cores that copy them. So a long buffer is checksummed as
// three adjacent blocks at once, and the three registers are combined: the CRC
// register is linear, so the register after blocks A then B from state s is
// shift(s, |B|) ^ crc(B from 0), where shift(s, n) is s run through n zero bytes.
// shift by a fixed n is a 32x32 matrix over GF(2), kept as four 256-entry tables
// (one per byte of s), built once from the 32 unit vectors.

namespace {

__attribute__((target("sse4.2"))) std::uint64_t crc_u64_run(std::uint64_t c, const unsigned char* p,
                                                            std::size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  return c;
}

//! The register run through `Bytes` zero bytes, by table (Note [Three CRC streams]).
template <std::size_t Bytes>
class Shift {
 public:
  __attribute__((target("sse4.2"))) Shift() {
    std::uint32_t unit[32];
    const unsigned char zeros[64] = {};
    for (int bit = 0; bit < 32; ++bit) {
      std::uint64_t c = std::uint32_t{1} << bit;
      for (std::size_t done = 0; done < Bytes; done += sizeof zeros) c = crc_u64_run(c, zeros, sizeof zeros);
      unit[bit] = static_cast<std::uint32_t>(c);
    }
    for (int byte = 0; byte < 4; ++byte) {
      for (std::uint32_t v = 0; v < 256; ++v) {
        std::uint32_t out = 0;
        for (int bit = 0; bit < 8; ++bit) {
          if ((v >> bit) & 1) out ^= unit[8 * byte + bit];
        }
        table_[byte][v] = out;
      }
    }
  }
  std::uint32_t operator()(std::uint32_t c) const {
    return table_[0][c & 0xff] ^ table_[1][(c >> 8) & 0xff] ^ table_[2][(c >> 16) & 0xff] ^
           table_[3][c >> 24];
  }

 private:
  static_assert(Bytes % 64 == 0);
  std::uint32_t table_[4][256];
};

//! Runs c through `blocks` of three adjacent `Bytes`-byte blocks, three streams at once.
template <std::size_t Bytes>
__attribute__((target("sse4.2"))) std::uint32_t three_streams(std::uint32_t c, const unsigned char*& p,
                                                              std::size_t& n) {
  static const Shift<Bytes> shift;
  for (; n >= 3 * Bytes; n -= 3 * Bytes, p += 3 * Bytes) {
    std::uint64_t c0 = c, c1 = 0, c2 = 0;
    for (std::size_t i = 0; i < Bytes; i += 8) {
      std::uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + Bytes + i, 8);
      std::memcpy(&w2, p + 2 * Bytes + i, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c = shift(shift(static_cast<std::uint32_t>(c0)) ^ static_cast<std::uint32_t>(c1)) ^
        static_cast<std::uint32_t>(c2);
  }
  return c;
}

}  // namespace

__attribute__((target("sse4.2"))) std::uint32_t crc32c_hardware(std::span<const std::byte> data,
                                                                std::uint32_t crc) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  std::size_t n = data.size();
  std::uint32_t c = ~crc;
  c = three_streams<4096>(c, p, n);
  c = three_streams<256>(c, p, n);
  std::uint64_t c64 = crc_u64_run(c, p, n);
  p += n / 8 * 8;
  n %= 8;
  auto c32 = static_cast<std::uint32_t>(c64);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}

}  // namespace strata::offload
