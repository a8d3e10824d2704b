// strata-bench optim: fused optimizer steps per optimizer x dtype, against a
// STREAM triad (same threads, same run) and torch.optim (same threads, same
// run, /usr/bin/python3). --device cuda runs the CUDA kernels against a device triad.
//
// Note [Bytes per param]
// bytes_per_param counts what the pass must move in memory, reads plus writes:
// gradient read, master read + write, each state read + write, param copy
// write; LAMB and LARS count both phases (Note [Two-phase trust ratio]). The
// step is timed with GradCheck::kCallerChecked, i.e. the runtime's path where
// the norm pass for clipping doubles as the Inf/NaN check; that pass is the
// separate `grad_norm` row (gradient read only). The triad moves 12 bytes per
// element as STREAM counts it (write-allocate traffic not counted), so a kernel
// whose writes all go to lines it has just read can exceed it; the same triad
// with non-temporal stores (no write-allocate) is printed as the stricter
// baseline (bound_fraction_nt). Each timed step is followed by one run of each
// triad, so both see the same load on a shared machine.
#include <emmintrin.h>  // SSE2 (baseline x86-64): the non-temporal triad

#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "registry.hpp"
#include "strata/common/log.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/cuda.hpp"
#include "strata/kernels/optim.hpp"

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
  std::string only;  // comma-separated optimizer names
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

//! STREAM triad a = b + s c, run with the kernels' threads (12 bytes/element as STREAM counts).
class Triad {
 public:
  Triad(std::size_t n, ThreadPool* pool, bool cuda) : n_(n), pool_(pool), cuda_(cuda) {
    if (cuda_) return;  // cuda_triad_gb_s owns its buffers
    a_ = host_buffer(n, DType::kF32, pool);
    b_ = host_buffer(n, DType::kF32, pool);
    c_ = host_buffer(n, DType::kF32, pool);
  }
  //! One timed run in GB/s. non_temporal: stores bypass the cache (no
  //! write-allocate read), the stricter baseline the kernels are also shown against.
  Result<double> run_gb_s(bool non_temporal = false) {
    if (cuda_) return cuda_triad_gb_s(n_, 1);
    auto body = [this, non_temporal](std::size_t, std::size_t lo, std::size_t hi) {
      float* __restrict a = static_cast<float*>(a_.data());
      const float* __restrict b = static_cast<const float*>(b_.data());
      const float* __restrict c = static_cast<const float*>(c_.data());
      std::size_t i = lo;
      if (non_temporal) {
        for (; i < hi && reinterpret_cast<std::uintptr_t>(a + i) % 16 != 0; ++i) a[i] = b[i] + 3.0f * c[i];
        const __m128 three = _mm_set1_ps(3.0f);
        for (; i + 4 <= hi; i += 4) {
          _mm_stream_ps(a + i, _mm_add_ps(_mm_loadu_ps(b + i), _mm_mul_ps(three, _mm_loadu_ps(c + i))));
        }
      }
      for (; i < hi; ++i) a[i] = b[i] + 3.0f * c[i];
    };
    const auto t0 = std::chrono::steady_clock::now();
    if (pool_)
      pool_->parallel_for(n_, 0, body);
    else
      body(0, 0, n_);
    if (non_temporal) _mm_sfence();
    return 12.0 * double(n_) / seconds_since(t0) / 1e9;
  }

 private:
  std::size_t n_;
  ThreadPool* pool_;
  bool cuda_;
  HostBuf a_, b_, c_;
};

struct Measured {
  double mparams_per_s = 0;
  double triad_gb_s = 0;     //!< median of the triad runs interleaved with the steps
  double triad_nt_gb_s = 0;  //!< same with non-temporal stores (CPU only)
  std::string error;
};

