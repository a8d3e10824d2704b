// The q8 Adam kernel on CUDA (Note [Q8 on CUDA]). Status handling lives in
// cuda_backend.cpp (see cuda_launch.hpp for why).
//
// Note [Q8 on CUDA]
// The algorithm of Note [Q8 step] in q8.hpp, one CUDA block of kQ8BlockElems
// threads per q8 block, one element a thread: dequantize (map[code] * scale),
// the Adam rule of rules/adam.hpp, the block's max |m| and |v| by a tree in
// shared memory (max is exact in any order), then each thread's code by the
// bucket search of Note [Q8 nearest-code search] on the same tables the CPU
// builds (uploaded once). Every float operation is a round-to-nearest
// intrinsic (__fmul_rn, __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn), which
// nvcc never contracts into an FMA, so the results are the CPU kernels' bits
// whatever --fmad says. Threads past a partial block's end take m = v = 0, as
// the CPU's padding lanes do. Deterministic: no atomics but the non-finite flag.
// Compiled here; it has not run (no GPU on the build machine): test_cuda_q8
// (label gpu) compares it with the CPU kernel bit for bit where a GPU is.
#include <cuda_runtime_api.h>

#include <mutex>

#include "cuda/cuda_launch.hpp"
#include "cuda/cuda_q8.hpp"
#include "strata/kernels/lanes.hpp"

namespace strata::kernels::cudak {
namespace {

constexpr unsigned kThreads = kQ8BlockElems;

//! a op b rounded to nearest, never contracted: the intrinsics on the device,
//! plain float ops in the host pass (which only needs the STRATA_HD rule to compile).
#if defined(__CUDA_ARCH__)
#define STRATA_Q8_RN(intrinsic, op, a, b) intrinsic(a, b)
#else
#define STRATA_Q8_RN(intrinsic, op, a, b) ((a)op(b))
#endif

//! A float whose operations are unfused and rounded to nearest (Note [Q8 on CUDA]).
struct Rn {
  float v;
  __host__ __device__ Rn(float x) : v(x) {}  // NOLINT: converts like float
  friend __host__ __device__ Rn operator+(Rn a, Rn b) { return Rn(STRATA_Q8_RN(__fadd_rn, +, a.v, b.v)); }
  friend __host__ __device__ Rn operator-(Rn a, Rn b) { return Rn(STRATA_Q8_RN(__fsub_rn, -, a.v, b.v)); }
  friend __host__ __device__ Rn operator*(Rn a, Rn b) { return Rn(STRATA_Q8_RN(__fmul_rn, *, a.v, b.v)); }
  friend __host__ __device__ Rn operator/(Rn a, Rn b) { return Rn(STRATA_Q8_RN(__fdiv_rn, /, a.v, b.v)); }
};
__host__ __device__ inline Rn madd(Rn a, Rn b, Rn c) {
  return a * b + c;
}
__host__ __device__ inline Rn vsqrt(Rn x) {
#if defined(__CUDA_ARCH__)
  return Rn(__fsqrt_rn(x.v));
#else
  return Rn(vsqrt(x.v));
#endif
}

//! max |x| over the block's threads (vmax of hd.hpp: exact for non-NaN values).
__device__ float block_max(float* red, float x) {
  red[threadIdx.x] = x;
  __syncthreads();
  for (unsigned half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) red[threadIdx.x] = vmax(red[threadIdx.x], red[threadIdx.x + half]);
    __syncthreads();
  }
  const float m = red[0];
  __syncthreads();  // red is reused by the next call
  return m;
}

//! The code of x (Q8Lanes<float>::quantize in cpu/q8_driver.hpp).
__device__ std::uint8_t q8_code(const cpu::Q8Search& s, float x) {
  const std::uint32_t bits = __float_as_uint(x);
  const std::uint32_t e = s.entry[cpu::q8_bucket(bits)];
  return static_cast<std::uint8_t>((e >> 16) + ((e & cpu::kQ8KeyMask) < cpu::q8_key(bits) ? 1u : 0u));
}

template <DType G, DType P>
__global__ void q8_kernel(Q8Span s, AdamCoeffs c, float grad_scale, const cpu::Q8Tables* tab,
                          std::uint32_t* nonfinite) {
  __shared__ float red[kThreads];
  const std::size_t blk = blockIdx.x;
  const std::size_t i = blk * kThreads + threadIdx.x;
  const bool in = i < s.n;
  Rn m(0.0f), v(0.0f);
  if (in) {
    const Rn g = Rn(load<float, G>(s.grad, i)) * Rn(grad_scale);
    if (!isfinite(g.v)) atomicOr(nonfinite, 1u);
    Rn p(s.master[i]);
    m = Rn(tab->signed_map[s.m_codes[i]]) * Rn(s.m_scales[blk]);
    v = Rn(tab->unsigned_map[s.v_codes[i]]) * Rn(s.v_scales[blk]);
    adam_rule(p, m, v, g, c);
    s.master[i] = p.v;
    store<float, P>(s.param, i, p.v);
  }
  const float m_scale = block_max(red, fabsf(m.v));
  const float v_scale = block_max(red, fabsf(v.v));
  if (threadIdx.x == 0) {
    s.m_scales[blk] = m_scale;
    s.v_scales[blk] = v_scale;
  }
  if (!in) return;
  const Rn m_inv(m_scale > 0.0f ? __fdiv_rn(1.0f, m_scale) : 0.0f);
  const Rn v_inv(v_scale > 0.0f ? __fdiv_rn(1.0f, v_scale) : 0.0f);
  s.m_codes[i] = q8_code(tab->signed_search, (m * m_inv).v);
  s.v_codes[i] = q8_code(tab->unsigned_search, (v * v_inv).v);
}

//! The tables on the device, uploaded by the first call (never freed: one per process).
int device_tables(const cpu::Q8Tables& host, const cpu::Q8Tables** out, const char** what) {
  static std::mutex mu;
  static cpu::Q8Tables* d = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (d == nullptr) {
    cpu::Q8Tables* t = nullptr;
    STRATA_CUDAK_TRY(cudaMalloc(&t, sizeof(cpu::Q8Tables)));
    STRATA_CUDAK_TRY(cudaMemcpy(t, &host, sizeof(cpu::Q8Tables), cudaMemcpyHostToDevice));
    d = t;
  }
  *out = d;
  return 0;
}

}  // namespace

