#pragma once
// Helpers for the offload tests: a temporary directory under $TMPDIR (or /tmp)
// removed at the end, aligned buffers from mmap, random bytes from a seed.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <string>

namespace strata::offload::testing {

//! True in a "threadsafe" death test's child: a new process that re-runs the test,
//! its fixture's SetUp included, and then dies without running destructors.
inline bool in_death_test_child() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string args((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return args.find("--gtest_internal_run_death_test") != std::string::npos;
}

//! A fresh directory, removed with its contents on destruction. A death test's
//! child makes its directory at a name its parent knows (the parent's pid), and
//! the parent's TempDir removes it too: the child dies before its destructor runs.
class TempDir {
 public:
  explicit TempDir(const std::string& base = "") {
    root_ = base;
    if (root_.empty()) {
      const char* env = std::getenv("TMPDIR");
      root_ = env != nullptr && *env != '\0' ? env : "/tmp";
    }
    if (in_death_test_child()) {
      static int made = 0;  // a fixture may hold several
      path_ = std::filesystem::path(root_) / (child_prefix(::getppid()) + std::to_string(made++));
      std::error_code ec;
      std::filesystem::create_directories(path_, ec);
      if (ec) ADD_FAILURE() << "mkdir " << path_ << ": " << ec.message();
      return;
    }
    std::string pattern = root_ + "/strata-offload-test-XXXXXX";
    char* made = ::mkdtemp(pattern.data());
    if (made == nullptr) ADD_FAILURE() << "mkdtemp in " << root_ << " failed";
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
    // What a death test's child of this process made (it died before its destructor ran).
    const std::string mine = child_prefix(::getpid());
    for (const auto& e : std::filesystem::directory_iterator(root_, ignored)) {
      if (e.path().filename().string().rfind(mine, 0) == 0) std::filesystem::remove_all(e.path(), ignored);
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  static std::string child_prefix(pid_t parent) {
    return "strata-offload-test-death-child-of-" + std::to_string(parent) + "-";
  }
  std::string root_;
  std::filesystem::path path_;
};

//! Page-aligned anonymous memory (mmap), unmapped on destruction.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(std::size_t bytes) : size_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      ADD_FAILURE() << "mmap of " << bytes << " bytes failed";
      p = nullptr;
      size_ = 0;
    }
    data_ = static_cast<std::byte*>(p);
  }
  ~AlignedBuffer() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::byte* data() { return data_; }
  std::size_t size() const { return size_; }
  std::span<std::byte> span(std::size_t offset, std::size_t bytes) { return {data_ + offset, bytes}; }
  std::span<std::byte> all() { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  std::size_t size_;
};

//! Fills `out` with bytes from a seeded generator.
inline void fill_random(std::span<std::byte> out, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::size_t i = 0;
  for (; i + 8 <= out.size(); i += 8) {
    std::uint64_t v = rng();
    std::memcpy(out.data() + i, &v, 8);
  }
  for (; i < out.size(); ++i) out[i] = static_cast<std::byte>(rng());
}

//! Opens (creating) `path` read-write, O_DIRECT when asked; -1 on failure.
inline int open_file(const std::filesystem::path& path, bool direct) {
  return ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | (direct ? O_DIRECT : 0), 0600);
}

//! A tmpfs of `bytes` mounted on a fresh directory under $TMPDIR: a small disk
//! without a loop device. Needs root (CAP_SYS_ADMIN); skip_reason() says why
//! none could be made. Unmounted (lazily) and removed on destruction.
class SmallTmpfs {
 public:
  explicit SmallTmpfs(std::uint64_t bytes) {
    if (::geteuid() != 0) {
      why_ = "mounting a small tmpfs needs root";
      return;
    }
    const std::string options = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, options.c_str()) != 0) {
      why_ = std::string("mount -t tmpfs failed: ") + std::strerror(errno);
      return;
    }
    mounted_ = true;
  }
  ~SmallTmpfs() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
  //! Empty when mounted.
  const std::string& skip_reason() const { return why_; }
  const std::filesystem::path& path() const { return dir_.path(); }

 private:
  TempDir dir_;
  bool mounted_ = false;
  std::string why_;
};

//! Flips the bits of `mask` in the byte at `offset` of the file at `path` (a corrupted file).
inline void flip_byte(const std::filesystem::path& path, std::streamoff offset, char mask = 0x10) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(f) << "opening " << path;
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ mask);
  f.seekp(offset);
  f.write(&c, 1);
}

}  // namespace strata::offload::testing
