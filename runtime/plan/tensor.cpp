#include "strata/runtime/tensor.hpp"

#include <fmt/ranges.h>

namespace strata::runtime {

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
