// strata-bench optim's measurement: the buffers of one configuration and its
// interleaved timings (bench_optim.cpp runs it per row and prints the rows).
//
// Note [Bytes per param]
// bytes_per_param counts what the pass must move in memory, reads plus writes:
// gradient read, master read + write, each state read + write, param copy
// write; LAMB and LARS count both phases (Note [Two-phase trust ratio]). The
// kernel rate (mparams_per_s) is kernels::step() with GradCheck::kCallerChecked:
// the fused pass(es) alone. Its roofline is the memory-only kernel of
// bench/roofline (Note [Memory-only roofline]) over the same buffers, so
// roofline_fraction = kernel rate / memory-only rate can fall below 1 and
// cannot honestly exceed it by more than noise. The q8 row (8-bit m and v) is
// kernels::step_q8 with kCallerChecked, its bytes and roofline those of
// Note [Q8 roofline]; the runtime has no q8 path yet, so it has no rt figures.
//
// Note [Runtime path]
// runtime_path_mparams_per_s times the calls runtime/src/pipeline/optimizer_run.cpp's
// run_kernels makes on the host for a host family whose gradient came down from
// the device: the gradient was checked on the device before its d2h copy
// (runtime/src/pipeline/grad_check.cpp, Note [Gradient check on the device]), so the CPU
// runs kernels::step() with GradCheck::kCallerChecked and the device's
// GradStats (here: taken once, untimed, by grad_stats over the same buffers).
// With clip_max_norm > 0 or loss scaling (runtime/src/step.cpp,
// deferred_prepass) the norm comes from the same device checks: the clip
// coefficient from it, then the same step(): runtime_path_clip_mparams_per_s.
// A gradient already on host (written back between micro-batches), or a device
// that cannot check (CUDA, for now), costs the kernel's own check:
// runtime_path_host_grad_mparams_per_s times step() with kSeparatePass (one
// more read of the gradient). The bench gives one Span for the whole buffer;
// the runtime gives one per tensor of a family.
#include "optim_measure.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <memory>

#include "strata/common/log.hpp"
#include "strata/kernels/cuda.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::bench::optim {

using namespace strata::kernels;

std::vector<Config> configs() {
  using D = DType;
  return {
      {Optimizer::kAdamW, D::kF32, D::kNone, D::kF32},
      {Optimizer::kAdamW, D::kF32, D::kNone, D::kNone, false, true},
      {Optimizer::kAdamW, D::kBF16, D::kBF16, D::kF32},
      {Optimizer::kAdamW, D::kBF16, D::kBF16, D::kBF16},
      {Optimizer::kAdam, D::kF32, D::kNone, D::kF32},
      {Optimizer::kLamb, D::kF32, D::kNone, D::kF32},
      {Optimizer::kLamb, D::kBF16, D::kBF16, D::kF32},
      {Optimizer::kLars, D::kF32, D::kNone, D::kF32},
      {Optimizer::kSgd, D::kF32, D::kNone, D::kF32},
      {Optimizer::kLion, D::kF32, D::kNone, D::kF32},
      {Optimizer::kAdagrad, D::kF32, D::kNone, D::kF32},
      {Optimizer::kSgd, D::kF32, D::kNone, D::kF32, true},
  };
}

namespace {

Hyper hyper_for(Optimizer o) {
  Hyper h;
  h.optimizer = o;
  h.weight_decay = 0.01f;
  if (o == Optimizer::kSgd || o == Optimizer::kLars) h.momentum = 0.9f;
  return h;
}

// Full-size states per element, as the kernel keeps them with hyper_for's settings.
int state_count(Optimizer o) {
  return static_cast<int>(kernels::optimizer_state_count(hyper_for(o)));
}

}  // namespace

// Note [Bytes per param].
double bytes_per_param(const Config& c) {
  const double g = double(dtype_size(c.grad)), p = double(dtype_size(c.param)),
               s = double(dtype_size(c.state));
  if (c.grad_norm_only) return g;
  if (c.q8) return g + 8 + 2 * 2 * 1 + 2 * 2 * 4.0 / double(kQ8BlockElems) + p;  // Note [Q8 roofline]
  switch (c.optimizer) {
    case Optimizer::kLamb:
      return (g + 4 + 4 * s) + (2 * s + 8 + p);  // phase 1 + phase 2
    case Optimizer::kLars:
      return (g + 4) + (g + 8 + 8 + p);  // read-only phase 1 + update
    default:
      return g + 8 + 2 * s * state_count(c.optimizer) + p;
  }
}

