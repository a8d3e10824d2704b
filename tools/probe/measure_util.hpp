#pragma once
// What strata-probe's measurement files share (measure.cpp, measure_nvme.cpp):
// timing, progress reports, huge-page-backed aligned buffers, running a kernel on a
// pool's workers, the median. Private to tools/probe.

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <string_view>
#include <vector>

#include "measure.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/thread_pool.hpp"

namespace strata::probe::measure_detail {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

inline double since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline void report(const Progress& progress, std::string_view stage, double fraction) {
  if (progress) progress(stage, std::clamp(fraction, 0.0, 1.0));
}

// 4096-aligned host memory, freed on destruction.
// Buffers backed as the runtime's pinned host pool is (transparent huge pages
// where the kernel allows them): O_DIRECT reads into 4 KiB pages run at a
// fraction of the rate on some disks (strata-bench io --no-huge-pages shows it),
// so measuring with them would under-predict the runtime's NVMe reads.
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
// there runs on the pool's workers only, as the runtime's optimizer tasks do,
// whereas called from this thread it would add the caller as one more worker
// (ThreadPool::parallel_for) and measure threads + 1 threads.
template <typename Fn>
auto on_pool(ThreadPool& pool, Fn fn) -> decltype(fn()) {
  std::promise<decltype(fn())> done;
  pool.post([&] { done.set_value(fn()); });
  return done.get_future().get();
}

// The median (the upper one of an even count).
inline double median3(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace strata::probe::measure_detail
