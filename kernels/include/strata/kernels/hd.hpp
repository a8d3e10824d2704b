#pragma once
// Host/device portability for the update rules: STRATA_HD, bit casts and the
// few scalar math helpers the rules use. This header is the one place where the
// CUDA/host split is spelled out; every rule header includes it and stays free
// of #ifdef (STYLE.md habit 2).

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define STRATA_HD __host__ __device__
#else
#define STRATA_HD
#endif

namespace strata::kernels {

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

// Scalar versions of the operations the rules are written in. SIMD lane types
// (kernels/src/cpu) overload the same names, so one rule body serves scalar,
// AVX2, AVX-512 and CUDA. madd is a*b+c: unfused on the portable host build
// (GCC's ISO mode does not contract), an FMA in the SIMD and CUDA builds.

//! a * b + c.
STRATA_HD inline float madd(float a, float b, float c) {
  return a * b + c;
}
//! Square root (IEEE, correctly rounded).
STRATA_HD inline float vsqrt(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);
#else
  return std::sqrt(x);
#endif
}
//! max(a, b) with a NaN `a` giving b (as maxps does); callers never rely on NaN order.
STRATA_HD inline float vmax(float a, float b) {
  return a > b ? a : b;
}
//! min(a, b), NaN handling as vmax.
STRATA_HD inline float vmin(float a, float b) {
  return a < b ? a : b;
}
//! -1, 0 or +1 (sign of zero is 0, as torch.sign).
STRATA_HD inline float vsign(float x) {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
}

}  // namespace strata::kernels
