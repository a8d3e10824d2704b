// strata-bench optim: fused optimizer steps per optimizer x dtype, against a
// memory-only kernel with the same streams (the roofline), through the calls
// the runtime makes (its gradient check and clipping norm), and against
// torch.optim with the same dtypes (/usr/bin/python3), all on the same threads
// in the same run. --device cuda runs the CUDA kernels against a device triad.
//
// Note [Bytes per param]
// bytes_per_param counts what the pass must move in memory, reads plus writes:
// gradient read, master read + write, each state read + write, param copy
// write; LAMB and LARS count both phases (Note [Two-phase trust ratio]). The
// kernel rate (mparams_per_s) is kernels::step() with GradCheck::kCallerChecked:
// the fused pass(es) alone. Its roofline is the memory-only kernel of
// bench/roofline (Note [Memory-only roofline]) over the same buffers, so
// roofline_fraction = kernel rate / memory-only rate can fall below 1 and
// cannot honestly exceed it by more than noise.
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
//
// Every figure is the best of --repeats timed runs after one warm-up; the
// kernel, the memory-only kernel, the two runtime paths and the STREAM triad
// (information only, 16 B/element: it pays write-allocate) run interleaved, one
// of each per repeat, so all see the same machine load.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "registry.hpp"
#include "roofline/mem_roofline.hpp"
#include "strata/common/log.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/cuda.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::bench {
namespace {

using namespace strata::kernels;

struct OptimOptions {
  double mparams = 64.0;
  std::size_t threads = 0;
  int repeats = 5;
  bool json = false;
  bool torch = true;
  std::string device = "cpu";
  std::string isa;
  std::string only;                       // comma-separated optimizer names
  std::string roofline_variant = "best";  // best, kernel_prefetch or write_prefetch
  bool check = false;
  double check_tolerance = 0.02;
  int check_attempts = 3;
};

struct Config {
  Optimizer optimizer;
  DType grad, param, state;  // param kNone: the fp32 master is the param
  bool grad_norm_only = false;
};

std::vector<Config> configs() {
  using D = DType;
  return {
      {Optimizer::kAdamW, D::kF32, D::kNone, D::kF32},     {Optimizer::kAdamW, D::kBF16, D::kBF16, D::kF32},
      {Optimizer::kAdamW, D::kBF16, D::kBF16, D::kBF16},   {Optimizer::kAdam, D::kF32, D::kNone, D::kF32},
      {Optimizer::kLamb, D::kF32, D::kNone, D::kF32},      {Optimizer::kLamb, D::kBF16, D::kBF16, D::kF32},
      {Optimizer::kLars, D::kF32, D::kNone, D::kF32},      {Optimizer::kSgd, D::kF32, D::kNone, D::kF32},
      {Optimizer::kLion, D::kF32, D::kNone, D::kF32},      {Optimizer::kAdagrad, D::kF32, D::kNone, D::kF32},
      {Optimizer::kSgd, D::kF32, D::kNone, D::kF32, true},
  };
}

Hyper hyper_for(Optimizer o);

// Full-size states per element, as the kernel keeps them with hyper_for's settings.
int state_count(Optimizer o) {
  return static_cast<int>(kernels::optimizer_state_count(hyper_for(o)));
}

// Note [Bytes per param].
double bytes_per_param(const Config& c) {
  const double g = double(dtype_size(c.grad)), p = double(dtype_size(c.param)),
               s = double(dtype_size(c.state));
  if (c.grad_norm_only) return g;
  switch (c.optimizer) {
    case Optimizer::kLamb:
      return (g + 4 + 4 * s) + (2 * s + 8 + p);  // phase 1 + phase 2
    case Optimizer::kLars:
      return (g + 4) + (g + 8 + 8 + p);  // read-only phase 1 + update
    default:
      return g + 8 + 2 * s * state_count(c.optimizer) + p;
  }
}

Hyper hyper_for(Optimizer o) {
  Hyper h;
  h.optimizer = o;
  h.weight_decay = 0.01f;
  if (o == Optimizer::kSgd || o == Optimizer::kLars) h.momentum = 0.9f;
  return h;
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

//! Best-of timings of one configuration, in seconds (0: not measured).
struct Measured {
  double kernel_s = 0;      //!< kernels::step, kCallerChecked (or grad_stats for the grad_norm row)
  double roofline_s = 0;    //!< memory-only kernel, same streams (CPU only)
  double kernel_cpu_s = 0;  //!< the same two, the calling thread's CPU time (Note [Thread CPU time])
  double roofline_cpu_s = 0;
  double runtime_s = 0;       //!< Note [Runtime path], without clipping
  double runtime_clip_s = 0;  //!< Note [Runtime path], with clipping
  double runtime_host_s = 0;  //!< Note [Runtime path], a gradient checked on the host
  double triad_s = 0;         //!< STREAM triad over n floats
  MemVariant roofline_variant = MemVariant::kKernelPrefetch;  //!< the faster (Note [Write prefetch])
  std::size_t threads_used = 0;
  std::string error;
};

double best(const std::vector<double>& v) {
  return v.empty() ? 0.0 : *std::min_element(v.begin(), v.end());
}

//! Runs the config `repeats` times (after a warm-up) on CPU or GPU buffers,
//! each repeat timing the kernel, its memory-only roofline, the runtime's two
//! paths and the triad once, in that order (Note [Bytes per param]).
Measured measure(const Config& c, std::size_t n, const OptimOptions& o, ThreadPool* pool, Isa isa) {
  const bool cuda = o.device == "cuda";
  std::vector<HostBuf> host;
  std::vector<CudaBuffer> dev;
  auto alloc = [&](DType d) -> void* {
    if (d == DType::kNone) return nullptr;
    if (!cuda) {
      host.push_back(host_buffer(n, d, pool));
      return host.back().data();
    }
    Result<CudaBuffer> b = CudaBuffer::allocate(n * dtype_size(d), false);
    if (!b.ok()) return nullptr;
    dev.push_back(std::move(b).value());
    return dev.back().data();
  };
  Span s;
  s.n = n;
  s.master = static_cast<float*>(alloc(DType::kF32));
  s.grad = alloc(c.grad);
  s.grad_dtype = c.grad;
  s.param = alloc(c.param);
  s.param_dtype = c.param;
  s.state_dtype = c.state;
  s.state[0] = alloc(c.state);
  if (state_count(c.optimizer) == 2) s.state[1] = alloc(c.state);
  Measured out;
  if (s.master == nullptr || s.grad == nullptr) {
    out.error = "allocation failed (lower --mparams)";
    return out;
  }
  float* triad[3] = {};
  if (!cuda) {
    for (float*& t : triad) t = static_cast<float*>(alloc(DType::kF32));
  }
  const Hyper hyper = hyper_for(c.optimizer);
  const std::vector<MemPass> passes = c.grad_norm_only ? std::vector<MemPass>{mem_pass_for_grad_stats(s)}
                                                       : mem_passes_for_step(hyper, s, false);
  double roofline_bpp = 0;
  for (const MemPass& m : passes) roofline_bpp += m.bytes_per_elem();
  if (!cuda && roofline_bpp != bytes_per_param(c)) {
    out.error =
        fmt::format("the memory-only passes move {} B/param, Note [Bytes per param] counts {} (a bench bug)",
                    roofline_bpp, bytes_per_param(c));
    return out;
  }
  const bool writes_param =
      std::any_of(passes.begin(), passes.end(), [](const MemPass& m) { return m.param.elem_bytes != 0; });
  const GradStats checked{.sum_squares = 1.0, .finite = true};
  StepArgs args{.hyper = hyper, .spans = {&s, 1}, .pool = pool, .isa = isa};
  std::vector<double> kernel, rt, rt_clip, rt_host, tri, kernel_cpu;
  std::vector<double> roof_v[std::size(kMemVariants)], roof_cpu_v[std::size(kMemVariants)];
  // What the device's check hands the runtime (Note [Runtime path]); untimed.
  GradStats device_checked = checked;
  if (!cuda && !c.grad_norm_only) {
    Result<GradStats> g = grad_stats(args.spans, 1.0f, pool, isa);
    if (!g.ok()) {
      out.error = g.status().to_string();
      return out;
    }
    device_checked = *g;
  }
  auto timed = [](std::vector<double>& into, bool keep, auto&& fn) -> Status {
    const auto t0 = std::chrono::steady_clock::now();
    Status st = fn();
    if (st.ok() && keep) into.push_back(seconds_since(t0));
    return st;
  };
  for (int r = 0; r <= o.repeats; ++r) {
    const bool keep = r > 0;  // r == 0 warms up
    args.step = r + 1;
    const double kernel_cpu0 = thread_cpu_seconds();
    Status st = timed(kernel, keep, [&]() -> Status {
      if (c.grad_norm_only) {
        return cuda ? cuda_grad_stats(args.spans, 1.0f).status()
                    : grad_stats(args.spans, 1.0f, pool, isa).status();
      }
      StepArgs a = args;
      a.check = GradCheck::kCallerChecked;
      a.checked = &checked;
      return cuda ? cuda_step(a).status() : step(a).status();
    });
    if (st.ok() && keep) kernel_cpu.push_back(thread_cpu_seconds() - kernel_cpu0);
    // Without a write-only stream the two variants are the same code: run one.
    for (std::size_t v = 0; v < (writes_param ? std::size(kMemVariants) : 1) && st.ok() && !cuda; ++v) {
      if (o.roofline_variant != "best" && o.roofline_variant != mem_variant_name(kMemVariants[v]) &&
          writes_param) {
        continue;
      }
      const double roof_cpu0 = thread_cpu_seconds();
      Result<MemTiming> m = run_mem_passes(passes, pool, isa, kMemVariants[v]);
      st = m.status();
      if (m.ok() && keep) {
        roof_cpu_v[v].push_back(thread_cpu_seconds() - roof_cpu0);
        roof_v[v].push_back(m->seconds);
        out.threads_used = std::max(out.threads_used, m->threads_used);
      }
    }
    if (st.ok() && !cuda && !c.grad_norm_only) {
      StepArgs a = args;
      a.check = GradCheck::kCallerChecked;
      a.checked = &device_checked;
      st = timed(rt, keep, [&] { return step(a).status(); });
      if (st.ok()) {
        st = timed(rt_clip, keep, [&]() -> Status {
          StepArgs clipped = a;
          clipped.grad_scale = clip_coefficient(std::sqrt(device_checked.sum_squares), 1.0);
          return step(clipped).status();
        });
      }
      if (st.ok()) st = timed(rt_host, keep, [&] { return step(args).status(); });  // kSeparatePass
    }
    if (st.ok()) {
      if (cuda) {
        Result<double> gb_s = cuda_triad_gb_s(n, 1);  // 12 B/element
        st = gb_s.status();
        if (st.ok() && keep) tri.push_back(12.0 * double(n) / (*gb_s * 1e9));
      } else {
        Result<double> t = run_triad(triad[0], triad[1], triad[2], n, pool, isa);
        st = t.status();
        if (st.ok() && keep) tri.push_back(*t);
      }
    }
    if (!st.ok()) {
      out.error = st.to_string();
      return out;
    }
  }
  out.kernel_s = best(kernel);
  out.kernel_cpu_s = best(kernel_cpu);
  // The roofline is the faster variant (Note [Write prefetch]), on each clock.
  for (std::size_t v = 0; v < std::size(kMemVariants); ++v) {
    const double wall = best(roof_v[v]), cpu = best(roof_cpu_v[v]);
    if (wall > 0 && (out.roofline_s == 0 || wall < out.roofline_s)) {
      out.roofline_s = wall;
      out.roofline_variant = kMemVariants[v];
    }
    if (cpu > 0 && (out.roofline_cpu_s == 0 || cpu < out.roofline_cpu_s)) out.roofline_cpu_s = cpu;
  }
  out.runtime_s = best(rt);
  out.runtime_clip_s = best(rt_clip);
  out.runtime_host_s = best(rt_host);
  out.triad_s = best(tri);
  return out;
}

// Note [Roofline check]
// A row's roofline_fraction above 1 says the memory-only kernel is not the
// upper bound it must be, or that the timing was disturbed. The check uses the
// calling thread's CPU time when one thread did all the work (Note [Thread CPU
// time]; wall time on a shared machine is the noisier clock) and wall time
// otherwise, and flags roofline_violation when the fraction exceeds
// 1 + --check-tolerance. With --check a flagged row is measured again, up to
// --check-attempts times in all, and the bench fails (exit 1, naming the row)
// only when every attempt is flagged: a disturbed run does not fail it, a
// roofline that is not a bound does.

//! The fraction the check reads and its clock; fraction 0 when not measured (CUDA).
std::pair<double, const char*> check_fraction(const Measured& m) {
  if (m.threads_used == 1 && m.kernel_cpu_s > 0 && m.roofline_cpu_s > 0)
    return {m.roofline_cpu_s / m.kernel_cpu_s, "thread_cpu"};
  if (m.kernel_s > 0 && m.roofline_s > 0) return {m.roofline_s / m.kernel_s, "wall"};
  return {0.0, "none"};
}

bool roofline_violated(const Measured& m, const OptimOptions& o) {
  return check_fraction(m).first > 1.0 + o.check_tolerance;
}

//! Why torch.optim has no baseline with the row's dtypes, or "" when it has one
//! (bench/torch_optim_rate.py runs it).
std::string torch_lacks(const Config& c) {
  if (c.grad_norm_only) return "torch.optim has no gradient-norm pass alone";
  if (torch_name(c.optimizer).empty())
    return "torch.optim has no " + std::string(optimizer_name(c.optimizer));
  if (c.state != DType::kF32) {
    return "torch.optim keeps states in the param's dtype: no fp32 master with " +
           std::string(dtype_name(c.state)) + " states";
  }
  if (c.grad != DType::kF32 && c.param != c.grad) return "no torch recipe for these dtypes";
  return "";
}

//! torch.optim's rate for the row's dtypes via bench/torch_optim_rate.py; nullopt (with why) when
//! unavailable.
std::optional<nlohmann::json> torch_rate(const Config& c, std::size_t n, std::size_t threads, int repeats,
                                         std::string* why) {
  const std::string cmd =
      fmt::format("/usr/bin/python3 {}/torch_optim_rate.py {} {} {} {} {} 2>&1", STRATA_BENCH_DIR,
                  torch_name(c.optimizer), n, threads, repeats, dtype_name(c.grad));
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *why = "cannot run /usr/bin/python3";
    return std::nullopt;
  }
  std::string out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  const int rc = pclose(p);
  const std::size_t brace = out.rfind('{');
  if (rc != 0 || brace == std::string::npos) {
    *why = fmt::format("torch baseline failed (python3-torch missing? scripts/install-deps --bench): {}",
                       out.substr(0, 200));
    return std::nullopt;
  }
  return nlohmann::json::parse(out.substr(brace), nullptr, false);
}

nlohmann::json rate_or_null(std::size_t n, double seconds) {
  return seconds > 0 ? nlohmann::json(double(n) / seconds / 1e6) : nlohmann::json(nullptr);
}

std::string fixed(const nlohmann::json& v, const char* format) {
  return v.is_number() ? fmt::format(fmt::runtime(format), v.get<double>()) : std::string("-");
}

int run_optim(const OptimOptions& o) {
  const bool cuda = o.device == "cuda";
  if (o.device != "cpu" && !cuda) {
    fmt::print(stderr, "optim: --device {} is unknown; use cpu or cuda\n", o.device);
    return 2;
  }
  if (cuda) {
    if (Status s = cuda_probe(); !s.ok()) {
      fmt::print(stderr, "optim: --device cuda: {}\n", s.to_string());
      return 1;
    }
  }
  Isa isa = default_isa();  // the CPUID dispatch of the kernels (STRATA_KERNELS_ISA honoured)
  if (!o.isa.empty()) {
    Result<Isa> parsed = parse_isa(o.isa);
    if (!parsed.ok()) {
      fmt::print(stderr, "optim: --isa: {}\n", parsed.status().to_string());
      return 2;
    }
    isa = *parsed;
  }
  // Bounds, checked before anything is allocated: the buffers are ~8 arrays of
  // --mparams floats, which must fit a quarter of RAM.
  const double ram_mparams = static_cast<double>(memory::physical_memory_bytes()) / 4 / 32 / 1e6;
  if (!(o.mparams > 0 && o.mparams <= std::max(1.0, ram_mparams))) {
    fmt::print(stderr, "optim: --mparams = {}: use a number in (0, {:.0f}] on this machine\n", o.mparams,
               std::max(1.0, ram_mparams));
    return 2;
  }
  // The thread pool's own bound: more was SIGABRT from the pool's refusal (#24).
  const std::size_t threads_max = ThreadPool::Options{}.threads_max;
  if (o.threads > threads_max) {
    fmt::print(stderr, "optim: --threads = {}: use 0 .. {} (0 = one per core)\n", o.threads, threads_max);
    return 2;
  }
  if (o.repeats < 1 || o.repeats > 1000) {
    fmt::print(stderr, "optim: --repeats = {}: use 1 .. 1000\n", o.repeats);
    return 2;
  }
  // parallel_for runs pieces on its caller and size() - 1 of the pool's
  // workers, so `threads` is the number of threads that run pieces
  // (threads_used in the output checks it); one thread runs on the caller.
  const std::size_t threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  std::unique_ptr<ThreadPool> pool;
  if (!cuda && threads > 1) {
    auto made = ThreadPool::create({.threads = threads});
    if (!made.ok()) {
      fmt::print(stderr, "optim: --threads = {}: {}\n", threads, made.status().to_string());
      return 2;
    }
    pool = std::move(made).value();
  }
  const std::size_t n = static_cast<std::size_t>(o.mparams * 1e6);
  const std::string isa_used = cuda ? "cuda" : std::string(isa_name(isa));

  if (!o.json) {
    fmt::print("optim: {} params, device {}, isa {}, {} threads, best of {} runs after a warm-up\n", n,
               o.device, isa_used, cuda ? 0 : threads, o.repeats);
    fmt::print(
        "kernel: step() with GradCheck::kCallerChecked; roofline: memory-only kernel, same streams, same "
        "isa\n"
        "        and threads (roof = kernel M/s / roofline M/s); rt: the runtime's calls for a gradient\n"
        "        checked on the device (kCallerChecked), rtclip: with the clip norm, rthost: a gradient\n"
        "        checked on the host (kSeparatePass) (x/k = x M/s / kernel M/s);\n"
        "        triad: STREAM a = b + s c at 16 B/element (information); torch: same dtypes, same "
        "threads\n");
    fmt::print(
        "{:<9} {:>4} {:>5} {:>4} {:>7} {:>5} {:>7} {:>5} {:>6} {:>5} {:>6} {:>5} {:>6} {:>5} {:>6} {:>7} "
        "{:>7}  "
        "{}\n",
        "optimizer", "grad", "param", "st", "kernel", "B/p", "roofl", "roof", "rt", "rt/k", "rtclip", "rc/k",
        "rthost", "rh/k", "triad", "torch", "speedup", "torch variant");
  }
  std::map<std::string, nlohmann::json> torch_cache;
  nlohmann::json rows = nlohmann::json::array();
  int failures = 0;
  for (const Config& c : configs()) {
    const std::string name = c.grad_norm_only ? "grad_norm" : std::string(optimizer_name(c.optimizer));
    if (!o.only.empty() && ("," + o.only + ",").find("," + name + ",") == std::string::npos) continue;
    Measured m;
    int attempts = 0;
    while (true) {  // Note [Roofline check]
      m = measure(c, n, o, pool.get(), isa);
      ++attempts;
      if (!m.error.empty() || !o.check || !roofline_violated(m, o) || attempts >= o.check_attempts) break;
      fmt::print(stderr, "optim: {} {}/{}: roofline_fraction {:.3f} ({}) above 1 + {}; measuring again\n",
                 name, dtype_name(c.grad), dtype_name(c.state), check_fraction(m).first,
                 check_fraction(m).second, o.check_tolerance);
    }
    if (!m.error.empty()) {
      fmt::print(stderr, "optim: {} failed: {}\n", name, m.error);
      ++failures;
      continue;
    }
    if (!cuda && m.threads_used > threads) {
      fmt::print(stderr, "optim: {} threads ran pieces, more than --threads {}\n", m.threads_used, threads);
      ++failures;
    }
    const auto [checked_fraction, check_clock] = check_fraction(m);
    const bool violation = !cuda && roofline_violated(m, o);
    if (violation && o.check) {
      fmt::print(
          stderr,
          "optim: {} grad {} param {} states {}: roofline_fraction {:.3f} ({}) above 1 + {} in all {} "
          "attempts: the memory-only kernel is not an upper bound for this row (Note [Roofline check])\n",
          name, dtype_name(c.grad), dtype_name(c.param), dtype_name(c.state), checked_fraction, check_clock,
          o.check_tolerance, attempts);
      ++failures;
    }
    const double bpp = bytes_per_param(c);
    const double kernel_mps = double(n) / m.kernel_s / 1e6;
    const nlohmann::json roof_mps = rate_or_null(n, m.roofline_s);
    const nlohmann::json rt_mps = rate_or_null(n, m.runtime_s);
    const nlohmann::json rt_clip_mps = rate_or_null(n, m.runtime_clip_s);
    const nlohmann::json rt_host_mps = rate_or_null(n, m.runtime_host_s);
    auto over_kernel = [&](const nlohmann::json& v) {
      return v.is_number() ? nlohmann::json(v.get<double>() / kernel_mps) : nlohmann::json(nullptr);
    };
    nlohmann::json row = {
        {"optimizer", name},
        {"param_dtype", c.param == DType::kNone ? "fp32(master)" : dtype_name(c.param)},
        {"grad_dtype", dtype_name(c.grad)},
        {"state_dtype", c.grad_norm_only ? "none" : dtype_name(c.state)},
        {"isa", isa_used},
        {"device", o.device},
        {"threads", cuda ? 0 : threads},
        {"threads_used", cuda ? nlohmann::json(nullptr) : nlohmann::json(m.threads_used)},
        {"n_params", n},
        {"timing", fmt::format("best of {} after a warm-up", o.repeats)},
        {"load_average_1m", load_average_1m()},
        {"mparams_per_s", kernel_mps},
        {"bytes_per_param", bpp},
        {"gb_s", kernel_mps * bpp / 1e3},
        {"roofline", cuda ? "none on cuda (no device memory-only kernel)"
                          : "memory-only kernel, same streams, dtypes, isa, pool and split"},
        {"roofline_mparams_per_s", roof_mps},
        {"roofline_gb_s",
         roof_mps.is_number() ? nlohmann::json(roof_mps.get<double>() * bpp / 1e3) : nullptr},
        {"roofline_fraction", roof_mps.is_number() ? nlohmann::json(kernel_mps / roof_mps.get<double>())
                                                   : nlohmann::json(nullptr)},
        {"roofline_fraction_thread_cpu",
         !cuda && m.threads_used == 1 && m.kernel_cpu_s > 0 && m.roofline_cpu_s > 0
             ? nlohmann::json(m.roofline_cpu_s / m.kernel_cpu_s)
             : nlohmann::json(nullptr)},
        {"roofline_variant",
         cuda ? nlohmann::json(nullptr) : nlohmann::json(mem_variant_name(m.roofline_variant))},
        {"roofline_check_fraction", cuda ? nlohmann::json(nullptr) : nlohmann::json(checked_fraction)},
        {"roofline_check_clock", check_clock},
        {"roofline_violation", cuda ? nlohmann::json(nullptr) : nlohmann::json(violation)},
        {"roofline_check_attempts", attempts},
        {"runtime_path_mparams_per_s", rt_mps},
        {"runtime_path_fraction", over_kernel(rt_mps)},
        {"runtime_path_clip_mparams_per_s", rt_clip_mps},
        {"runtime_path_clip_fraction", over_kernel(rt_clip_mps)},
        {"runtime_path_host_grad_mparams_per_s", rt_host_mps},
        {"runtime_path_host_grad_fraction", over_kernel(rt_host_mps)},
        {"triad_gb_s", 16.0 * double(n) / m.triad_s / 1e9},
        {"triad_bytes_per_element", 16},
        {"torch_mparams_per_s", nullptr},
        {"speedup_vs_torch", nullptr},
        {"torch_variant", nullptr},
        {"torch_note", nullptr}};
    std::string why = torch_lacks(c);
    if (why.empty() && (!o.torch || cuda)) why = cuda ? "torch baseline is CPU-only here" : "--no-torch";
    if (why.empty()) {
      const std::string key = torch_name(c.optimizer) + "/" + std::string(dtype_name(c.grad));
      if (!torch_cache.count(key)) {
        std::optional<nlohmann::json> t = torch_rate(c, n, threads, o.repeats, &why);
        torch_cache[key] = t ? *t : nlohmann::json{{"error", why}};
      }
      const nlohmann::json& t = torch_cache[key];
      if (t.contains("mparams_per_s")) {
        const double tr = t["mparams_per_s"];
        row["torch_mparams_per_s"] = tr;
        row["speedup_vs_torch"] = kernel_mps / tr;
        row["torch_variant"] = t["variant"];
      } else {
        why = t.value("error", "torch failed");
      }
    }
    if (!why.empty()) row["torch_note"] = why;
    if (!o.json) {
      fmt::print(
          "{:<9} {:>4} {:>5} {:>4} {:>7.1f} {:>5.0f} {:>7} {:>5} {:>6} {:>5} {:>6} {:>5} {:>6} {:>5} "
          "{:>6.2f} "
          "{:>7} {:>7}  {}\n",
          name, dtype_name(c.grad), c.param == DType::kNone ? "=mst" : dtype_name(c.param),
          row["state_dtype"].get<std::string>().substr(0, 4), kernel_mps, bpp, fixed(roof_mps, "{:.1f}"),
          fixed(row["roofline_fraction"], "{:.2f}"), fixed(rt_mps, "{:.1f}"),
          fixed(row["runtime_path_fraction"], "{:.2f}"), fixed(rt_clip_mps, "{:.1f}"),
          fixed(row["runtime_path_clip_fraction"], "{:.2f}"), fixed(rt_host_mps, "{:.1f}"),
          fixed(row["runtime_path_host_grad_fraction"], "{:.2f}"), row["triad_gb_s"].get<double>(),
          fixed(row["torch_mparams_per_s"], "{:.1f}"), fixed(row["speedup_vs_torch"], "{:.1f}x"),
          row["torch_variant"].is_null() ? why : row["torch_variant"].get<std::string>());
    }
    rows.push_back(row);
  }
  if (o.json) fmt::print("{}\n", rows.dump(2));
  return failures == 0 ? 0 : 1;
}

Registrar reg{
    "optim", "fused optimizer steps vs a memory-only roofline, the runtime path and torch.optim",
    [](CLI::App& app) {
      auto o = std::make_shared<OptimOptions>();
      app.add_option("--mparams", o->mparams, "millions of parameters per step")->capture_default_str();
      app.add_option("--threads", o->threads, "CPU threads (0 = all cores)")->capture_default_str();
      app.add_option("--repeats", o->repeats, "timed runs of each; the best is reported")
          ->capture_default_str();
      app.add_option("--device", o->device, "cpu or cuda")->capture_default_str();
      app.add_option("--isa", o->isa, "force scalar, avx2 or avx512 (default: CPUID)");
      app.add_option("--only", o->only, "comma-separated optimizers (adamw,lamb,...,grad_norm)");
      app.add_flag("--json", o->json, "print a JSON array, one object per configuration");
      app.add_flag("!--no-torch", o->torch, "skip the torch.optim baseline");
      app.add_option("--roofline-variant", o->roofline_variant,
                     "memory-only kernel: best (the faster of the two), kernel_prefetch or write_prefetch "
                     "(Note [Write prefetch])")
          ->capture_default_str()
          ->check(CLI::IsMember({"best", "kernel_prefetch", "write_prefetch"}));
      app.add_flag(
          "--check", o->check,
          "exit 1 when a row's roofline_fraction stays above 1 + --check-tolerance in every attempt");
      app.add_option("--check-tolerance", o->check_tolerance, "noise allowed above a roofline_fraction of 1")
          ->capture_default_str()
          ->check(CLI::Range(0.0, 1.0));
      app.add_option("--check-attempts", o->check_attempts,
                     "measurements of a flagged row before --check fails")
          ->capture_default_str()
          ->check(CLI::Range(1, 20));
      return [o] { return run_optim(*o); };
    }};

}  // namespace
}  // namespace strata::bench