//! Runs the config's step `repeats` times (after a warm-up) on CPU or GPU buffers,
//! each step followed by a triad run, so both see the same machine load.
Measured measure(const Config& c, std::size_t n, const OptimOptions& o, ThreadPool* pool,
                 std::optional<Isa> isa, Triad& triad) {
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
  if (s.master == nullptr || s.grad == nullptr) return {0, 0, 0, "allocation failed (lower --mparams)"};
  const GradStats checked{.sum_squares = 1.0, .finite = true};
  StepArgs args{.hyper = hyper_for(c.optimizer),
                .spans = {&s, 1},
                .pool = pool,
                .isa = isa,
                .check = GradCheck::kCallerChecked,
                .checked = &checked};
  std::vector<double> secs, triads, triads_nt;
  for (int r = 0; r <= o.repeats; ++r) {
    args.step = r + 1;
    const auto t0 = std::chrono::steady_clock::now();
    Status st;
    if (c.grad_norm_only) {
      st = cuda ? cuda_grad_stats(args.spans, 1.0f).status()
                : grad_stats(args.spans, 1.0f, pool, isa).status();
    } else {
      st = cuda ? cuda_step(args).status() : step(args).status();
    }
    if (!st.ok()) return {0, 0, 0, st.to_string()};
    if (r == 0) continue;  // warm-up
    secs.push_back(seconds_since(t0));
    Result<double> t = triad.run_gb_s();
    if (!t.ok()) return {0, 0, 0, t.status().to_string()};
    triads.push_back(*t);
    if (!cuda) triads_nt.push_back(*triad.run_gb_s(true));
  }
  return {double(n) / median(secs) / 1e6, median(triads), cuda ? 0.0 : median(triads_nt), ""};
}

