#pragma once
// Host/device portability for the update rules: STRATA_HD, bit casts and the
// few scalar math helpers the rules use. This header (with common/half.hpp, which
// holds STRATA_HD and the casts) is where the CUDA/host split is spelled out;
// every rule header includes it and stays free of #ifdef (platform choice in one place).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "strata/common/half.hpp"  // STRATA_HD, float_bits, bits_float

namespace strata::kernels {

// The float <-> bits casts (common/half.hpp): lane types overload other names
// here, so these are declared in this namespace too.
using strata::bits_float;
using strata::float_bits;

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
