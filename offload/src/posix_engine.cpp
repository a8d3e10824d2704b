#include "posix_engine.hpp"

#include <unistd.h>

#include <cerrno>

#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::offload::detail {

Result<std::unique_ptr<IoEngine>> PosixEngine::create(IoEngineOptions options) {
  STRATA_RETURN_IF_ERROR(validate_io_engine_options(options));
  std::unique_ptr<PosixEngine> engine(new PosixEngine(std::move(options)));
  engine->workers_.reserve(engine->options_.queue_depth);
  for (std::uint32_t i = 0; i < engine->options_.queue_depth; ++i) {
    engine->workers_.emplace_back([e = engine.get()] { e->worker_loop(); });
  }
  STRATA_LOG_DEBUG("posix io engine: {} threads, pieces of {} bytes, {} requests in flight at most",
                   engine->options_.queue_depth, engine->options_.request_bytes,
                   engine->options_.requests_in_flight_max);
  return std::unique_ptr<IoEngine>(std::move(engine));
}

PosixEngine::~PosixEngine() {
  shutdown(ShutdownMode::kDrain);
}

Result<FileId> PosixEngine::register_file(int fd, std::string_view label) {
  std::lock_guard lock(mutex_);
  return files_.add(fd, label);
}

Status PosixEngine::unregister_file(FileId file) {
  std::lock_guard lock(mutex_);
  if (!files_.valid(file)) return invalid_argument("file id {} is not registered", file);
  files_.remove(file);
  return Status::Ok();
}

void PosixEngine::worker_loop() {
  std::vector<Completion> done;
  done.reserve(1);  // one completion at a time: no allocation on a worker's first one
  RequestTracker::Lock lock(mutex_);
  for (;;) {
    Piece* piece = nullptr;
    work_cv_.wait(lock, [&] {
      piece = tracker_.next_piece(files_);
      return piece != nullptr || (tracker_.stopping() && !tracker_.has_unissued());
    });
    if (piece == nullptr) return;
    if (tracker_.has_unissued()) work_cv_.notify_one();  // a long request feeds several workers
    Piece copy = *piece;
    lock.unlock();
    Status status = transfer(copy);
    lock.lock();
    if (auto completion = tracker_.finish_piece(piece, std::move(status))) {
      done.push_back(std::move(*completion));
      run_completions_unlocked(lock, done);
    }
  }
}

Status PosixEngine::transfer(Piece piece) {
  for (;;) {
    ssize_t n =
        piece.op == IoOp::kRead
            ? ::pread(piece.fd, piece.data, piece.length_bytes, static_cast<off_t>(piece.offset_bytes))
            : ::pwrite(piece.fd, piece.data, piece.length_bytes, static_cast<off_t>(piece.offset_bytes));
    std::int64_t result = n < 0 ? -static_cast<std::int64_t>(errno) : n;
    if (options_.result_filter) {
      result = options_.result_filter(IoSite{piece.op, piece.file, piece.offset_bytes, piece.length_bytes},
                                      result);
    }
    Status failure;
    IoEngineStats local;
    PieceStep step = apply_transfer_result(piece, result, files_, local, &failure);
    if (local.short_transfers_retried + local.eagain_eintr_retried > 0) {
      std::lock_guard lock(mutex_);
      tracker_.stats.short_transfers_retried += local.short_transfers_retried;
      tracker_.stats.eagain_eintr_retried += local.eagain_eintr_retried;
    }
    if (step == PieceStep::kDone) return Status::Ok();
    if (step == PieceStep::kFailed) return failure;
  }
}

void PosixEngine::shutdown(ShutdownMode mode) {
  RequestTracker::Lock lock(mutex_);
  if (shut_down_) return;
  shut_down_ = true;
  tracker_.set_stopping();
  if (mode == ShutdownMode::kCancel) {
    std::vector<Completion> done = tracker_.cancel_unissued();
    run_completions_unlocked(lock, done);
  }
  work_cv_.notify_all();
  tracker_.wait_idle(lock);
  lock.unlock();
  for (auto& worker : workers_) worker.join();
  workers_.clear();
}

}  // namespace strata::offload::detail
