#pragma once
// Loading and storing the lanes of a compute type T from spans of any DType.
//
// Note [One rule body, many widths]
// The per-element operations (ops.hpp) are templates over a compute type T:
// float for the scalar CPU path, the CUDA kernels and the emulated grid; an
// 8- or 16-lane vector for AVX2 / AVX-512 (defined only inside their own
// translation units). Lanes<T> says how T reads and writes W consecutive
// elements of each storage type; the rules themselves only use + - * / and the
// helpers of hd.hpp. So there is exactly one copy of each update rule.

#include <cstddef>
#include <cstdint>

#include "strata/kernels/dtype.hpp"
#include "strata/kernels/hd.hpp"

namespace strata::kernels {

//! Lane access for a compute type; specialised per type. Lanes<float> is one lane.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  static constexpr std::size_t kWidth = 1;
  STRATA_HD static float load_f32(const float* p) { return *p; }
  STRATA_HD static float load_bf16(const std::uint16_t* p) { return bf16_to_float(*p); }
  STRATA_HD static float load_f16(const std::uint16_t* p) { return f16_to_float(*p); }
  STRATA_HD static void store_f32(float* p, float x) { *p = x; }
  STRATA_HD static void store_bf16(std::uint16_t* p, float x) { *p = float_to_bf16(x); }
  STRATA_HD static void store_f16(std::uint16_t* p, float x) { *p = float_to_f16(x); }
  //! Sum of the lanes (here: the value).
  STRATA_HD static float hsum(float x) { return x; }
  //! The same in a fixed tree order (the per-group norm sums, Note [Exact norms]).
  STRATA_HD static float hsum_tree(float x) { return x; }
};

//! Lanes [i, i + W) of a span of dtype D, as T.
template <typename T, DType D>
STRATA_HD inline T load(const void* base, std::size_t i) {
  if constexpr (D == DType::kF32) {
    return Lanes<T>::load_f32(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBF16) {
    return Lanes<T>::load_bf16(static_cast<const std::uint16_t*>(base) + i);
  } else {
    static_assert(D == DType::kF16, "load from an absent span");
    return Lanes<T>::load_f16(static_cast<const std::uint16_t*>(base) + i);
  }
}

//! Writes x to lanes [i, i + W) of a span of dtype D (rounding per Note [Rounding to half precision]).
//! D == kNone writes nothing.
template <typename T, DType D>
STRATA_HD inline void store(void* base, std::size_t i, T x) {
  if constexpr (D == DType::kF32) {
    Lanes<T>::store_f32(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::kBF16) {
    Lanes<T>::store_bf16(static_cast<std::uint16_t*>(base) + i, x);
  } else if constexpr (D == DType::kF16) {
    Lanes<T>::store_f16(static_cast<std::uint16_t*>(base) + i, x);
  }
}

}  // namespace strata::kernels
