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

//! Elements per q8 scale block (kernels::kQ8BlockElems; checked equal where both are seen).
inline constexpr std::uint64_t kQ8BlockElems = 256;

//! Bytes of one optimizer-state chunk of `elems` elements in `state_dtype`: for
//! q8 its codes (one byte each) then one fp32 scale per kQ8BlockElems (Note [Q8
//! state chunks] in runtime/src/pipeline/q8_states.cpp); else elems x the size.
constexpr std::uint64_t state_chunk_bytes(DType state_dtype, std::uint64_t elems) {
  if (state_dtype == DType::kQ8) return elems + 4 * ((elems + kQ8BlockElems - 1) / kQ8BlockElems);
  return elems * dtype_bytes(state_dtype);
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