int q8_run(void* stream_ptr, const Q8Span* spans, std::size_t count, const AdamCoeffs& c, float grad_scale,
           const cpu::Q8Tables& tables, bool* nonfinite, const char** what) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const cpu::Q8Tables* tab = nullptr;
  if (const int e = device_tables(tables, &tab, what); e != 0) return e;
  std::uint32_t* flag = nullptr;
  STRATA_CUDAK_TRY(cudaMalloc(&flag, sizeof(std::uint32_t)));
  int err = 0;
  auto run = [&]() -> int {
    STRATA_CUDAK_TRY(cudaMemsetAsync(flag, 0, sizeof(std::uint32_t), stream));
    for (std::size_t k = 0; k < count; ++k) {
      const Q8Span& s = spans[k];
      if (s.n == 0) continue;
      const auto blocks = static_cast<unsigned>((s.n + kThreads - 1) / kThreads);
      const bool known = detail::on_grad_dtype(s.grad_dtype, [&](auto gt) {
        return detail::on_param_dtype(s.param_dtype, [&](auto pt) {
          q8_kernel<decltype(gt)::value, decltype(pt)::value>
              <<<blocks, kThreads, 0, stream>>>(s, c, grad_scale, tab, flag);
          return true;
        });
      });
      if (!known) {
        *what = "q8 kernel: unsupported dtypes (q8_validate should have refused them)";
        return static_cast<int>(cudaErrorInvalidValue);
      }
      STRATA_CUDAK_TRY(cudaGetLastError());
    }
    std::uint32_t host_flag = 0;
    STRATA_CUDAK_TRY(cudaMemcpyAsync(&host_flag, flag, sizeof host_flag, cudaMemcpyDeviceToHost, stream));
    STRATA_CUDAK_TRY(cudaStreamSynchronize(stream));
    *nonfinite = host_flag != 0;
    return 0;
  };
  err = run();
  cudaFree(flag);
  return err;
}

}  // namespace strata::kernels::cudak
