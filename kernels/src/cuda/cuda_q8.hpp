#pragma once
// The boundary between the nvcc-compiled q8 kernel (cuda_q8.cu) and the
// host-compiled cuda_backend.cpp: plain types only (why: cuda_launch.hpp).

#include <cstddef>
#include <cstdint>

#include "q8_search.hpp"
#include "strata/kernels/q8_span.hpp"
#include "strata/kernels/rules/adam.hpp"

namespace strata::kernels::cudak {

//! Runs q8 Adam (Note [Q8 on CUDA]) over every span (device or managed memory) on `stream`, one CUDA
//! block per q8 block, and waits for it. The tables go to the device once per
//! process. *nonfinite: some gradient was Inf/NaN in the pass (its block was
//! still written, as on the CPU). Returns a cudaError_t value, naming the call in *what.
int q8_run(void* stream, const Q8Span* spans, std::size_t count, const AdamCoeffs& c, float grad_scale,
           const cpu::Q8Tables& tables, bool* nonfinite, const char** what);

}  // namespace strata::kernels::cudak
