#pragma once
// The one element type of tensors, chunks, kernel spans and collectives
// (issue #26): kernels/, runtime/, comm/ and the checkpoint all name it
// strata::DType, and spell it with dtype_name and parse_dtype below.
//
// Note [DType names]
// One spelling per dtype is written: "fp32", "bf16", "fp16" (and "none" for
// kNone) — the spelling of configs (precision.compute_dtype) and of every
// checkpoint manifest written so far, so both stay as they were. parse_dtype
// also reads the spellings strata wrote elsewhere before the names were one
// table (the kernels' and comm's "f32"/"f16", in strata-bench optim's JSON up
// to issue #26) and torch's ("float32", "bfloat16", "float16"); it reads no
// "none" (no tensor has that type) and names the accepted spellings otherwise.
// "q8" (issue #49) names only an optimizer state's type: 8-bit codes with one
// fp32 scale per block (kernels/q8.hpp; Note [Q8 state chunks] in
// runtime/src/pipeline/q8_states.cpp); each reader of a tensor's, a gradient's
// or a collective's dtype refuses it.
//
// No Status or fmt here: CUDA translation units include this header through
// kernels/span.hpp (kernels/CMakeLists.txt); parse_dtype's Result is declared
// ahead and defined in status.hpp, which its callers include.

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/common/half.hpp"  // STRATA_HD

namespace strata {

template <typename T>
class Result;

//! Element type. kNone marks an absent optional span (a kernel step without a
//! param copy); it is never a tensor's, a chunk's or a collective's type. kQ8
//! is an optimizer state's type only (8-bit codes plus block scales, issue #49).
enum class DType : std::uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2, kQ8 = 3, kNone = 255 };

//! "fp32", "bf16", "fp16", "q8" or "none" (Note [DType names]). Never fails.
std::string_view dtype_name(DType dtype);

//! Bytes per element (0 for kNone; 1 for kQ8: its code byte, without the
//! block scales, which runtime::state_chunk_bytes counts).
STRATA_HD constexpr std::size_t dtype_size(DType dtype) {
  return dtype == DType::kF32 ? 4 : (dtype == DType::kNone ? 0 : (dtype == DType::kQ8 ? 1 : 2));
}

//! The dtype a name spells: "fp32"/"f32"/"float32", "bf16"/"bfloat16",
//! "fp16"/"f16"/"float16", "q8" (Note [DType names]). InvalidArgument naming the
//! text and the accepted names otherwise ("none" included).
Result<DType> parse_dtype(std::string_view text);

}  // namespace strata
