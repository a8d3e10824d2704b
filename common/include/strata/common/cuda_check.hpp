#pragma once
// The one checking macro for CUDA runtime calls. Include only from translation
// units that are built with CUDA (the cuda device backend and kernels/cuda); the
// rest of strata never sees a CUDA header.
//
//   STRATA_CUDA_TRY(expr)    returns a failed Status (Unavailable for "no device /
//                            no driver", Internal otherwise) naming the expression,
//                            the CUDA error and file:line.
//   STRATA_CUDA_CHECK(expr)  aborts with the same text (for calls that cannot fail
//                            unless strata has a bug, e.g. in destructors).

#include <cuda_runtime_api.h>

#include "strata/common/assert.hpp"
#include "strata/common/status.hpp"

namespace strata::detail {

inline Status cuda_status(cudaError_t err, const char* expr, const char* file, int line) {
  const bool missing =
      err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || err == cudaErrorInitializationError;
  return Status(missing ? StatusCode::kUnavailable : StatusCode::kInternal,
                fmt::format("CUDA call {} failed: {} ({}) at {}:{}", expr, cudaGetErrorString(err),
                            cudaGetErrorName(err), file, line));
}

}  // namespace strata::detail

#define STRATA_CUDA_TRY(expr)                                                            \
  do {                                                                                   \
    cudaError_t strata_cuda_err_ = (expr);                                               \
    if (strata_cuda_err_ != cudaSuccess) [[unlikely]]                                    \
      return ::strata::detail::cuda_status(strata_cuda_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define STRATA_CUDA_CHECK(expr)                                                                        \
  do {                                                                                                 \
    cudaError_t strata_cuda_err_ = (expr);                                                             \
    if (strata_cuda_err_ != cudaSuccess) [[unlikely]]                                                  \
      ::strata::detail::check_failed(#expr, cudaGetErrorString(strata_cuda_err_), __FILE__, __LINE__); \
  } while (0)
