// strata-probe's measurements (tools/probe/measure.hpp, through the one rate
// measurer of runtime/rates/): the thread count a rate is reported for is the
// number of threads that did the work.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "probe/measure.hpp"

namespace strata::probe {
namespace {

// CPU time (user + system, clock ticks) of each thread of this process, by thread id.
std::map<int, long> thread_cpu_ticks() {
  std::map<int, long> ticks;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;  // the thread ended
    // Fields after the command name (in parentheses, may hold spaces): state is
    // field 3, utime 14, stime 15.
    std::istringstream rest(line.substr(line.rfind(')') + 2));
    std::string field;
    long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && rest >> field; ++i) {
      if (i == 14) utime = std::stol(field);
      if (i == 15) stime = std::stol(field);
    }
    ticks[std::stoi(entry.path().filename().string())] = utime + stime;
  }
  return ticks;
}

// The threads that ran a measurement: those whose CPU time grew between its
// first progress report (after the warm-up step) and its last (after the timed
// steps) by at least half the busiest thread's growth. (A quarter counted the calling
// thread once in CI: at a few clock ticks per worker, the tick its own /proc reads
// took was a quarter of theirs. The threads that share a measurement share it about
// equally, so half still counts each of them, and counted the calling thread when it
// worked too.)
std::size_t threads_that_worked(const std::map<int, long>& before, const std::map<int, long>& after) {
  long most = 0;
  for (const auto& [tid, t] : after) most = std::max(most, t - (before.contains(tid) ? before.at(tid) : 0));
  std::size_t n = 0;
  for (const auto& [tid, t] : after)
    n += (t - (before.contains(tid) ? before.at(tid) : 0)) * 2 >= most ? 1 : 0;
  return most > 0 ? n : 0;
}

// Before the fix the probe printed "2 threads" for a CPU optimizer rate measured
// on 3: the pool's 2 workers and the calling thread, which ThreadPool::parallel_for
// puts to work too.
TEST(ProbeMeasure, CpuOptimizerRateIsMeasuredOnTheThreadsItNames) {
  constexpr std::size_t kThreads = 2;
  std::map<int, long> before, after;
  Progress progress = [&](std::string_view, double fraction) {
    if (fraction == 0.25) before = thread_cpu_ticks();  // after the warm-up step
    if (fraction == 1.0) after = thread_cpu_ticks();    // after the timed steps, workers still alive
  };
  // Large enough that the timed steps take tens of clock ticks of CPU (at 24M it was
  // a few per worker on this machine).
  rates::RateMeasurer measurer(progress);
  Status st = measure_cpu_optimizer(measurer, 48'000'000, kThreads);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_GT(measurer.rates().cpu_optim_params_per_s, 0.0);
  EXPECT_EQ(measurer.rates().cpu_threads, static_cast<double>(kThreads));
  ASSERT_FALSE(before.empty());
  ASSERT_FALSE(after.empty());
  EXPECT_EQ(threads_that_worked(before, after), kThreads);
}

TEST(ProbeMeasure, HostMemoryRateIsMeasuredOnTheThreadsItNames) {
  constexpr std::size_t kThreads = 2;
  std::map<int, long> before, after;
  Progress progress = [&](std::string_view, double fraction) {
    if (fraction == 0.25) before = thread_cpu_ticks();
    if (fraction == 1.0) after = thread_cpu_ticks();
  };
  rates::RateMeasurer measurer(progress);
  Status st = measure_host_memory(measurer, 512 * 1024 * 1024, kThreads);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_GT(measurer.rates().host_memory_bytes_per_s, 0.0);
  EXPECT_EQ(threads_that_worked(before, after), kThreads);
}

}  // namespace
}  // namespace strata::probe
