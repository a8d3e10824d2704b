#pragma once
// strata-bench optim's measurement of one configuration (optimizer x dtypes): the
// kernel, its memory-only roofline, the runtime's paths and the STREAM triad, timed
// interleaved (Note [Bytes per param] and Note [Runtime path] in optim_measure.cpp).
// bench_optim.cpp turns what it measures into rows and compares torch.optim.

#include <cstddef>
#include <string>
#include <vector>

#include "roofline/mem_roofline.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/optim.hpp"

namespace strata::bench::optim {

//! `strata-bench optim`'s command line.
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

//! One row of the bench: an optimizer and its dtypes.
struct Config {
  kernels::Optimizer optimizer;
  kernels::DType grad, param, state;  // param kNone: the fp32 master is the param
  bool grad_norm_only = false;
  bool q8 = false;  //!< kernels::step_q8: 8-bit m and v (state kNone; Note [Q8 roofline])
};

//! The rows the bench measures, in order.
std::vector<Config> configs();

//! Bytes the pass moves per param, reads plus writes (Note [Bytes per param]).
double bytes_per_param(const Config& c);

//! torch.optim's name for the optimizer, "" when torch.optim has none.
std::string torch_name(kernels::Optimizer o);

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

//! Runs the config `repeats` times (after a warm-up) on CPU or GPU buffers,
//! each repeat timing the kernel, its memory-only roofline, the runtime's two
//! paths and the triad once, in that order (Note [Bytes per param]). Blocks;
//! a failure is in Measured::error.
Measured measure(const Config& c, std::size_t n, const OptimOptions& o, ThreadPool* pool, kernels::Isa isa);

}  // namespace strata::bench::optim
