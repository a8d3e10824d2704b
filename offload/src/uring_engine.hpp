#pragma once
// UringEngine: one io_uring, one reaper thread (Note [Uring threading] in
// uring_engine.cpp), registered files, caller regions as fixed buffers.

#include <liburing.h>

#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine_base.hpp"

namespace strata::offload::detail {

class UringEngine final : public EngineBase {
 public:
  //! Sets up the ring, registers the file table and the fixed buffers, starts
  //! the reaper. Fails with the errno Status of io_uring_queue_init (ENOSYS:
  //! Unavailable, EPERM: PermissionDenied, ENOMEM: OutOfMemory); failing to
  //! register buffers or files is logged and the engine runs without them.
  static Result<std::unique_ptr<IoEngine>> create(IoEngineOptions options);
  ~UringEngine() override;

  std::string_view name() const override { return "uring"; }
  Result<FileId> register_file(int fd, std::string_view label) override;
  Status unregister_file(FileId file) override;
  void shutdown(ShutdownMode mode) override;

 private:
  struct Region {
    const std::byte* begin;
    const std::byte* end;
    int index;
  };

  explicit UringEngine(IoEngineOptions options) : EngineBase(std::move(options)) {}
  void start_admitted() override;
  int fixed_buffer_for(std::span<const std::byte> buffer) const override;
  Status setup();
  void register_buffers();
  void reaper_loop();
  void handle_cqe(io_uring_cqe* cqe, std::vector<Completion>& done, bool& stop);
  void prep_piece(Piece* piece);
  //! Prepares SQEs for every piece the tracker can hand out and submits. Lock held.
  void pump();
  //! Lock held: makes the reaper pump soon (Note [Uring threading]).
  void wake_reaper();
  void submit_ring();

  io_uring ring_{};
  bool ring_ready_ = false;
  bool files_registered_ = false;
  std::vector<Region> regions_;  // sorted by begin
  std::thread reaper_;
  std::thread::id reaper_id_;
  bool wake_pending_ = false;  // a wake NOP is in the ring
};

}  // namespace strata::offload::detail
