// CUDA multi-tensor apply: one launch per pass and dtype signature over the
// block table of plan_grid(); each block runs grid_thread() per thread and
// thread 0 combines the block (Note [Emulated grid] in grid_index.hpp).
// Status handling lives in cuda_backend.cpp (see cuda_launch.hpp for why).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>

#include "cuda/cuda_launch.hpp"

namespace strata::kernels::cudak {
namespace {

template <typename Op>
__global__ void mta_kernel(Op op, const Span* spans, const GridBlock* table, std::uint32_t first_block,
                           PassArgs pa, const float* trust, GridPartial* partials,
                           const std::uint32_t* gate) {
  extern __shared__ unsigned char smem[];
  const std::uint32_t block = first_block + blockIdx.x;
  if (gate != nullptr && *gate != 0) {  // the whole block skips: a gradient was non-finite
    if (threadIdx.x == 0) partials[block] = GridPartial{0.0, 0.0, 0};
    return;
  }
  auto* accs = reinterpret_cast<Acc<float>*>(smem);
  accs[threadIdx.x] = grid_thread(op, spans, table, block, threadIdx.x, blockDim.x, pa, trust);
  __syncthreads();
  if (threadIdx.x == 0) partials[block] = grid_combine(accs, blockDim.x);
}

//! One block: *flag = 1 when any partial is non-finite or their sum overflows.
__global__ void flag_kernel(const GridPartial* partials, std::size_t count, std::uint32_t* flag) {
  __shared__ double sums[256];
  __shared__ std::uint32_t bad[256];
  double sum = 0.0;
  std::uint32_t nonfinite = 0;
  for (std::size_t i = threadIdx.x; i < count; i += blockDim.x) {
    sum += partials[i].a;
    nonfinite |= partials[i].nonfinite;
  }
  sums[threadIdx.x] = sum;
  bad[threadIdx.x] = nonfinite;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    std::uint32_t any = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) {
      total += sums[t];
      any |= bad[t];
    }
    *flag = (any != 0 || !isfinite(total)) ? 1u : 0u;
  }
}

__global__ void triad_kernel(float* a, const float* b, const float* c, float s, std::size_t n) {
  const std::size_t stride = std::size_t{gridDim.x} * blockDim.x;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += stride)
    a[i] = b[i] + s * c[i];
}

}  // namespace

//! A device buffer and its pinned host twin, grown (never shrunk) on demand.
struct Buffer {
  void* device = nullptr;
  void* host = nullptr;  // pinned; null for device-only buffers
  std::size_t bytes = 0;
  cudaError_t reserve(std::size_t need, bool with_host) {
    if (need <= bytes) return cudaSuccess;
    release();
    need = std::max<std::size_t>(need, 4096);
    cudaError_t e = cudaMalloc(&device, need);
    if (e == cudaSuccess && with_host) e = cudaMallocHost(&host, need);
    if (e == cudaSuccess) bytes = need;
    return e;
  }
  void release() {
    if (device != nullptr) cudaFree(device);
    if (host != nullptr) cudaFreeHost(host);
    device = host = nullptr;
    bytes = 0;
  }
};

struct PassScratch {
  Buffer spans, table, trust, partials, flag;
  cudaEvent_t done = nullptr;
  bool pending = false;  //!< a pass was enqueued; its staging may still be read
  std::size_t block_count = 0;
};

namespace {
bool same_signature(const Span& a, const Span& b) {
  return a.grad_dtype == b.grad_dtype && a.param_dtype == b.param_dtype && a.state_dtype == b.state_dtype;
}

}  // namespace

int scratch_create(PassScratch** out, const char** what) {
  auto* s = new PassScratch;
  cudaError_t e = cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = s->flag.reserve(sizeof(std::uint32_t), true);
  if (e == cudaSuccess) e = cudaMemset(s->flag.device, 0, sizeof(std::uint32_t));
  if (e != cudaSuccess) {
    *what = "scratch_create (cudaEventCreate / cudaMalloc / cudaMallocHost)";
    scratch_destroy(s);
    return static_cast<int>(e);
  }
  *out = s;
  return 0;
}

void scratch_destroy(PassScratch* s) {
  if (s == nullptr) return;
  if (s->done != nullptr) {
    cudaEventSynchronize(s->done);  // no copy may still use the buffers
    cudaEventDestroy(s->done);
  }
  for (Buffer* b : {&s->spans, &s->table, &s->trust, &s->partials, &s->flag}) b->release();
  delete s;
}

void* scratch_event(PassScratch* s) {
  return s->done;
}

