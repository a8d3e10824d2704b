#pragma once
// Element types of master/param/grad/state spans and their conversions.
//
// The dtype is common's strata::DType (one enum and one name table for
// kernels/, runtime/ and comm/: Note [DType names] in common/dtype.hpp); the
// scalar conversions live in common/half.hpp (Note [Rounding to half
// precision] there), shared with comm/.

#include "strata/common/dtype.hpp"
#include "strata/common/half.hpp"
#include "strata/kernels/hd.hpp"

namespace strata::kernels {

//! Element type of a span. kNone marks an absent optional span (no param copy).
using DType = strata::DType;
using strata::dtype_name;
using strata::dtype_size;

// float <-> bf16 / fp16 bits, round to nearest even (common/half.hpp).
using strata::bf16_to_float;
using strata::f16_to_float;
using strata::float_to_bf16;
using strata::float_to_f16;

}  // namespace strata::kernels
