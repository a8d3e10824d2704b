#include "strata/runtime/tensor.hpp"

#include <fmt/ranges.h>

#include "strata/runtime/state_kind.hpp"

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

std::string_view state_kind_name(StateKind kind) {
  switch (kind) {
    case StateKind::kParam:
      return "param";
    case StateKind::kGrad:
      return "grad";
    case StateKind::kMaster:
      return "master";
    case StateKind::kState0:
      return "state0";
    case StateKind::kState1:
      return "state1";
  }
  return "unknown";
}

}  // namespace strata::runtime
