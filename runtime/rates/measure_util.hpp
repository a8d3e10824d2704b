#pragma once
// What the rate measurer's files share (rate_measurer.cpp, disk.cpp): timing,
// progress reports, huge-page-backed aligned buffers, running work on a pool's
// workers, and the sampling of Sampling. Private to runtime/rates.

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <future>
#include <string_view>
#include <vector>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/status.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/rates/rate_measurer.hpp"

namespace strata::rates::detail {

using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline void report(const Progress& progress, std::string_view stage, double fraction) {
  if (progress) progress(stage, std::clamp(fraction, 0.0, 1.0));
}

// 2 MiB-aligned host memory, freed on destruction; data is null when the
// allocation failed. Backed as the runtime's pinned host pool is (transparent
// huge pages where the kernel allows them): O_DIRECT reads into 4 KiB pages run
// at a fraction of the rate on some disks (strata-bench io --no-huge-pages shows
// it), so measuring with them would under-predict the runtime's NVMe reads.
struct AlignedBuffer {
  explicit AlignedBuffer(std::size_t bytes)
      : data(static_cast<std::byte*>(std::aligned_alloc(2 * kMiB, align_up(bytes, 2 * kMiB)))), size(bytes) {
    if (data != nullptr) ::madvise(data, align_up(bytes, 2 * kMiB), MADV_HUGEPAGE);  // a hint; may be refused
  }
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::byte* data;
  std::size_t size;
};

// Runs fn on one of `pool`'s workers and waits: a kernel's parallel_for called
// there runs on the pool's workers only, as the runtime's optimizer tasks do.
template <typename Fn>
auto on_pool(ThreadPool& pool, Fn fn) -> decltype(fn()) {
  std::promise<decltype(fn())> done;
  pool.post([&] { done.set_value(fn()); });
  return done.get_future().get();
}

// The rates reduced by `statistic`: the highest, or the median (the upper one of
// an even count). `rates` is not empty.
inline double reduce(Statistic statistic, std::vector<double> rates) {
  std::sort(rates.begin(), rates.end());
  return statistic == Statistic::kBest ? rates.back() : rates[rates.size() / 2];
}

inline Status check_sampling(const Sampling& s, std::string_view what) {
  if (s.runs_min < 1 || s.runs_max < s.runs_min) {
    return invalid_argument("rates: {} runs {} to {}: at least 1, and the most at least the least", what,
                            s.runs_min, s.runs_max);
  }
  return Status::Ok();
}

// Sampling's runs of run() (which returns the seconds it timed) over `work` units
// a run: the rate. Reports `stage` after the warm-up (0.25), after each timed run
// and at the end (1.0); no reports for an empty stage.
template <typename Run>
Result<double> sample_rate(const Sampling& s, double work, const Progress& progress, std::string_view stage,
                           const Run& run) {
  auto note = [&](double fraction) {
    if (!stage.empty()) report(progress, stage, fraction);
  };
  STRATA_RETURN_IF_ERROR(run().status());  // the warm-up
  note(0.25);
  std::vector<double> rates;
  double timed_s = 0;
  while (rates.size() < static_cast<std::size_t>(s.runs_min) ||
         (timed_s < s.seconds_min && rates.size() < static_cast<std::size_t>(s.runs_max))) {
    STRATA_ASSIGN_OR_RETURN(const double seconds, run());
    rates.push_back(work / seconds);
    timed_s += seconds;
    note(std::min(0.99, 0.25 + 0.75 * static_cast<double>(rates.size()) / s.runs_min));
  }
  note(1.0);
  STRATA_LOG_DEBUG("rates: {} samples: {:.4g}", stage, fmt::join(rates, " "));
  return reduce(s.statistic, std::move(rates));
}

}  // namespace strata::rates::detail
