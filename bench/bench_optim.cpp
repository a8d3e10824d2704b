// strata-bench optim: fused optimizer steps per optimizer x dtype, against a
// memory-only kernel with the same streams (the roofline), through the calls
// the runtime makes (its gradient check and clipping norm), and against
// torch.optim with the same dtypes (/usr/bin/python3), all on the same threads
// in the same run. --device cuda runs the CUDA kernels against a device triad.
// What one row measures and how: Note [Bytes per param] and Note [Runtime path] in
// optim_measure.cpp.
//
//
// Every figure is the best of --repeats timed runs after one warm-up; the
// kernel, the memory-only kernel, the two runtime paths and the STREAM triad
// (information only, 16 B/element: it pays write-allocate) run interleaved, one
#include <algorithm>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "optim_measure.hpp"
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
using optim::bytes_per_param;
using optim::Config;
using optim::configs;
using optim::measure;
using optim::Measured;
using optim::OptimOptions;
using optim::torch_name;

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
  if (c.q8) return "torch.optim has no 8-bit states (torchao and bitsandbytes do; not run here)";
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

//! What every row shares: the options, where it runs and the torch.optim rates so far.
struct Bench {
  const OptimOptions& o;
  bool cuda = false;
  Isa isa = Isa::kScalar;
  std::string isa_used;
  std::size_t threads = 0;
  std::unique_ptr<ThreadPool> pool;
  std::size_t n = 0;
  std::map<std::string, nlohmann::json> torch_cache;
};