//! torch.optim's rate for `name` via bench/torch_optim_rate.py; nullopt (with why) when unavailable.
std::optional<nlohmann::json> torch_rate(const std::string& name, std::size_t n, std::size_t threads,
                                         int repeats, std::string* why) {
  const std::string cmd = fmt::format("/usr/bin/python3 {}/torch_optim_rate.py {} {} {} {} 2>&1",
                                      STRATA_BENCH_DIR, name, n, threads, repeats);
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
  std::optional<Isa> isa;
  if (!o.isa.empty()) {
    Result<Isa> parsed = parse_isa(o.isa);
    if (!parsed.ok()) {
      fmt::print(stderr, "optim: --isa: {}\n", parsed.status().to_string());
      return 2;
    }
    isa = *parsed;
  }
  const std::size_t threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  std::unique_ptr<ThreadPool> pool;
  if (!cuda && threads > 1) pool = std::move(ThreadPool::create({.threads = threads - 1}).value());
  const std::size_t n = static_cast<std::size_t>(o.mparams * 1e6);
  const std::string isa_used = cuda ? "cuda" : std::string(isa_name(isa.value_or(default_isa())));

  Triad triad(n, pool.get(), cuda);
  if (!o.json) {
    fmt::print("optim: {} params, device {}, isa {}, {} threads, median of {} steps\n", n, o.device, isa_used,
               cuda ? 0 : threads, o.repeats);
    fmt::print(
        "baseline: STREAM triad (12 B/element, same threads), one run after each timed step;\n"
        "          bound = GB/s / triad, bnd-nt = GB/s / triad with non-temporal stores (CPU)\n");
  }
  std::map<std::string, nlohmann::json> torch_cache;
  nlohmann::json rows = nlohmann::json::array();
  if (!o.json) {
    fmt::print("{:<9} {:>5} {:>5} {:>5} {:>9} {:>6} {:>7} {:>7} {:>6} {:>6} {:>9} {:>8}  {}\n", "optimizer",
               "grad", "param", "state", "Mparam/s", "B/par", "GB/s", "triad", "bound", "bnd-nt", "torch M/s",
               "speedup", "torch variant");
  }
  int failures = 0;
  for (const Config& c : configs()) {
    const std::string name = c.grad_norm_only ? "grad_norm" : std::string(optimizer_name(c.optimizer));
    if (!o.only.empty() && ("," + o.only + ",").find("," + name + ",") == std::string::npos) continue;
    const Measured m = measure(c, n, o, pool.get(), isa, triad);
    if (!m.error.empty()) {
      fmt::print(stderr, "optim: {} failed: {}\n", name, m.error);
      ++failures;
      continue;
    }
    const double bpp = bytes_per_param(c);
    const double gbs = m.mparams_per_s * 1e6 * bpp / 1e9;
    nlohmann::json row = {
        {"optimizer", name},
        {"param_dtype", c.param == DType::kNone ? "f32(master)" : dtype_name(c.param)},
        {"grad_dtype", dtype_name(c.grad)},
        {"state_dtype", c.grad_norm_only ? "none" : dtype_name(c.state)},
        {"isa", isa_used},
        {"device", o.device},
        {"threads", cuda ? 0 : threads},
        {"n_params", n},
        {"mparams_per_s", m.mparams_per_s},
        {"bytes_per_param", bpp},
        {"gb_s", gbs},
        {"triad_gb_s", m.triad_gb_s},
        {"bound_fraction", gbs / m.triad_gb_s},
        {"triad_nt_gb_s", cuda ? nlohmann::json(nullptr) : nlohmann::json(m.triad_nt_gb_s)},
        {"bound_fraction_nt", cuda ? nlohmann::json(nullptr) : nlohmann::json(gbs / m.triad_nt_gb_s)},
        {"torch_mparams_per_s", nullptr},
        {"speedup_vs_torch", nullptr},
        {"torch_variant", nullptr}};
    const std::string tn = c.grad_norm_only ? "" : torch_name(c.optimizer);
    std::string why = tn.empty() ? "torch.optim has no " + name : "";
    if (!tn.empty() && o.torch && !cuda) {
      if (!torch_cache.count(tn)) {
        std::optional<nlohmann::json> t = torch_rate(tn, n, threads, o.repeats, &why);
        torch_cache[tn] = t ? *t : nlohmann::json{{"error", why}};
      }
      const nlohmann::json& t = torch_cache[tn];
      if (t.contains("mparams_per_s")) {
        const double tr = t["mparams_per_s"];
        row["torch_mparams_per_s"] = tr;
        row["speedup_vs_torch"] = m.mparams_per_s / tr;
        row["torch_variant"] = t["variant"];
      } else {
        why = t.value("error", "torch failed");
      }
    } else if (!tn.empty()) {
      why = cuda ? "torch baseline is CPU-only here" : "--no-torch";
    }
    if (!o.json) {
      fmt::print(
          "{:<9} {:>5} {:>5} {:>5} {:>9.1f} {:>6.0f} {:>7.2f} {:>7.2f} {:>6.2f} {:>6.2f} {:>9} {:>8}  {}\n",
          name, dtype_name(c.grad), row["param_dtype"].get<std::string>().substr(0, 5),
          row["state_dtype"].get<std::string>(), m.mparams_per_s, bpp, gbs, m.triad_gb_s, gbs / m.triad_gb_s,
          cuda ? 0.0 : gbs / m.triad_nt_gb_s,
          row["torch_mparams_per_s"].is_null()
              ? "-"
              : fmt::format("{:.1f}", row["torch_mparams_per_s"].get<double>()),
          row["speedup_vs_torch"].is_null() ? "-"
                                            : fmt::format("{:.1f}x", row["speedup_vs_torch"].get<double>()),
          row["torch_variant"].is_null() ? why : row["torch_variant"].get<std::string>());
    }
    rows.push_back(row);
  }
  if (o.json) fmt::print("{}\n", rows.dump(2));
  return failures == 0 ? 0 : 1;
}

Registrar reg{
    "optim", "fused optimizer steps vs STREAM triad and torch.optim", [](CLI::App& app) {
      auto o = std::make_shared<OptimOptions>();
      app.add_option("--mparams", o->mparams, "millions of parameters per step")->capture_default_str();
      app.add_option("--threads", o->threads, "CPU threads (0 = all cores)")->capture_default_str();
      app.add_option("--repeats", o->repeats, "timed steps; the median is reported")->capture_default_str();
      app.add_option("--device", o->device, "cpu or cuda")->capture_default_str();
      app.add_option("--isa", o->isa, "force scalar, avx2 or avx512 (default: CPUID)");
      app.add_option("--only", o->only, "comma-separated optimizers (adamw,lamb,...,grad_norm)");
      app.add_flag("--json", o->json, "print a JSON array, one object per configuration");
      app.add_flag("!--no-torch", o->torch, "skip the torch.optim baseline");
      return [o] { return run_optim(*o); };
    }};

}  // namespace
}  // namespace strata::bench
