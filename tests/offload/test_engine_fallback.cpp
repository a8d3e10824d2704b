// make_io_engine: kAuto falls back to the posix engine when io_uring cannot be
// set up — simulated through the factory hook, and for real in a child process
// whose seccomp filter makes io_uring_setup fail.
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>

#include "strata/common/bytes.hpp"
#include "strata/offload/io_engine.hpp"
#include "test_util.hpp"

namespace strata::offload {
namespace {

using testing::AlignedBuffer;
using testing::fill_random;
using testing::open_file;
using testing::TempDir;

class SimulatedSetupFailure : public ::testing::TestWithParam<int> {};

TEST_P(SimulatedSetupFailure, AutoFallsBackToPosixAndUringReportsWhy) {
  IoEngineOptions options;
  options.simulate_uring_setup_errno = GetParam();
  auto fallback = make_io_engine(options);
  ASSERT_TRUE(fallback.ok()) << fallback.status().to_string();
  EXPECT_EQ((*fallback)->name(), "posix");

  options.kind = EngineKind::kUring;
  auto uring = make_io_engine(options);
  ASSERT_FALSE(uring.ok());
  EXPECT_EQ(uring.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(uring.status().message().find("io_uring_queue_init"), std::string::npos)
      << uring.status().to_string();
  EXPECT_NE(uring.status().message().find("kind=auto"), std::string::npos) << uring.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(Errnos, SimulatedSetupFailure, ::testing::Values(ENOSYS, EPERM, ENOMEM));

TEST(EngineSelection, PosixCanBeSelectedExplicitly) {
  auto engine = make_io_engine({.kind = EngineKind::kPosix});
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ((*engine)->name(), "posix");
}

// Installs a seccomp filter that fails io_uring_setup with `err`. Child only.
bool deny_io_uring_setup(int err) {
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<unsigned>(err) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  return ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
}

class RealSetupFailure : public ::testing::TestWithParam<int> {};

// Exit codes of the child: 0 ok, 10 no seccomp, 11 wrong engine, 12 I/O failed, 13 kUring did not fail.
TEST_P(RealSetupFailure, SeccompDeniedIoUringFallsBackToPosix) {
  TempDir dir;
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (!deny_io_uring_setup(GetParam())) ::_exit(10);
    auto engine = make_io_engine({});
    if (!engine.ok() || (*engine)->name() != "posix") ::_exit(11);
    int fd = open_file(dir.path() / "f", true);
    AlignedBuffer out(64 * 1024), back(64 * 1024);
    fill_random(out.all(), 5);
    auto file = (*engine)->register_file(fd, "f");
    if (fd < 0 || !file.ok()) ::_exit(12);
    if (!submit_and_wait(**engine, {IoOp::kWrite, *file, 0, out.all(), {}}).ok()) ::_exit(12);
    if (!submit_and_wait(**engine, {IoOp::kRead, *file, 0, back.all(), {}}).ok()) ::_exit(12);
    if (std::memcmp(out.data(), back.data(), out.size()) != 0) ::_exit(12);
    if (make_io_engine({.kind = EngineKind::kUring}).ok()) ::_exit(13);
    (*engine)->shutdown(ShutdownMode::kDrain);
    ::close(fd);
    ::_exit(0);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(pid, &wstatus, 0), pid);
  ASSERT_TRUE(WIFEXITED(wstatus)) << "child died; status " << wstatus;
  if (WEXITSTATUS(wstatus) == 10) GTEST_SKIP() << "seccomp filters cannot be installed here (prctl failed)";
  EXPECT_EQ(WEXITSTATUS(wstatus), 0) << "see the exit codes above the test";
}

INSTANTIATE_TEST_SUITE_P(Errnos, RealSetupFailure, ::testing::Values(ENOSYS, EPERM));

}  // namespace
}  // namespace strata::offload