std::string torch_name(Optimizer o) {
  switch (o) {
    case Optimizer::kAdam:
      return "adam";
    case Optimizer::kAdamW:
      return "adamw";
    case Optimizer::kSgd:
      return "sgd";
    case Optimizer::kAdagrad:
      return "adagrad";
    default:
      return "";
  }
}

namespace {

//! One owned host buffer, first-touched by the pool (pages land where the workers run).
struct HostBuf {
  std::unique_ptr<unsigned char[]> mem;
  void* data() const { return mem.get(); }
};

HostBuf host_buffer(std::size_t n, DType d, ThreadPool* pool) {
  HostBuf b;
  if (d == DType::kNone) return b;
  const std::size_t size = dtype_size(d);
  b.mem.reset(new unsigned char[n * size + 64]);
  unsigned char* base = b.mem.get();
  auto fill = [&](std::size_t, std::size_t lo, std::size_t hi) {
    for (std::size_t i = lo; i < hi; ++i) {
      if (d == DType::kF32) {
        reinterpret_cast<float*>(base)[i] = 0.01f;
      } else {
        reinterpret_cast<std::uint16_t*>(base)[i] =
            d == DType::kBF16 ? float_to_bf16(0.01f) : float_to_f16(0.01f);
      }
    }
  };
  if (pool)
    pool->parallel_for(n, 0, fill);
  else
    fill(0, 0, n);
  return b;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Note [Thread CPU time]
// On a shared machine (load 5-13 on 2 cores while these figures were taken) a
// 1-thread run spends much of its wall time descheduled, at random moments, so
// wall-clock best-of-N fractions spread 0.66-1.32 run to run. The calling
// thread's CPU time (CLOCK_THREAD_CPUTIME_ID) counts only the time it ran, so
// `roofline_fraction_thread_cpu` compares the kernel and the roofline on what
// they cost while running. It is reported only when one thread did all the work
// (--threads 1): with more, other threads' time is not in it.
double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + 1e-9 * double(t.tv_nsec);
}

double best(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
}

//! The buffers of one measurement: host (first-touched by the pool) or device.
struct Buffers {
  std::vector<HostBuf> host;
  std::vector<CudaBuffer> dev;

  //! n host bytes of `fill`, first-touched by the pool (q8 codes).
  std::uint8_t* alloc_bytes(std::size_t n, std::uint8_t fill, ThreadPool* pool) {
    HostBuf b;
    b.mem.reset(new unsigned char[n + 64]);
    unsigned char* base = b.mem.get();
    auto set = [&](std::size_t, std::size_t lo, std::size_t hi) { std::fill(base + lo, base + hi, fill); };
    if (pool)
      pool->parallel_for(n, 0, set);
    else
      set(0, 0, n);
    host.push_back(std::move(b));
    return base;
  }

