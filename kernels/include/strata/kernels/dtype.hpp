#pragma once
// Element types of master/param/grad/state spans and their conversions.
//
// Note [Rounding to half precision]
// Every float -> bf16/fp16 store rounds to nearest, ties to even, on every
// implementation: bf16 by adding 0x7fff + lsb to the bits (NaN kept quiet),
// fp16 by the exponent-rebias trick of F. Giesen's float_to_half_fast3_rtne
// (subnormals via one float add, which rounds RNE in hardware). The SIMD
// builds use F16C/AVX-512 vcvtps2ph with _MM_FROUND_TO_NEAREST_INT, which is
// the same rounding, so all implementations store identical bits for the same
// float. Overflow goes to Inf, as the hardware does.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/kernels/hd.hpp"

namespace strata::kernels {

//! Element type of a span. kNone marks an absent optional span (no param copy).
enum class DType : std::uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 255 };

//! "f32", "bf16", "f16" or "none".
std::string_view dtype_name(DType dtype);

//! Bytes per element (0 for kNone).
STRATA_HD constexpr std::size_t dtype_size(DType dtype) {
  return dtype == DType::kF32 ? 4 : (dtype == DType::kNone ? 0 : 2);
}

//! bf16 bits -> float (exact).
STRATA_HD inline float bf16_to_float(std::uint16_t h) {
  return bits_float(std::uint32_t{h} << 16);
}

//! float -> bf16 bits, round to nearest even; NaN stays NaN (quiet).
STRATA_HD inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>(x >> 16);
}

//! fp16 bits -> float (exact, subnormals included).
STRATA_HD inline float f16_to_float(std::uint16_t h) {
  std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16;
  std::uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_float(sign | 0x7f800000u | ((em & 0x3ffu) << 13));  // Inf/NaN
  if (em < 0x400u) {  // zero or subnormal: em * 2^-24
    float f = static_cast<float>(em) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return bits_float(sign | ((em << 13) + 0x38000000u));  // rebias 15 -> 127
}

//! float -> fp16 bits, round to nearest even; overflow -> Inf; NaN stays NaN.
STRATA_HD inline std::uint16_t float_to_f16(float f) {
  std::uint32_t x = float_bits(f);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<std::uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (ax < 0x38800000u) {             // below the smallest normal half (2^-14): subnormal or zero
    float r = bits_float(ax) + 0.5f;  // the ulp of 0.5f is 2^-24, the half subnormal step
    return static_cast<std::uint16_t>(sign | (float_bits(r) - 0x3f000000u));
  }
  std::uint32_t mant_odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + mant_odd;  // rebias 127 -> 15 and round half to even
  return static_cast<std::uint16_t>(sign | (ax >> 13));
}

}  // namespace strata::kernels