int enqueue_pass(void* stream_ptr, PassScratch* s, Pass pass, const Hyper& h, const Span* spans,
                 std::size_t span_count, const GridBlock* table, std::size_t block_count,
                 std::uint32_t block_threads, const PassArgs& pa, const float* trust, bool gated,
                 const char** what) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  // The staging is rewritten below: the previous pass's uploads must be done.
  if (s->pending) STRATA_CUDAK_TRY(cudaEventSynchronize(s->done));
  STRATA_CUDAK_TRY(s->spans.reserve(span_count * sizeof(Span), true));
  STRATA_CUDAK_TRY(s->table.reserve(block_count * sizeof(GridBlock), true));
  STRATA_CUDAK_TRY(s->partials.reserve(block_count * sizeof(GridPartial), true));
  std::memcpy(s->spans.host, spans, span_count * sizeof(Span));
  std::memcpy(s->table.host, table, block_count * sizeof(GridBlock));
  STRATA_CUDAK_TRY(cudaMemcpyAsync(s->spans.device, s->spans.host, span_count * sizeof(Span),
                                   cudaMemcpyHostToDevice, stream));
  STRATA_CUDAK_TRY(cudaMemcpyAsync(s->table.device, s->table.host, block_count * sizeof(GridBlock),
                                   cudaMemcpyHostToDevice, stream));
  const float* d_trust = nullptr;
  if (trust != nullptr) {
    STRATA_CUDAK_TRY(s->trust.reserve(span_count * sizeof(float), true));
    std::memcpy(s->trust.host, trust, span_count * sizeof(float));
    STRATA_CUDAK_TRY(cudaMemcpyAsync(s->trust.device, s->trust.host, span_count * sizeof(float),
                                     cudaMemcpyHostToDevice, stream));
    d_trust = static_cast<const float*>(s->trust.device);
  }
  const std::uint32_t* gate = gated ? static_cast<const std::uint32_t*>(s->flag.device) : nullptr;
  const std::size_t smem = block_threads * sizeof(Acc<float>);
  for (std::size_t first = 0; first < block_count;) {
    const Span& sp = spans[table[first].span];
    std::size_t last = first + 1;
    while (last < block_count && same_signature(spans[table[last].span], sp)) ++last;
    const bool known = with_op(pass, h, sp, [&](const auto& op) {
      mta_kernel<<<static_cast<unsigned>(last - first), block_threads, smem, stream>>>(
          op, static_cast<const Span*>(s->spans.device), static_cast<const GridBlock*>(s->table.device),
          static_cast<std::uint32_t>(first), pa, d_trust, static_cast<GridPartial*>(s->partials.device),
          gate);
    });
    if (!known) {
      *what = "with_op: unsupported dtype combination (validate_spans should have refused it)";
      return static_cast<int>(cudaErrorInvalidValue);
    }
    STRATA_CUDAK_TRY(cudaGetLastError());
    first = last;
  }
  STRATA_CUDAK_TRY(cudaMemcpyAsync(s->partials.host, s->partials.device, block_count * sizeof(GridPartial),
                                   cudaMemcpyDeviceToHost, stream));
  STRATA_CUDAK_TRY(
      cudaMemcpyAsync(s->flag.host, s->flag.device, sizeof(std::uint32_t), cudaMemcpyDeviceToHost, stream));
  STRATA_CUDAK_TRY(cudaEventRecord(s->done, stream));
  s->pending = true;
  s->block_count = block_count;
  return 0;
}

int enqueue_flag(void* stream_ptr, PassScratch* check, PassScratch* gate_of, const char** what) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  flag_kernel<<<1, 256, 0, stream>>>(static_cast<const GridPartial*>(check->partials.device),
                                     check->block_count, static_cast<std::uint32_t*>(gate_of->flag.device));
  STRATA_CUDAK_TRY(cudaGetLastError());
  return 0;
}

int wait_pass(PassScratch* s, const GridPartial** partials, std::uint32_t* flag, const char** what) {
  if (s->pending) STRATA_CUDAK_TRY(cudaEventSynchronize(s->done));
  s->pending = false;
  *partials = static_cast<const GridPartial*>(s->partials.host);
  *flag = *static_cast<const std::uint32_t*>(s->flag.host);
  return 0;
}

int run_pass(void* stream, PassScratch* s, Pass pass, const Hyper& h, const Span* spans,
             std::size_t span_count, const GridBlock* table, std::size_t block_count,
             std::uint32_t block_threads, const PassArgs& pa, const float* trust, GridPartial* partials,
             const char** what) {
  const int err = enqueue_pass(stream, s, pass, h, spans, span_count, table, block_count, block_threads, pa,
                               trust, false, what);
  if (err != 0) return err;
  const GridPartial* landed = nullptr;
  std::uint32_t flag = 0;
  const int waited = wait_pass(s, &landed, &flag, what);
  if (waited != 0) return waited;
  std::memcpy(partials, landed, block_count * sizeof(GridPartial));
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