  void* alloc(std::size_t n, DType d, bool cuda, ThreadPool* pool) {
    if (d == DType::kNone) return nullptr;
    if (!cuda) {
      host.push_back(host_buffer(n, d, pool));
      return host.back().data();
    }
    Result<CudaBuffer> b = CudaBuffer::allocate(n * dtype_size(d), false);
    if (!b.ok()) return nullptr;
    dev.push_back(std::move(b).value());
    return dev.back().data();
  }
};

//! Each repeat's timings, in seconds; best() of each is the figure.
struct Samples {
  std::vector<double> kernel, rt, rt_clip, rt_host, tri, kernel_cpu;
  std::vector<double> roof[std::size(kMemVariants)], roof_cpu[std::size(kMemVariants)];
};

//! One configuration's measurement: what it runs on and what it has timed so far.
//! Not copied or moved: args.spans points at span.
struct Run {
  const Config& c;
  std::size_t n;
  const OptimOptions& o;
  ThreadPool* pool;
  Isa isa;
  bool cuda;
  Buffers buffers;
  Span span;
  Q8Span q8span;  //!< the q8 row's states (Config::q8)
  float* triad[3] = {};
  std::vector<MemPass> passes;
  bool writes_param = false;
  GradStats checked{.sum_squares = 1.0, .finite = true};
  GradStats device_checked;  //!< what the device's check hands the runtime (Note [Runtime path])
  StepArgs args;
  Samples samples;
};

//! Allocates the span's buffers and the roofline's passes; "" or why it cannot run.
std::string prepare(Run& r) {
  const Config& c = r.c;
  auto alloc = [&](DType d) { return r.buffers.alloc(r.n, d, r.cuda, r.pool); };
  Span& s = r.span;
  s.n = r.n;
  s.master = static_cast<float*>(alloc(DType::kF32));
  s.grad = alloc(c.grad);
  s.grad_dtype = c.grad;
  s.param = alloc(c.param);
  s.param_dtype = c.param;
  s.state_dtype = c.state;
  s.state[0] = alloc(c.state);
  if (state_count(c.optimizer) == 2) s.state[1] = alloc(c.state);
  if (s.master == nullptr || s.grad == nullptr) return "allocation failed (lower --mparams)";
  if (!r.cuda) {
    for (float*& t : r.triad) t = static_cast<float*>(alloc(DType::kF32));
  }
  const Hyper hyper = hyper_for(c.optimizer);
  if (c.q8) {
    if (r.cuda) return "no CUDA q8 step to time";
    r.q8span =
        Q8Span{.master = s.master,
               .grad = s.grad,
               .grad_dtype = s.grad_dtype,
               .param = s.param,
               .param_dtype = s.param_dtype,
               .m_codes = r.buffers.alloc_bytes(r.n, 0, r.pool),
               .m_scales = static_cast<float*>(r.buffers.alloc(q8_blocks(r.n), DType::kF32, false, r.pool)),
               .v_codes = r.buffers.alloc_bytes(r.n, 0, r.pool),
               .v_scales = static_cast<float*>(r.buffers.alloc(q8_blocks(r.n), DType::kF32, false, r.pool)),
               .n = r.n};
    q8_zero_states(r.q8span);  // the codes of 0 (pages first-touched by the pool above)
  }
  r.passes = c.grad_norm_only ? std::vector<MemPass>{mem_pass_for_grad_stats(s)}
             : c.q8           ? std::vector<MemPass>{mem_pass_for_q8(r.q8span)}
                              : mem_passes_for_step(hyper, s, false);
  double roofline_bpp = 0;
  for (const MemPass& m : r.passes) roofline_bpp += m.bytes_per_elem();
  if (!r.cuda && roofline_bpp != bytes_per_param(c)) {
    return fmt::format(
        "the memory-only passes move {} B/param, Note [Bytes per param] counts {} (a bench bug)",
        roofline_bpp, bytes_per_param(c));
  }
  r.writes_param =
      std::any_of(r.passes.begin(), r.passes.end(), [](const MemPass& m) { return m.param.elem_bytes != 0; });
  r.args = StepArgs{.hyper = hyper, .spans = {&r.span, 1}, .pool = r.pool, .isa = r.isa};
  // What the device's check hands the runtime (Note [Runtime path]); untimed.
  r.device_checked = r.checked;
  if (!r.cuda && !c.grad_norm_only) {
    Result<GradStats> g = grad_stats(r.args.spans, 1.0f, r.pool, r.isa);
    if (!g.ok()) return g.status().to_string();
    r.device_checked = *g;
  }
  return "";
}

//! Runs fn, adding its wall time to `into` when it succeeds and `keep` (not the warm-up).
template <typename Fn>
Status timed(std::vector<double>& into, bool keep, Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  Status st = fn();
  if (st.ok() && keep) into.push_back(seconds_since(t0));
  return st;
}

//! The kernel alone: step() with kCallerChecked, or grad_stats for the grad_norm row.
Status time_kernel(Run& r, bool keep) {
  const double kernel_cpu0 = thread_cpu_seconds();
  Status st = timed(r.samples.kernel, keep, [&]() -> Status {
    if (r.c.grad_norm_only) {
      return r.cuda ? cuda_grad_stats(r.args.spans, 1.0f).status()
                    : grad_stats(r.args.spans, 1.0f, r.pool, r.isa).status();
    }
    if (r.c.q8) {
      return step_q8({.hyper = r.args.hyper,
                      .step = r.args.step,
                      .spans = {&r.q8span, 1},
                      .pool = r.pool,
                      .isa = r.isa,
                      .check = GradCheck::kCallerChecked,
                      .checked = &r.checked})
          .status();
    }
    StepArgs a = r.args;
    a.check = GradCheck::kCallerChecked;
    a.checked = &r.checked;
    return r.cuda ? cuda_step(a).status() : step(a).status();
  });
  if (st.ok() && keep) r.samples.kernel_cpu.push_back(thread_cpu_seconds() - kernel_cpu0);
  return st;
}

//! The memory-only kernel, each variant --roofline-variant asks for (CPU only).
Status time_roofline(Run& r, bool keep, Measured& out) {
  Status st = Status::Ok();
  // Without a write-only stream the two variants are the same code: run one.
  for (std::size_t v = 0; v < (r.writes_param ? std::size(kMemVariants) : 1) && st.ok() && !r.cuda; ++v) {
    if (r.o.roofline_variant != "best" && r.o.roofline_variant != mem_variant_name(kMemVariants[v]) &&
        r.writes_param) {
      continue;
    }
    const double roof_cpu0 = thread_cpu_seconds();
    Result<MemTiming> m = run_mem_passes(r.passes, r.pool, r.isa, kMemVariants[v]);
    st = m.status();
    if (m.ok() && keep) {
      r.samples.roof_cpu[v].push_back(thread_cpu_seconds() - roof_cpu0);
      r.samples.roof[v].push_back(m->seconds);
      out.threads_used = std::max(out.threads_used, m->threads_used);
    }
  }
  return st;
}

//! The runtime's calls (Note [Runtime path]): device-checked, clipped, host-checked.
Status time_runtime_paths(Run& r, bool keep) {
  // The runtime does not run q8 states yet (#49 item 1): no path to time.
  if (r.cuda || r.c.grad_norm_only || r.c.q8) return Status::Ok();
  StepArgs a = r.args;
  a.check = GradCheck::kCallerChecked;
  a.checked = &r.device_checked;
  Status st = timed(r.samples.rt, keep, [&] { return step(a).status(); });
  if (st.ok()) {
    st = timed(r.samples.rt_clip, keep, [&]() -> Status {
      StepArgs clipped = a;
      clipped.grad_scale = clip_coefficient(std::sqrt(r.device_checked.sum_squares), 1.0);
      return step(clipped).status();
    });
  }
  if (st.ok()) st = timed(r.samples.rt_host, keep, [&] { return step(r.args).status(); });  // kSeparatePass
  return st;
}

//! The STREAM triad (information only).
Status time_triad(Run& r, bool keep) {
  if (r.cuda) {
    Result<double> gb_s = cuda_triad_gb_s(r.n, 1);  // 12 B/element
    if (gb_s.ok() && keep) r.samples.tri.push_back(12.0 * double(r.n) / (*gb_s * 1e9));
    return gb_s.status();
  }
  Result<double> t = run_triad(r.triad[0], r.triad[1], r.triad[2], r.n, r.pool, r.isa);
  if (t.ok() && keep) r.samples.tri.push_back(*t);
  return t.status();
}

//! The best of each clock's samples into out; the roofline is the faster variant.
void summarize(const Samples& s, Measured& out) {
  out.kernel_s = best(s.kernel);
  out.kernel_cpu_s = best(s.kernel_cpu);
  // The roofline is the faster variant (Note [Write prefetch]), on each clock.
  for (std::size_t v = 0; v < std::size(kMemVariants); ++v) {
    const double wall = best(s.roof[v]), cpu = best(s.roof_cpu[v]);
    if (wall > 0 && (out.roofline_s == 0 || wall < out.roofline_s)) {
      out.roofline_s = wall;
      out.roofline_variant = kMemVariants[v];
    }
    if (cpu > 0 && (out.roofline_cpu_s == 0 || cpu < out.roofline_cpu_s)) out.roofline_cpu_s = cpu;
  }
  out.runtime_s = best(s.rt);
  out.runtime_clip_s = best(s.rt_clip);
  out.runtime_host_s = best(s.rt_host);
  out.triad_s = best(s.tri);
}

}  // namespace

Measured measure(const Config& c, std::size_t n, const OptimOptions& o, ThreadPool* pool, Isa isa) {
  Run r{.c = c, .n = n, .o = o, .pool = pool, .isa = isa, .cuda = o.device == "cuda"};
  Measured out;
  out.error = prepare(r);
  if (!out.error.empty()) return out;
  for (int rep = 0; rep <= o.repeats; ++rep) {
    const bool keep = rep > 0;  // rep == 0 warms up
    r.args.step = rep + 1;
    Status st = time_kernel(r, keep);
    if (st.ok()) st = time_roofline(r, keep, out);
    if (st.ok()) st = time_runtime_paths(r, keep);
    if (st.ok()) st = time_triad(r, keep);
    if (!st.ok()) {
      out.error = st.to_string();
      return out;
    }
  }
  summarize(r.samples, out);
  return out;
}

}  // namespace strata::bench::optim
