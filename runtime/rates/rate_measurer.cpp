// The rate measurer's copies, CPU optimizer and host memory (Note [One rate
// measurer] in rate_measurer.hpp); its disk passes are disk.cpp.
#include "strata/rates/rate_measurer.hpp"

#include <cstring>
#include <memory>
#include <vector>

#include "measure_util.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/kernels/q8.hpp"

namespace strata::rates {
using namespace detail;

Status RateMeasurer::measure_copies(memory::Device& device, const CopyOptions& o) {
  if (o.bytes == 0) return invalid_argument("rates: copies of 0 bytes");
  STRATA_RETURN_IF_ERROR(check_sampling(o.sampling, "copies"));
  report(progress_, "device", 0.0);
  STRATA_ASSIGN_OR_RETURN(memory::DeviceAllocation dev, device.allocate(o.bytes));
  AlignedBuffer host(o.bytes);
  if (host.data == nullptr) return out_of_memory("rates: no memory for {} to copy", format_bytes(o.bytes));
  std::memset(host.data, 1, o.bytes);
  STRATA_ASSIGN_OR_RETURN(memory::Stream stream, device.create_stream());
  constexpr int kCopies = 3;  // a run
  auto copies = [&](memory::CopyKind kind, void* dst, const void* src) -> Result<double> {
    const auto start = Clock::now();
    for (int i = 0; i < kCopies; ++i)
      STRATA_RETURN_IF_ERROR(device.copy_async(stream, dst, src, o.bytes, kind));
    STRATA_RETURN_IF_ERROR(device.synchronize(stream));
    return since(start);
  };
  const double bytes = static_cast<double>(o.bytes) * kCopies;
  STRATA_ASSIGN_OR_RETURN(rates_.h2d_bytes_per_s, sample_rate(o.sampling, bytes, progress_, "", [&] {
                            return copies(memory::CopyKind::kHostToDevice, dev.data(), host.data);
                          }));
  report(progress_, "device", 0.5);
  STRATA_ASSIGN_OR_RETURN(rates_.d2h_bytes_per_s, sample_rate(o.sampling, bytes, progress_, "", [&] {
                            return copies(memory::CopyKind::kDeviceToHost, host.data, dev.data());
                          }));
  report(progress_, "device", 1.0);
  return Status::Ok();
}

Status RateMeasurer::measure_cpu_optimizer(const OptimizerOptions& o) {
  if (o.params == 0 || o.threads == 0) {
    return invalid_argument("rates: the CPU optimizer over {} params on {} threads: at least 1 of each",
                            o.params, o.threads);
  }
  STRATA_RETURN_IF_ERROR(check_sampling(o.sampling, "the CPU optimizer"));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ThreadPool> pool, ThreadPool::create({.threads = o.threads}));
  const std::size_t n = o.params;
  std::vector<float> master(n, 0.5f), grad(n, 1e-3f), m(n, 0.0f), v(n, 0.0f);
  kernels::Span span;
  span.master = master.data();
  span.grad = grad.data();
  span.state = {m.data(), v.data()};
  span.n = n;
  const kernels::GradStats checked{.sum_squares = 1.0,
                                   .finite = true};  // kCallerChecked: what grad_stats gives
  kernels::StepArgs args;
  args.hyper.optimizer = kernels::Optimizer::kAdamW;
  args.spans = std::span<const kernels::Span>(&span, 1);
  args.pool = pool.get();
  args.check = o.check;
  if (o.check == kernels::GradCheck::kCallerChecked) args.checked = &checked;
  // q8: the same step on 8-bit states, from the zero state (zero bytes).
  const bool q8 = o.state_dtype == kernels::DType::kQ8;
  std::vector<std::uint8_t> m_codes(q8 ? n : 0), v_codes(q8 ? n : 0);
  std::vector<float> m_scales(q8 ? kernels::q8_blocks(n) : 0), v_scales(q8 ? kernels::q8_blocks(n) : 0);
  const kernels::Q8Span q8_span{.master = master.data(),
                                .grad = grad.data(),
                                .m_codes = m_codes.data(),
                                .m_scales = m_scales.data(),
                                .v_codes = v_codes.data(),
                                .v_scales = v_scales.data(),
                                .n = n};
  auto run = [&]() -> Result<kernels::StepReport> {
    if (!q8) return kernels::step(args);
    return kernels::step_q8({.hyper = args.hyper,
                             .step = args.step,
                             .spans = std::span<const kernels::Q8Span>(&q8_span, 1),
                             .pool = args.pool,
                             .check = args.check,
                             .checked = args.checked});
  };
  auto step = [&]() -> Result<double> {
    ++args.step;
    return on_pool(*pool, [&]() -> Result<double> {
      const auto start = Clock::now();
      STRATA_ASSIGN_OR_RETURN(kernels::StepReport r, run());
      const double s = since(start);
      if (!r.applied) return internal_error("rates: the optimizer step on finite gradients was not applied");
      return s;
    });
  };
  STRATA_ASSIGN_OR_RETURN(rates_.cpu_optim_params_per_s,
                          sample_rate(o.sampling, static_cast<double>(n), progress_, "cpu optimizer", step));
  rates_.cpu_threads = static_cast<double>(o.threads);
  return Status::Ok();
}

Status RateMeasurer::measure_host_memory(const HostMemoryOptions& o) {
  if (o.bytes == 0 || o.bytes % 4096 != 0 || o.threads == 0) {
    return invalid_argument(
        "rates: host memory copies of {} bytes on {} threads: a positive multiple of 4096, "
        "at least 1 thread",
        o.bytes, o.threads);
  }
  STRATA_RETURN_IF_ERROR(check_sampling(o.sampling, "host memory"));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<ThreadPool> pool, ThreadPool::create({.threads = o.threads}));
  AlignedBuffer src(o.bytes), dst(o.bytes);
  if (src.data == nullptr || dst.data == nullptr)
    return out_of_memory("rates: no memory for 2 x {} to measure host memory", format_bytes(o.bytes));
  std::memset(src.data, 1, o.bytes);
  std::memset(dst.data, 0, o.bytes);
  auto copy = [&]() -> Result<double> {
    return on_pool(*pool, [&] {
      const auto start = Clock::now();
      pool->parallel_for(o.bytes / 4096, 0, [&](std::size_t, std::size_t begin, std::size_t end) {
        std::memcpy(dst.data + begin * 4096, src.data + begin * 4096, (end - begin) * 4096);
      });
      return since(start);
    });
  };
  STRATA_ASSIGN_OR_RETURN(
      rates_.host_memory_bytes_per_s,
      sample_rate(o.sampling, 2.0 * static_cast<double>(o.bytes), progress_, "host memory", copy));
  return Status::Ok();
}

}  // namespace strata::rates
