#pragma once
// Byte sizes: parsing ("8GiB", "512 MiB", "1.5G", "4096") and printing ("8.00 GiB").

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/common/status.hpp"

namespace strata {

inline constexpr std::uint64_t kKiB = 1024;
inline constexpr std::uint64_t kMiB = 1024 * kKiB;
inline constexpr std::uint64_t kGiB = 1024 * kMiB;
inline constexpr std::uint64_t kTiB = 1024 * kGiB;

//! Parses a byte size. Accepted: a non-negative number (integer or decimal) and an
//! optional unit, with optional spaces between: B; KiB MiB GiB TiB (binary);
//! K M G T (binary, as in `ulimit` and `fallocate -l`); KB MB GB TB (decimal).
//! Units are case-insensitive. `setting` names what is parsed, for the message.
//! Fails (InvalidArgument, naming the setting and value) on an empty string,
//! an unknown unit ("12XB"), a negative number, a fraction of a byte, or overflow.
Result<std::uint64_t> parse_bytes(std::string_view text, std::string_view setting = "size");

//! "0 B", "512 B", "4.00 KiB", "1.50 GiB": binary units, two decimals above 1 KiB.
std::string format_bytes(std::uint64_t bytes);

//! True when x is a power of two (0 is not).
constexpr bool is_pow2(std::uint64_t x) {
  return x != 0 && (x & (x - 1)) == 0;
}

//! Rounds x up to a multiple of `alignment` (a power of two).
constexpr std::uint64_t align_up(std::uint64_t x, std::uint64_t alignment) {
  return (x + alignment - 1) & ~(alignment - 1);
}

//! Rounds x down to a multiple of `alignment` (a power of two).
constexpr std::uint64_t align_down(std::uint64_t x, std::uint64_t alignment) {
  return x & ~(alignment - 1);
}

//! Integer division rounding up.
constexpr std::uint64_t div_ceil(std::uint64_t a, std::uint64_t b) {
  return (a + b - 1) / b;
}

}  // namespace strata