//! The exit code refusing the command line (naming the flag), or nullopt with b's
//! device, isa, threads and pool set.
std::optional<int> setup(Bench& b) {
  const OptimOptions& o = b.o;
  b.cuda = o.device == "cuda";
  if (o.device != "cpu" && !b.cuda) {
    fmt::print(stderr, "optim: --device {} is unknown; use cpu or cuda\n", o.device);
    return 2;
  }
  if (b.cuda) {
    if (Status s = cuda_probe(); !s.ok()) {
      fmt::print(stderr, "optim: --device cuda: {}\n", s.to_string());
      return 1;
    }
  }
  b.isa = default_isa();  // the CPUID dispatch of the kernels (STRATA_KERNELS_ISA honoured)
  if (!o.isa.empty()) {
    Result<Isa> parsed = parse_isa(o.isa);
    if (!parsed.ok()) {
      fmt::print(stderr, "optim: --isa: {}\n", parsed.status().to_string());
      return 2;
    }
    b.isa = *parsed;
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
  b.threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  if (!b.cuda && b.threads > 1) {
    auto made = ThreadPool::create({.threads = b.threads});
    if (!made.ok()) {
      fmt::print(stderr, "optim: --threads = {}: {}\n", b.threads, made.status().to_string());
      return 2;
    }
    b.pool = std::move(made).value();
  }
  b.n = static_cast<std::size_t>(o.mparams * 1e6);
  b.isa_used = b.cuda ? "cuda" : std::string(isa_name(b.isa));
  return std::nullopt;
}

void print_header(const Bench& b) {
  fmt::print("optim: {} params, device {}, isa {}, {} threads, best of {} runs after a warm-up\n", b.n,
             b.o.device, b.isa_used, b.cuda ? 0 : b.threads, b.o.repeats);
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

//! The row measured, again while --check flags it, up to --check-attempts in all
//! (Note [Roofline check]); *attempts: how many measurements it took.
Measured measure_checked(Bench& b, const Config& c, const std::string& name, int* attempts) {
  const OptimOptions& o = b.o;
  Measured m;
  *attempts = 0;
  while (true) {  // Note [Roofline check]
    m = measure(c, b.n, o, b.pool.get(), b.isa);
    ++*attempts;
    if (!m.error.empty() || !o.check || !roofline_violated(m, o) || *attempts >= o.check_attempts) break;
    fmt::print(stderr, "optim: {} {}/{}: roofline_fraction {:.3f} ({}) above 1 + {}; measuring again\n", name,
               dtype_name(c.grad), dtype_name(c.state), check_fraction(m).first, check_fraction(m).second,
               o.check_tolerance);
  }
  return m;
}

//! The row's JSON object with its own figures; the torch.optim keys null.
nlohmann::json make_row(const Bench& b, const Config& c, const std::string& name, const Measured& m,
                        int attempts, bool violation) {
  const bool cuda = b.cuda;
  const std::size_t n = b.n;
  const auto [checked_fraction, check_clock] = check_fraction(m);
  const double bpp = bytes_per_param(c);
  const double kernel_mps = double(n) / m.kernel_s / 1e6;
  const nlohmann::json roof_mps = rate_or_null(n, m.roofline_s);
  const nlohmann::json rt_mps = rate_or_null(n, m.runtime_s);
  const nlohmann::json rt_clip_mps = rate_or_null(n, m.runtime_clip_s);
  const nlohmann::json rt_host_mps = rate_or_null(n, m.runtime_host_s);
  auto over_kernel = [&](const nlohmann::json& v) {
    return v.is_number() ? nlohmann::json(v.get<double>() / kernel_mps) : nlohmann::json(nullptr);
  };
  return {
      {"optimizer", name},
      {"param_dtype", c.param == DType::kNone ? "fp32(master)" : dtype_name(c.param)},
      {"grad_dtype", dtype_name(c.grad)},
      {"state_dtype", c.grad_norm_only ? "none" : (c.q8 ? "q8" : dtype_name(c.state))},
      {"isa", b.isa_used},
      {"device", b.o.device},
      {"threads", cuda ? 0 : b.threads},
      {"threads_used", cuda ? nlohmann::json(nullptr) : nlohmann::json(m.threads_used)},
      {"n_params", n},
      {"timing", fmt::format("best of {} after a warm-up", b.o.repeats)},
      {"load_average_1m", load_average_1m()},
      {"mparams_per_s", kernel_mps},
      {"bytes_per_param", bpp},
      {"gb_s", kernel_mps * bpp / 1e3},
      {"roofline", cuda ? "none on cuda (no device memory-only kernel)"
                        : "memory-only kernel, same streams, dtypes, isa, pool and split"},
      {"roofline_mparams_per_s", roof_mps},
      {"roofline_gb_s", roof_mps.is_number() ? nlohmann::json(roof_mps.get<double>() * bpp / 1e3) : nullptr},
      {"roofline_fraction",
       roof_mps.is_number() ? nlohmann::json(kernel_mps / roof_mps.get<double>()) : nlohmann::json(nullptr)},
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
      {"fp32_states_mparams_per_s", nullptr},
      {"ratio_to_fp32_states", nullptr},
      {"torch_mparams_per_s", nullptr},
      {"speedup_vs_torch", nullptr},
      {"torch_variant", nullptr},
      {"torch_note", nullptr}};
}

//! Fills the row's torch.optim keys (measured once per optimizer and grad dtype);
//! returns why there is no torch figure, "" when there is one.
std::string add_torch(Bench& b, const Config& c, nlohmann::json& row) {
  std::string why = torch_lacks(c);
  if (why.empty() && (!b.o.torch || b.cuda)) why = b.cuda ? "torch baseline is CPU-only here" : "--no-torch";
  if (why.empty()) {
    const std::string key = torch_name(c.optimizer) + "/" + std::string(dtype_name(c.grad));
    if (!b.torch_cache.count(key)) {
      std::optional<nlohmann::json> t = torch_rate(c, b.n, b.threads, b.o.repeats, &why);
      b.torch_cache[key] = t ? *t : nlohmann::json{{"error", why}};
    }
    const nlohmann::json& t = b.torch_cache[key];
    if (t.contains("mparams_per_s")) {
      const double tr = t["mparams_per_s"];
      row["torch_mparams_per_s"] = tr;
      row["speedup_vs_torch"] = row["mparams_per_s"].get<double>() / tr;
      row["torch_variant"] = t["variant"];
    } else {
      why = t.value("error", "torch failed");
    }
  }
  if (!why.empty()) row["torch_note"] = why;
  return why;
}

void print_row(const Config& c, const nlohmann::json& row, const std::string& why) {
  fmt::print(
      "{:<9} {:>4} {:>5} {:>4} {:>7.1f} {:>5.0f} {:>7} {:>5} {:>6} {:>5} {:>6} {:>5} {:>6} {:>5} "
      "{:>6.2f} "
      "{:>7} {:>7}  {}\n",
      row["optimizer"].get<std::string>(), dtype_name(c.grad),
      c.param == DType::kNone ? "=mst" : dtype_name(c.param),
      row["state_dtype"].get<std::string>().substr(0, 4), row["mparams_per_s"].get<double>(),
      row["bytes_per_param"].get<double>(), fixed(row["roofline_mparams_per_s"], "{:.1f}"),
      fixed(row["roofline_fraction"], "{:.2f}"), fixed(row["runtime_path_mparams_per_s"], "{:.1f}"),
      fixed(row["runtime_path_fraction"], "{:.2f}"), fixed(row["runtime_path_clip_mparams_per_s"], "{:.1f}"),
      fixed(row["runtime_path_clip_fraction"], "{:.2f}"),
      fixed(row["runtime_path_host_grad_mparams_per_s"], "{:.1f}"),
      fixed(row["runtime_path_host_grad_fraction"], "{:.2f}"), row["triad_gb_s"].get<double>(),
      fixed(row["torch_mparams_per_s"], "{:.1f}"), fixed(row["speedup_vs_torch"], "{:.1f}x"),
      row["torch_variant"].is_null() ? why : row["torch_variant"].get<std::string>());
}

// Note [Q8 row against fp32 states]
// #49 asks q8 AdamW for at least 1.6x the params/s of AdamW with fp32 states
// on the same threads (it moves 16.06 B a parameter against 28). The q8 row's
// ratio_to_fp32_states is its kernel rate over that of the row with fp32 states
// and the same optimizer, gradient and param dtypes measured earlier in the same
// run (configs() lists it first); null when that row did not run (--only).

//! Fills the q8 row's fp32-state comparison from the rows measured so far.
void add_fp32_states_ratio(const Config& c, const nlohmann::json& rows, nlohmann::json& row) {
  if (!c.q8) return;
  for (const nlohmann::json& r : rows) {
    if (r["optimizer"] == row["optimizer"] && r["state_dtype"] == "fp32" &&
        r["grad_dtype"] == row["grad_dtype"] && r["param_dtype"] == row["param_dtype"]) {
      const double fp32 = r["mparams_per_s"].get<double>();
      row["fp32_states_mparams_per_s"] = fp32;
      row["ratio_to_fp32_states"] = row["mparams_per_s"].get<double>() / fp32;
    }
  }
}

//! Measures, checks, prints and appends one row; the failures it counts.
int run_row(Bench& b, const Config& c, nlohmann::json& rows) {
  const OptimOptions& o = b.o;
  const std::string name = c.grad_norm_only ? "grad_norm" : std::string(optimizer_name(c.optimizer));
  if (!o.only.empty() && ("," + o.only + ",").find("," + name + ",") == std::string::npos) return 0;
  if (c.q8 && b.cuda) {
    fmt::print(stderr, "optim: {} q8 row not measured: no CUDA q8 step is timed yet\n", name);
    return 0;
  }
  int attempts = 0;
  const Measured m = measure_checked(b, c, name, &attempts);
  if (!m.error.empty()) {
    fmt::print(stderr, "optim: {} failed: {}\n", name, m.error);
    return 1;
  }
  int failures = 0;
  if (!b.cuda && m.threads_used > b.threads) {
    fmt::print(stderr, "optim: {} threads ran pieces, more than --threads {}\n", m.threads_used, b.threads);
    ++failures;
  }
  const auto [checked_fraction, check_clock] = check_fraction(m);
  const bool violation = !b.cuda && roofline_violated(m, o);
  if (violation && o.check) {
    fmt::print(
        stderr,
        "optim: {} grad {} param {} states {}: roofline_fraction {:.3f} ({}) above 1 + {} in all {} "
        "attempts: the memory-only kernel is not an upper bound for this row (Note [Roofline check])\n",
        name, dtype_name(c.grad), dtype_name(c.param), dtype_name(c.state), checked_fraction, check_clock,
        o.check_tolerance, attempts);
    ++failures;
  }
  nlohmann::json row = make_row(b, c, name, m, attempts, violation);
  add_fp32_states_ratio(c, rows, row);
  const std::string why = add_torch(b, c, row);
  if (!o.json) print_row(c, row, why);
  if (!o.json && row["ratio_to_fp32_states"].is_number()) {
    fmt::print(
        "{:<9} q8 states: {:.2f}x the fp32-state row's {:.1f} M/s (Note [Q8 row against fp32 states])\n", "",
        row["ratio_to_fp32_states"].get<double>(), row["fp32_states_mparams_per_s"].get<double>());
  }
  rows.push_back(row);
  return failures;
}

int run_optim(const OptimOptions& o) {
  Bench b{.o = o};
  if (std::optional<int> refused = setup(b)) return *refused;
  if (!o.json) print_header(b);
  nlohmann::json rows = nlohmann::json::array();
  int failures = 0;
  for (const Config& c : configs()) failures += run_row(b, c, rows);
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
