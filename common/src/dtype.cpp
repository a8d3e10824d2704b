#include "strata/common/dtype.hpp"

#include "strata/common/status.hpp"

namespace strata {

namespace {

// The one table of dtype names (Note [DType names]): the name written first,
// then the other spellings parse_dtype reads.
struct DTypeNames {
  DType dtype;
  std::string_view name;
  std::string_view aliases[2];
};

constexpr DTypeNames kNames[] = {
    {DType::kF32, "fp32", {"f32", "float32"}},
    {DType::kBF16, "bf16", {"bfloat16", ""}},
    {DType::kF16, "fp16", {"f16", "float16"}},
    {DType::kQ8, "q8", {"", ""}},
};

}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const DTypeNames& row : kNames) {
    if (row.dtype == dtype) return row.name;
  }
  return dtype == DType::kNone ? "none" : "unknown";
}

Result<DType> parse_dtype(std::string_view text) {
  for (const DTypeNames& row : kNames) {
    if (text == row.name) return row.dtype;
    for (std::string_view alias : row.aliases) {
      if (!alias.empty() && text == alias) return row.dtype;
    }
  }
  return invalid_argument("dtype \"{}\" is not known; use fp32, bf16, fp16 (or q8 for optimizer states)",
                          text);
}

}  // namespace strata
