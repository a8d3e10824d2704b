#pragma once
// Tensors as the runtime sees them: a name, a shape, a dtype, and where they sit.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/dtype.hpp"
#include "strata/common/status.hpp"

namespace strata::runtime {

//! Element type of a tensor or chunk: common's (kNone is never a tensor's), with
//! its one name table (Note [DType names] in common/dtype.hpp).
using DType = strata::DType;
using strata::dtype_name;
using strata::parse_dtype;

//! Bytes per element.
constexpr std::uint64_t dtype_bytes(DType dtype) {
  return strata::dtype_size(dtype);
}

//! Index of a registered tensor; dense from 0 in registration order.
using TensorId = std::uint32_t;
//! Index of a chunk family; dense from 0 in packing order.
using FamilyId = std::uint32_t;

//! What a caller registers: the tensor's name, shape and compute dtype.
struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  DType dtype = DType::kF32;
  //! Frozen tensors take part in compute but get no gradient and no optimizer state.
  bool frozen = false;
};

//! Number of elements of a shape; InvalidArgument for an empty product (a zero or
//! negative extent) or an overflow past 2^62, naming the tensor.
Result<std::uint64_t> shape_numel(std::string_view tensor_name, const std::vector<std::int64_t>& shape);

}  // namespace strata::runtime
