// Runs the memory-only kernels (Note [Memory-only roofline]) with the piece
// split and pool of kernels::step, and builds their passes from a step's Span.
#include "roofline/mem_roofline.hpp"

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "roofline/mem_kernel_fns.hpp"
#include "strata/common/thread_pool.hpp"

namespace strata::bench {
namespace {

using kernels::DType;
using kernels::Isa;
using kernels::Optimizer;

// The kernels never fold this: it is read at run time.
volatile std::uint32_t g_zero = 0;

// The kernels of one Isa (the CPU must support it).
struct IsaFns {
  roofline::MemPieceFn mem = nullptr;
  roofline::TriadPieceFn triad = nullptr;
};

IsaFns isa_fns(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return {&roofline::mem_piece_scalar, &roofline::triad_piece_scalar};
    case Isa::kAvx2:
      return {&roofline::mem_piece_avx2, &roofline::triad_piece_avx2};
    case Isa::kAvx512:
      return {&roofline::mem_piece_avx512, &roofline::triad_piece_avx512};
  }
  return {};
}

Status check_isa(Isa isa) {
  if (kernels::isa_supported(isa)) return Status::Ok();
  return unavailable("memory-only kernel: this CPU lacks {}; use scalar or leave the isa unset",
                     kernels::isa_name(isa));
}

// Calls fn(begin, end) for every kernels::kPieceElems piece of [0, n) on the
// pool as kernels::step does (parallel_for, default parts); returns the threads seen.
template <typename Fn>
std::size_t for_pieces(std::size_t n, ThreadPool* pool, const Fn& fn) {
  const std::size_t pieces = (n + kernels::kPieceElems - 1) / kernels::kPieceElems;
  std::vector<std::thread::id> ids(pool ? pool->size() : 1);
  auto body = [&](std::size_t part, std::size_t lo, std::size_t hi) {
    ids[part] = std::this_thread::get_id();
    for (std::size_t k = lo; k < hi; ++k) {
      fn(k * kernels::kPieceElems, std::min(n, (k + 1) * kernels::kPieceElems), k);
    }
  };
  if (pool == nullptr || pieces < 2) {
    body(0, 0, pieces);
  } else {
    pool->parallel_for(pieces, 0, body);
  }
  std::vector<std::thread::id> seen;
  for (const auto& id : ids) {
    if (id != std::thread::id() && std::find(seen.begin(), seen.end(), id) == seen.end()) seen.push_back(id);
  }
  return seen.size();
}

MemStream stream(const void* data, DType d, bool write) {
  if (data == nullptr || d == DType::kNone) return {};
  return {const_cast<void*>(data), static_cast<std::uint8_t>(kernels::dtype_size(d)), write};
}

}  // namespace

double MemPass::bytes_per_elem() const {
  double b = grad.elem_bytes + param.elem_bytes;
  for (const MemStream* s : {&master, &state[0], &state[1]}) b += s->elem_bytes * (s->write ? 2 : 1);
  for (const MemStream& s : block_scales) {
    b += double(s.elem_bytes) * (s.write ? 2 : 1) / double(kernels::kQ8BlockElems);
  }
  return b;
}

const char* mem_variant_name(MemVariant v) {
  return v == MemVariant::kWritePrefetch ? "write_prefetch" : "kernel_prefetch";
}

