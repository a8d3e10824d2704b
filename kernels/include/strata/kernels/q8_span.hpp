#pragma once
// The q8 span and block size (issue #49; Note [Q8 step] in q8.hpp), apart from
// q8.hpp so that the CUDA kernel (nvcc, which cannot compile fmt 9 and so not
// optim.hpp) uses the same struct: plain types only.

#include <cstddef>
#include <cstdint>

#include "strata/kernels/dtype.hpp"

namespace strata::kernels {

//! Elements per quantization block (one fp32 scale each).
inline constexpr std::size_t kQ8BlockElems = 256;

//! Scale blocks of a span of n elements: ceil(n / kQ8BlockElems).
constexpr std::size_t q8_blocks(std::size_t n) {
  return (n + kQ8BlockElems - 1) / kQ8BlockElems;
}

//! One tensor (or slice starting at a block boundary) with 8-bit Adam states.
//! Non-owning; the caller keeps the memory alive and unshared for the call.
struct Q8Span {
  float* master = nullptr;     //!< fp32 master, read and written
  const void* grad = nullptr;  //!< gradient, grad_dtype (fp32, bf16 or fp16)
  DType grad_dtype = DType::kF32;
  void* param = nullptr;             //!< param copy written in the same pass; may be null
  DType param_dtype = DType::kNone;  //!< kNone when param is null
  std::uint8_t* m_codes = nullptr;   //!< n indices into q8_signed_map()
  float* m_scales = nullptr;         //!< q8_blocks(n) absmax scales of m
  std::uint8_t* v_codes = nullptr;   //!< n indices into q8_unsigned_map()
  float* v_scales = nullptr;         //!< q8_blocks(n) absmax scales of v
  std::size_t n = 0;                 //!< elements; the last block may be partial
};

}  // namespace strata::kernels
