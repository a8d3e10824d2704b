#pragma once
// PosixEngine: `queue_depth` threads each taking the next piece of the oldest
// request and moving it with pread/pwrite in a full-transfer loop (short
// transfers continue for the remainder, EINTR/EAGAIN retried). Fixed buffers
// mean nothing here; registered files are a table of fds.

#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine_base.hpp"

namespace strata::offload::detail {

class PosixEngine final : public EngineBase {
 public:
  //! Starts the workers. Options must be valid (validate_io_engine_options).
  static Result<std::unique_ptr<IoEngine>> create(IoEngineOptions options);
  ~PosixEngine() override;

  std::string_view name() const override { return "posix"; }
  Result<FileId> register_file(int fd, std::string_view label) override;
  Status unregister_file(FileId file) override;
  void shutdown(ShutdownMode mode) override;

 private:
  explicit PosixEngine(IoEngineOptions options) : EngineBase(std::move(options)) {}
  void start_admitted() override { work_cv_.notify_one(); }
  int fixed_buffer_for(std::span<const std::byte>) const override { return -1; }
  void worker_loop();
  //! Moves the whole piece; Ok or the failure.
  Status transfer(Piece piece);

  std::condition_variable work_cv_;
  std::vector<std::thread> workers_;
};

}  // namespace strata::offload::detail