Result<MemTiming> run_mem_passes(std::span<const MemPass> passes, ThreadPool* pool, Isa isa,
                                 MemVariant variant) {
  STRATA_RETURN_IF_ERROR(check_isa(isa));
  const roofline::MemPieceFn fn = isa_fns(isa).mem;
  const std::uint32_t zero = g_zero;
  MemTiming t;
  std::vector<std::uint64_t> sinks;
  const auto t0 = std::chrono::steady_clock::now();
  for (const MemPass& m : passes) {
    sinks.assign((m.n + kernels::kPieceElems - 1) / kernels::kPieceElems, 0);
    bool known = true;
    const std::size_t used = for_pieces(m.n, pool, [&](std::size_t lo, std::size_t hi, std::size_t k) {
      if (!fn(m, variant, lo, hi, zero, &sinks[k])) known = false;
    });
    if (!known) {
      return internal_error(
          "memory-only kernel: kShapes has no pass of grad {} B, master {} B ({}), states {} B",
          m.grad.elem_bytes, m.master.elem_bytes, m.master.write ? "rw" : "r", m.state[0].elem_bytes);
    }
    t.threads_used = std::max(t.threads_used, used);
  }
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::uint64_t total = 0;
  for (std::uint64_t s : sinks) total += s;
  g_zero = static_cast<std::uint32_t>(total * 0);  // keeps the sums alive
  return t;
}

Result<double> run_triad(float* a, const float* b, const float* c, std::size_t n, ThreadPool* pool, Isa isa) {
  STRATA_RETURN_IF_ERROR(check_isa(isa));
  const roofline::TriadPieceFn fn = isa_fns(isa).triad;
  const float s = 3.0f + static_cast<float>(g_zero);
  const auto t0 = std::chrono::steady_clock::now();
  for_pieces(n, pool, [&](std::size_t lo, std::size_t hi, std::size_t) { fn(a, b, c, s, lo, hi); });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

MemPass mem_pass_for_q8(const kernels::Q8Span& span) {
  MemPass m;
  m.n = span.n;
  m.grad = stream(span.grad, span.grad_dtype, false);
  m.master = stream(span.master, DType::kF32, true);
  m.state[0] = {span.m_codes, 1, true};
  m.state[1] = {span.v_codes, 1, true};
  m.param = stream(span.param, span.param_dtype, true);
  m.block_scales[0] = stream(span.m_scales, DType::kF32, true);
  m.block_scales[1] = stream(span.v_scales, DType::kF32, true);
  return m;
}

MemPass mem_pass_for_grad_stats(const kernels::Span& span) {
  MemPass m;
  m.n = span.n;
  m.grad = stream(span.grad, span.grad_dtype, false);
  return m;
}

std::vector<MemPass> mem_passes_for_step(const kernels::Hyper& hyper, const kernels::Span& span,
                                         bool grad_check_pass) {
  const Optimizer o = hyper.optimizer;
  const int states = o == Optimizer::kAdam || o == Optimizer::kAdamW || o == Optimizer::kLamb ? 2
                     : (o == Optimizer::kSgd || o == Optimizer::kLars) ? (hyper.momentum != 0.0f ? 1 : 0)
                                                                       : 1;
  // A pass with the given roles of each stream (kernels/src/orchestrate.cpp, ops.hpp).
  auto pass = [&](bool grad, int master, bool state_write, bool param) {
    MemPass m;
    m.n = span.n;
    if (grad) m.grad = stream(span.grad, span.grad_dtype, false);
    if (master) m.master = stream(span.master, DType::kF32, master == 2);
    for (int k = 0; k < states; ++k) m.state[k] = stream(span.state[k], span.state_dtype, state_write);
    if (param) m.param = stream(span.param, span.param_dtype, true);
    return m;
  };
  std::vector<MemPass> passes;
  if (grad_check_pass && o != Optimizer::kLars) passes.push_back(mem_pass_for_grad_stats(span));
  if (o == Optimizer::kLamb) {
    passes.push_back(pass(true, 1, true, false));   // phase 1: m, v updated; ||p||, ||u||
    passes.push_back(pass(false, 2, false, true));  // phase 2: reads no gradient
  } else if (o == Optimizer::kLars) {
    MemPass p1 = pass(true, 1, false, false);  // read-only: ||p||, ||g||
    p1.state = {};
    passes.push_back(p1);
    passes.push_back(pass(true, 2, true, true));
  } else {
    passes.push_back(pass(true, 2, true, true));
  }
  return passes;
}

}  // namespace strata::bench
