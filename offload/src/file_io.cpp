// Plain file I/O for whole files; see strata/offload/file_io.hpp.
#include "strata/offload/file_io.hpp"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "strata/common/log.hpp"
#include "strata/offload/crc32c.hpp"

namespace strata::offload {

namespace fs = std::filesystem;

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Status Fd::close(const fs::path& path) {
  const int fd = fd_;
  fd_ = -1;
  if (fd >= 0 && ::close(fd) != 0) return errno_status(errno, fmt::format("closing {}", path.string()));
  return Status::Ok();
}

Result<Fd> open_file(const fs::path& path, int flags, mode_t mode, std::string_view what,
                     std::string_view hint) {
  Fd fd(::open(path.c_str(), flags | O_CLOEXEC, mode));
  if (fd.get() < 0) {
    const int e = errno;
    if (hint.empty()) return errno_status(e, fmt::format("{} {}", what, path.string()));
    return errno_status(e, fmt::format("{} {} ({})", what, path.string(), hint));
  }
  return fd;
}

Status read_exact(int fd, std::byte* p, std::size_t n, std::uint64_t offset, const fs::path& path) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, fmt::format("reading {}", path.string()));
    }
    if (r == 0) return corrupt("{}: ends at byte {}, before the data expected there", path.string(), offset);
    p += r;
    offset += static_cast<std::uint64_t>(r);
    n -= static_cast<std::size_t>(r);
  }
  return Status::Ok();
}

Status write_exact(int fd, const std::byte* p, std::size_t n, std::uint64_t offset, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, fmt::format("writing {}", path));
    }
    p += w;
    offset += static_cast<std::uint64_t>(w);
    n -= static_cast<std::size_t>(w);
  }
  return Status::Ok();
}

Status fsync_dir(const fs::path& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return errno_status(errno, fmt::format("opening directory {} to fsync it", dir.string()));
  if (::fsync(fd.get()) != 0) return errno_status(errno, fmt::format("fsync of directory {}", dir.string()));
  return fd.close(dir);
}

Status fsync_file(int fd, const fs::path& path) {
  if (::fsync(fd) != 0) return errno_status(errno, fmt::format("fsync of {}", path.string()));
  return Status::Ok();
}

Status rename_file(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    return errno_status(errno, fmt::format("renaming {} to {}", from.string(), to.string()));
  return Status::Ok();
}

Status set_thread_io_priority_idle() {
  constexpr int kIoprioWhoProcess = 1;  // IOPRIO_WHO_PROCESS: with a thread id, that thread
  constexpr int kIoprioClassIdle = 3;   // IOPRIO_CLASS_IDLE
  constexpr int kIoprioClassShift = 13;
  if (::syscall(SYS_ioprio_set, kIoprioWhoProcess, ::gettid(), kIoprioClassIdle << kIoprioClassShift) != 0)
    return errno_status(errno, "ioprio_set(IOPRIO_CLASS_IDLE) of this thread");
  return Status::Ok();
}

StripeSink::StripeSink(bool start_writeback) : start_writeback_(start_writeback), thread_([this] { run(); }) {
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < kSinkBuffers; ++i) free_.emplace_back(kStripeBytes);
}

StripeSink::~StripeSink() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::vector<std::byte> StripeSink::take() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return jobs_.size() + static_cast<std::size_t>(busy_) < kSinkBuffers; });
  if (free_.empty()) return std::vector<std::byte>(kStripeBytes);
  std::vector<std::byte> b = std::move(free_.back());
  free_.pop_back();
  return b;
}

void StripeSink::submit(std::shared_ptr<Fd> fd, std::uint64_t offset, std::vector<std::byte> buf,
                        std::size_t n, const fs::path& path) {
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(Job{std::move(fd), offset, std::move(buf), n, path.string()});
  }
  cv_.notify_all();
}

Status StripeSink::drain() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return jobs_.empty() && busy_ == 0; });
  return error_;
}

void StripeSink::run() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    ++busy_;
    const bool failed = !error_.ok();
    lock.unlock();
    Status st = Status::Ok();
    if (!failed) {
      st = write_exact(job.fd->get(), job.buf.data(), job.n, job.offset, job.path);
      // Starts the stripe's writeback now (a hint: errors show at fsync), so the
      // final fsync waits for little.
      if (start_writeback_)
        ::sync_file_range(job.fd->get(), static_cast<off_t>(job.offset), static_cast<off_t>(job.n),
                          SYNC_FILE_RANGE_WRITE);
    }
    lock.lock();
    if (!st.ok() && error_.ok()) error_ = st;
    if (free_.size() < kSinkBuffers) free_.push_back(std::move(job.buf));
    job.buf = {};
    job.fd.reset();
    --busy_;
    cv_.notify_all();
  }
}

fs::path StripedWriter::tmp_path(const fs::path& final_path) {
  fs::path tmp = final_path;
  tmp += ".tmp";
  return tmp;
}

StripedWriter StripedWriter::adopt(fs::path final_path, Fd fd, StripeSink& sink) {
  StripedWriter w;
  w.sink_ = &sink;
  w.fd_ = std::make_shared<Fd>(std::move(fd));
  w.tmp_ = tmp_path(final_path);
  w.final_ = std::move(final_path);
  return w;
}

void StripedWriter::append(const std::byte* p, std::size_t n) {
  while (n > 0) {
    if (buf_.empty()) buf_ = sink_->take();
    const std::size_t take = std::min<std::size_t>(n, kStripeBytes - fill_);
    std::memcpy(buf_.data() + fill_, p, take);
    fill_ += take;
    p += take;
    n -= take;
    if (fill_ == kStripeBytes) flush_stripe();
  }
}

Status StripedWriter::sync() {
  STRATA_RETURN_IF_ERROR(fsync_file(fd_->get(), tmp_));
  return fd_->close(tmp_);
}

void StripedWriter::flush_stripe() {
  crcs_.push_back(crc32c(std::span<const std::byte>(buf_.data(), fill_)));
  sink_->submit(fd_, bytes_, std::move(buf_), fill_, tmp_);
  buf_ = {};
  bytes_ += fill_;
  fill_ = 0;
}

}  // namespace strata::offload
