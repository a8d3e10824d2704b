// CUDA multi-tensor apply: one launch per pass and dtype signature over the
// block table of plan_grid(); each block runs grid_thread() per thread and
// thread 0 combines the block (Note [Emulated grid] in grid_index.hpp).
// Status handling lives in cuda_backend.cpp (see cuda_launch.hpp for why).
#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda/cuda_launch.hpp"

namespace strata::kernels::cudak {
namespace {

template <typename Op>
__global__ void mta_kernel(Op op, const Span* spans, const GridBlock* table, std::uint32_t first_block,
                           PassArgs pa, const float* trust, GridPartial* partials) {
  extern __shared__ unsigned char smem[];
  auto* accs = reinterpret_cast<Acc<float>*>(smem);
  const std::uint32_t block = first_block + blockIdx.x;
  accs[threadIdx.x] = grid_thread(op, spans, table, block, threadIdx.x, blockDim.x, pa, trust);
  __syncthreads();
  if (threadIdx.x == 0) partials[block] = grid_combine(accs, blockDim.x);
}

__global__ void triad_kernel(float* a, const float* b, const float* c, float s, std::size_t n) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += stride)
    a[i] = b[i] + s * c[i];
}

#define STRATA_CUDAK_TRY(expr)     \
  do {                             \
    cudaError_t e_ = (expr);       \
    if (e_ != cudaSuccess) {       \
      *what = #expr;               \
      return static_cast<int>(e_); \
    }                              \
  } while (0)

//! Device scratch of one pass, freed on every return path.
struct Scratch {
  void* ptrs[4] = {};
  int count = 0;
  ~Scratch() {
    for (int i = 0; i < count; ++i) cudaFree(ptrs[i]);
  }
  cudaError_t alloc(void** p, std::size_t bytes) {
    cudaError_t e = cudaMalloc(p, bytes < 1 ? 1 : bytes);
    if (e == cudaSuccess) ptrs[count++] = *p;
    return e;
  }
};

bool same_signature(const Span& a, const Span& b) {
  return a.grad_dtype == b.grad_dtype && a.param_dtype == b.param_dtype && a.state_dtype == b.state_dtype;
}

}  // namespace

int run_pass(void* stream_ptr, Pass pass, const Hyper& h, const Span* spans, std::size_t span_count,
             const GridBlock* table, std::size_t block_count, std::uint32_t block_threads, const PassArgs& pa,
             const float* trust, GridPartial* partials, const char** what) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  Scratch scratch;
  void *d_spans = nullptr, *d_table = nullptr, *d_trust = nullptr, *d_partials = nullptr;
  STRATA_CUDAK_TRY(scratch.alloc(&d_spans, span_count * sizeof(Span)));
  STRATA_CUDAK_TRY(scratch.alloc(&d_table, block_count * sizeof(GridBlock)));
  STRATA_CUDAK_TRY(scratch.alloc(&d_partials, block_count * sizeof(GridPartial)));
  STRATA_CUDAK_TRY(
      cudaMemcpyAsync(d_spans, spans, span_count * sizeof(Span), cudaMemcpyHostToDevice, stream));
  STRATA_CUDAK_TRY(
      cudaMemcpyAsync(d_table, table, block_count * sizeof(GridBlock), cudaMemcpyHostToDevice, stream));
  if (trust != nullptr) {
    STRATA_CUDAK_TRY(scratch.alloc(&d_trust, span_count * sizeof(float)));
    STRATA_CUDAK_TRY(
        cudaMemcpyAsync(d_trust, trust, span_count * sizeof(float), cudaMemcpyHostToDevice, stream));
  }
  const std::size_t smem = block_threads * sizeof(Acc<float>);
  for (std::size_t first = 0; first < block_count;) {
    const Span& s = spans[table[first].span];
    std::size_t last = first + 1;
    while (last < block_count && same_signature(spans[table[last].span], s)) ++last;
    const bool known = with_op(pass, h, s, [&](const auto& op) {
      mta_kernel<<<static_cast<unsigned>(last - first), block_threads, smem, stream>>>(
          op, static_cast<const Span*>(d_spans), static_cast<const GridBlock*>(d_table),
          static_cast<std::uint32_t>(first), pa, static_cast<const float*>(d_trust),
          static_cast<GridPartial*>(d_partials));
    });
    if (!known) {
      *what = "with_op: unsupported dtype combination (validate_spans should have refused it)";
      return static_cast<int>(cudaErrorInvalidValue);
    }
    STRATA_CUDAK_TRY(cudaGetLastError());
    first = last;
  }
  STRATA_CUDAK_TRY(cudaMemcpyAsync(partials, d_partials, block_count * sizeof(GridPartial),
                                   cudaMemcpyDeviceToHost, stream));
  STRATA_CUDAK_TRY(cudaStreamSynchronize(stream));
  return 0;
}

int triad(float* a, const float* b, const float* c, std::size_t n, float* ms, const char** what) {
  cudaEvent_t start = nullptr, stop = nullptr;
  STRATA_CUDAK_TRY(cudaEventCreate(&start));
  STRATA_CUDAK_TRY(cudaEventCreate(&stop));
  STRATA_CUDAK_TRY(cudaEventRecord(start));
  triad_kernel<<<4096, 256>>>(a, b, c, 3.0f, n);
  STRATA_CUDAK_TRY(cudaGetLastError());
  STRATA_CUDAK_TRY(cudaEventRecord(stop));
  STRATA_CUDAK_TRY(cudaEventSynchronize(stop));
  STRATA_CUDAK_TRY(cudaEventElapsedTime(ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 0;
}

}  // namespace strata::kernels::cudak
