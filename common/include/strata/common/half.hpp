#pragma once
// Scalar float <-> bf16 / fp16 conversions, shared by kernels/ (the scalar
// kernels, the CUDA kernels and the SIMD tails) and comm/ (reductions of half
// buffers): one copy of the bit tricks. Host and device (STRATA_HD).
//
// Note [Rounding to half precision]
// Every float -> bf16/fp16 store rounds to nearest, ties to even, on every
// implementation: bf16 by adding 0x7fff + lsb to the bits (NaN kept quiet),
// fp16 by the exponent-rebias trick of F. Giesen's float_to_half_fast3_rtne
// (subnormals via one float add, which rounds RNE in hardware). The SIMD
// builds use F16C/AVX-512 vcvtps2ph with _MM_FROUND_TO_NEAREST_INT, which is
// the same rounding, so all implementations store identical bits for the same
// float. Overflow goes to Inf, as the hardware does.

#include <cstdint>
#include <cstring>

#if !defined(STRATA_HD)
#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif
#endif

namespace strata {

//! The bits of a float. Pure; usable on host and device.
STRATA_HD inline std::uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

//! The float with these bits. Pure; usable on host and device.
STRATA_HD inline float bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
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

}  // namespace strata
