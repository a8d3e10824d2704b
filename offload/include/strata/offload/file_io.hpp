#pragma once
// Plain file I/O for files strata writes whole and reads back (checkpoints), beside
// the swap store's slots: a descriptor closed on scope exit, reads and writes that
// retry short transfers, durable publishing (fsync of a file and of its directory,
// rename), and striped writing with a CRC32C per stripe on a writer thread of its
// own (StripeSink, StripedWriter). Every failure names the path and the call; a file
// that ends before the bytes asked for is Corrupt. Thread-compatible, except
// StripeSink, which is thread-safe.

#include <sys/types.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "strata/common/status.hpp"

namespace strata::offload {

//! A file descriptor closed on scope exit.
class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd_, o.fd_);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();
  int get() const { return fd_; }
  //! Closes now and reports close's error (a delayed write error surfaces here).
  Status close(const std::filesystem::path& path);

 private:
  int fd_;
};

//! open(2) of `path` with `flags` (O_CLOEXEC added) and `mode`. The error (its code
//! from errno: NotFound, PermissionDenied, ...) says "<what> <path> (<hint>)", e.g.
//! what "save_checkpoint: creating", hint what to do; no parentheses when hint is empty.
Result<Fd> open_file(const std::filesystem::path& path, int flags, mode_t mode, std::string_view what,
                     std::string_view hint = {});
//! Reads n bytes at offset, retrying short reads; a file that ends first is Corrupt.
Status read_exact(int fd, std::byte* p, std::size_t n, std::uint64_t offset,
                  const std::filesystem::path& path);
//! Writes n bytes at offset, retrying short writes.
Status write_exact(int fd, const std::byte* p, std::size_t n, std::uint64_t offset, const std::string& path);
//! fsyncs the directory (a rename in it is durable once this returns).
Status fsync_dir(const std::filesystem::path& dir);
//! fsyncs the file.
Status fsync_file(int fd, const std::filesystem::path& path);
//! rename(2), naming both paths in the error.
Status rename_file(const std::filesystem::path& from, const std::filesystem::path& to);

//! Puts the calling thread's disk I/O in class idle (ioprio_set(2), IOPRIO_CLASS_IDLE):
//! it is served after every other class's (mq-deadline and bfq; none elsewhere).
//! Applies to this thread and to the threads it starts afterwards. Fails with the errno
//! (the caller decides whether it matters; a checkpoint save logs it and goes on).
Status set_thread_io_priority_idle();

//! The stripe a StripedWriter checksums, and the StripeSink's buffer size.
inline constexpr std::uint64_t kStripeBytes = std::uint64_t{1} << 20;

//! Writes stripes on a thread of its own, so a writer's reads and copies overlap its
//! file writes. Holds kSinkBuffers stripe buffers; take() blocks while all are in
//! flight, so its users hold at most that much memory beyond what they copy.
class StripeSink {
 public:
  //! `start_writeback`: each stripe's writeback starts as soon as it is written (its
  //! fsync then waits for little); else the stripes stay in the page cache until the
  //! fsync (a background writer's choice: Note [Save I/O priority] in runtime/checkpoint/save.cpp).
  explicit StripeSink(bool start_writeback = true);
  ~StripeSink();
  StripeSink(const StripeSink&) = delete;
  StripeSink& operator=(const StripeSink&) = delete;

  //! A stripe buffer; waits while kSinkBuffers stripes are being written. Buffers a
  //! writer holds part-filled do not count.
  std::vector<std::byte> take();
  //! Writes buf[0, n) at `offset` of *fd (kept open until the write is done).
  void submit(std::shared_ptr<Fd> fd, std::uint64_t offset, std::vector<std::byte> buf, std::size_t n,
              const std::filesystem::path& path);
  //! Waits until every submitted stripe is written; the first write error.
  Status drain();

 private:
  static constexpr std::size_t kSinkBuffers = 4;
  struct Job {
    std::shared_ptr<Fd> fd;
    std::uint64_t offset;
    std::vector<std::byte> buf;
    std::size_t n;
    std::string path;
  };
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  std::vector<std::vector<std::byte>> free_;
  int busy_ = 0;
  bool stop_ = false;
  Status error_ = Status::Ok();
  const bool start_writeback_;
  std::thread thread_;  // last: started once the rest is constructed
};

//! Writes a file under a temporary name (`<final>.tmp`, created by the caller) in
//! stripes through a StripeSink, with a CRC32C per stripe; sync() (after the sink
//! is drained) fsyncs and closes it and rename() gives it its final name.
class StripedWriter {
 public:
  //! The temporary name of `final_path`: `<final_path>.tmp`.
  static std::filesystem::path tmp_path(const std::filesystem::path& final_path);
  //! A writer of `fd`, open for writing on tmp_path(final_path).
  static StripedWriter adopt(std::filesystem::path final_path, Fd fd, StripeSink& sink);

  void append(const std::byte* p, std::size_t n);
  //! Hands the last stripe to the sink.
  void finish() {
    if (fill_ > 0) flush_stripe();
  }
  //! fsyncs and closes the file. The sink must be drained.
  Status sync();
  //! Renames the synced file to its final name.
  Status rename() { return rename_file(tmp_, final_); }

  //! Bytes appended so far (the next append's offset).
  std::uint64_t size() const { return bytes_ + fill_; }
  const std::vector<std::uint32_t>& crcs() const { return crcs_; }

 private:
  StripedWriter() = default;
  void flush_stripe();

  StripeSink* sink_ = nullptr;
  std::shared_ptr<Fd> fd_;  //!< shared with the sink's writes in flight
  std::filesystem::path final_, tmp_;
  std::vector<std::byte> buf_;
  std::size_t fill_ = 0;
  std::uint64_t bytes_ = 0;
  std::vector<std::uint32_t> crcs_;
};

}  // namespace strata::offload
