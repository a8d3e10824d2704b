#include "strata/runtime/tensor.hpp"

#include <fmt/ranges.h>

namespace strata::runtime {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kNone:
      break;
  }
  return "unknown";
}

Result<DType> parse_dtype(std::string_view text) {
  if (text == "fp32" || text == "float32" || text == "f32") return DType::kF32;
  if (text == "bf16" || text == "bfloat16") return DType::kBF16;
  if (text == "fp16" || text == "float16" || text == "f16") return DType::kF16;
  return invalid_argument("dtype \"{}\" is not known; use fp32, bf16 or fp16", text);
}

Result<std::uint64_t> shape_numel(std::string_view tensor_name, const std::vector<std::int64_t>& shape) {
  constexpr std::uint64_t kNumelMax = std::uint64_t{1} << 62;
  std::uint64_t numel = 1;
  for (std::int64_t extent : shape) {
    if (extent <= 0) {
      return invalid_argument(
          "tensor \"{}\" has shape [{}]: every extent must be positive (a tensor with "
          "zero elements holds no state; do not register it)",
          tensor_name, fmt::join(shape, ", "));
    }
    if (numel > kNumelMax / static_cast<std::uint64_t>(extent)) {
      return invalid_argument("tensor \"{}\" has shape [{}]: its element count overflows 2^62", tensor_name,
                              fmt::join(shape, ", "));
    }
    numel *= static_cast<std::uint64_t>(extent);
  }
  return numel;
}

}  // namespace strata::runtime
