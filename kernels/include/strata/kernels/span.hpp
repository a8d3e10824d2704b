#pragma once
// Span: the memory one optimizer call updates, as raw pointers. Plain data with
// no Status or fmt, so CUDA translation units can include it (see cuda.hpp).

#include <array>
#include <cstddef>
#include <cstdint>

#include "strata/kernels/dtype.hpp"

namespace strata::kernels {

//! Elements per unit of parallel work (see Note [Deterministic threading]).
inline constexpr std::size_t kPieceElems = std::size_t{64} * 1024;
//! Elements per block of in-width partial sums.
inline constexpr std::size_t kBlockElems = 1024;
//! How far ahead, in elements, the SIMD CPU kernels prefetch their read streams
//! (Note [Software prefetch] in kernels/src/cpu/driver.hpp).
inline constexpr std::size_t kPrefetchElems = 512;

//! One slice of a tensor family: all pointers cover the same n elements.
//! Non-owning; the caller keeps the memory alive and unshared for the call.
struct Span {
  float* master = nullptr;     //!< fp32 master weights, read and written
  const void* grad = nullptr;  //!< gradient, grad_dtype
  DType grad_dtype = DType::kF32;
  void* param = nullptr;             //!< compute-dtype param copy written in the same pass; may be null
  DType param_dtype = DType::kNone;  //!< kNone when param is null
  std::array<void*, 2> state{};      //!< optimizer states (hyper.hpp lists them per optimizer)
  DType state_dtype = DType::kF32;   //!< kBF16 allowed for Adam, AdamW and LAMB
  std::size_t n = 0;                 //!< elements (0 is allowed: nothing to do)
  std::uint32_t tensor = 0;          //!< tensor id: LAMB/LARS norms are per tensor
  //! Where element 0 lies in its 64-element group (its chunk offset mod 64):
  //! norms are summed in groups aligned to the chunk (Note [Exact norms] in exact_sum.hpp).
  std::uint32_t group_phase = 0;
};

}  // namespace strata::kernels
