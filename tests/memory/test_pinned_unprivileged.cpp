// The unprivileged path of PinnedHostPool: with RLIMIT_MEMLOCK = 8 MiB and no
// CAP_IPC_LOCK, a region above the limit falls back to unpinned memory and says so in the
// log; a region within it is mlocked. Run as root, the check forks a child that drops to
// uid/gid 65534 (nobody) first; run as an ordinary user, the child only lowers its limit.

#include <grp.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "memory/test_util.hpp"
#include "strata/memory/pinned_host_pool.hpp"

namespace strata::memory {
namespace {

constexpr rlim_t kMemlockLimitBytes = 8 * kMiB;
constexpr uid_t kNobody = 65534;

// What the child saw, one "key=value" line each; parsed by the parent.
std::string child_report() {
  std::string out;
  if (geteuid() == 0) {
    if (setgroups(0, nullptr) != 0) return "error=setgroups " + std::string(std::strerror(errno)) + "\n";
    if (setresgid(kNobody, kNobody, kNobody) != 0)
      return "error=setresgid " + std::string(std::strerror(errno)) + "\n";
  }
  rlimit limit{kMemlockLimitBytes, kMemlockLimitBytes};
  if (setrlimit(RLIMIT_MEMLOCK, &limit) != 0)
    return "error=setrlimit " + std::string(std::strerror(errno)) + "\n";
  if (geteuid() == 0 && setresuid(kNobody, kNobody, kNobody) != 0) {
    return "error=setresuid " + std::string(std::strerror(errno)) + "\n";
  }
  out += "uid=" + std::to_string(geteuid()) + "\n";

  testing::LogCapture log;
  PinnedHostPoolOptions large;  // 16 MiB > 8 MiB limit
  large.budget_bytes = 16 * kMiB;
  large.slot_bytes = 2 * kMiB;
  large.arena_bytes = 4 * kMiB;
  large.huge_pages = false;
  {
    auto pool = PinnedHostPool::create(large);
    if (!pool.ok()) return out + "error=large pool: " + pool.status().to_string() + "\n";
    out += "large=" + std::string(pinning_mode_name((*pool)->pinning())) + "\n";
  }
  const std::string text = log.text();
  out += "large_logged_refusal=" + std::to_string(text.find("mlock refused") != std::string::npos) + "\n";
  out +=
      "large_logged_limit=" + std::to_string(text.find("RLIMIT_MEMLOCK is 8.00 MiB") != std::string::npos) +
      "\n";
  out += "large_logged_fallback=" + std::to_string(text.find("using unpinned memory") != std::string::npos) +
         "\n";

  PinnedHostPoolOptions small = large;  // 6 MiB <= 8 MiB limit
  small.budget_bytes = 6 * kMiB;
  small.slot_count = 1;
  {
    auto pool = PinnedHostPool::create(small);
    if (!pool.ok()) return out + "error=small pool: " + pool.status().to_string() + "\n";
    out += "small=" + std::string(pinning_mode_name((*pool)->pinning())) + "\n";
    // The mlocked region works: a slot and a buffer from it.
    auto slot = (*pool)->acquire_slot();
    auto buffer = (*pool)->allocate(1000);
    out += "small_usable=" + std::to_string(slot.ok() && buffer.ok()) + "\n";
  }
  return out;
}

std::string value_of(const std::string& report, const std::string& key) {
  const std::string needle = key + "=";
  const auto at = report.find(needle);
  if (at == std::string::npos) return "<missing>";
  const auto end = report.find('\n', at);
  return report.substr(at + needle.size(), end - at - needle.size());
}

TEST(PinnedHostPoolUnprivileged, FallsBackAboveTheMemlockLimitAndLocksWithinIt) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0) << std::strerror(errno);
  if (pid == 0) {
    close(fds[0]);
    const std::string report = child_report();
    const ssize_t written = write(fds[1], report.data(), report.size());
    _exit(written == static_cast<ssize_t>(report.size()) ? 0 : 1);
  }
  close(fds[1]);
  std::string report;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) report.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int wstatus = 0;
  ASSERT_EQ(waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus)) << report;
  ASSERT_EQ(WEXITSTATUS(wstatus), 0) << report;

  EXPECT_EQ(value_of(report, "error"), "<missing>") << report;
  if (geteuid() == 0) {
    EXPECT_EQ(value_of(report, "uid"), "65534") << report;
  }
  EXPECT_EQ(value_of(report, "large"), "unpinned") << report;
  EXPECT_EQ(value_of(report, "large_logged_refusal"), "1") << report;
  EXPECT_EQ(value_of(report, "large_logged_limit"), "1") << report;
  EXPECT_EQ(value_of(report, "large_logged_fallback"), "1") << report;
  EXPECT_EQ(value_of(report, "small"), "mlock") << report;
  EXPECT_EQ(value_of(report, "small_usable"), "1") << report;
}

}  // namespace
}  // namespace strata::memory
