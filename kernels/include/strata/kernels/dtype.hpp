#pragma once
// Element types of master/param/grad/state spans and their conversions.
//
// The scalar conversions live in common/half.hpp (Note [Rounding to half
// precision] there), shared with comm/.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/common/half.hpp"
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

// float <-> bf16 / fp16 bits, round to nearest even (common/half.hpp).
using strata::bf16_to_float;
using strata::f16_to_float;
using strata::float_to_bf16;
using strata::float_to_f16;

}  // namespace strata::kernels
