#pragma once
// RequestTracker: the bookkeeping both engines share — a fixed pool of request
// slots (Note [Bounded in flight] in io_engine.hpp), the FIFO of requests whose
// pieces are not all issued, a fixed pool of piece slots (one per piece in the
// kernel), and the file table. Not thread-safe by itself: the owning engine holds
// one mutex around every call (the `lock` arguments make that visible).

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "strata/offload/io_engine.hpp"

namespace strata::offload::detail {

//! A piece of a request: one system call's worth. Owned by the tracker; its
//! address is stable while it is in flight (io_uring's user_data points at it).
struct Piece {
  std::uint32_t request = 0;  //!< request slot index
  IoOp op = IoOp::kRead;
  FileId file = kInvalidFile;
  int fd = -1;
  int fixed_buffer = -1;  //!< io_uring fixed buffer index, or -1
  std::uint64_t offset_bytes = 0;
  std::byte* data = nullptr;
  std::uint32_t length_bytes = 0;
  std::uint32_t retries = 0;  //!< EINTR/EAGAIN/zero-progress retries so far
};

//! A callback ready to run (outside the engine's lock).
struct Completion {
  IoCallback callback;
  Status status;
};

//! Registered files: fd and a label (path) per FileId.
class FileTable {
 public:
  explicit FileTable(std::uint32_t files_max) : fds_(files_max, -1), labels_(files_max) {}
  //! First free index, or OutOfBudget naming files_max.
  Result<FileId> add(int fd, std::string_view label);
  void remove(FileId file);
  bool valid(FileId file) const { return file < fds_.size() && fds_[file] >= 0; }
  int fd(FileId file) const { return fds_[file]; }
  const std::string& label(FileId file) const { return labels_[file]; }

 private:
  std::vector<int> fds_;
  std::vector<std::string> labels_;
};

class RequestTracker {
 public:
  using Lock = std::unique_lock<std::mutex>;

  //! `pieces_max` pieces may be out at once; pieces are at most `piece_bytes_max`.
  RequestTracker(std::uint32_t requests_max, std::uint32_t pieces_max, std::uint32_t piece_bytes_max);

  //! Waits (on `lock`) for a free request slot and queues the request; returns
  //! false without taking it when stopping() became true while waiting.
  bool admit(Lock& lock, IoRequest& request, int fixed_buffer);

  //! A free piece slot filled with the next piece of the oldest request with
  //! unissued bytes, or nullptr when there is none or no free piece slot.
  Piece* next_piece(const FileTable& files);

  //! The piece has finished (status Ok: all its bytes moved). Frees the piece
  //! slot; returns the request's completion when this was its last piece.
  std::optional<Completion> finish_piece(Piece* piece, Status status);

  //! Drops every request's unissued bytes (they complete with Cancelled); returns
  //! completions of requests with no piece out.
  std::vector<Completion> cancel_unissued();

  //! Every Completion handed out counts as running until this is called for
  //! it, after its callback returned (so idle() waits for callbacks too).
  void callbacks_finished(std::size_t count);

  void set_stopping() {
    stopping_ = true;
    space_cv_.notify_all();
  }
  bool stopping() const { return stopping_; }
  //! No request accepted and uncompleted, and no callback running.
  bool idle() const { return requests_in_use_ == 0 && callbacks_running_ == 0; }
  void wait_idle(Lock& lock) {
    idle_cv_.wait(lock, [&] { return idle(); });
  }
  bool has_unissued() const { return pending_count_ > 0; }
  std::uint32_t pieces_out() const { return pieces_out_; }

  //! Stats kept under the engine lock.
  IoEngineStats stats;

 private:
  struct Slot {
    IoRequest request;
    std::uint64_t issued_bytes = 0;
    std::uint32_t pieces_out = 0;
    int fixed_buffer = -1;
    Status status;
    bool in_use = false;
  };
  Completion release_slot(std::uint32_t index);

  std::vector<Slot> slots_;
  std::vector<std::uint32_t> free_slots_;
  std::vector<std::uint32_t> pending_;  // ring buffer of slot indices, capacity = slots
  std::uint32_t pending_head_ = 0;
  std::uint32_t pending_count_ = 0;
  std::vector<Piece> pieces_;
  std::vector<Piece*> free_pieces_;
  std::uint32_t pieces_out_ = 0;
  std::uint32_t piece_bytes_max_;
  std::uint32_t requests_in_use_ = 0;
  std::size_t callbacks_running_ = 0;
  bool stopping_ = false;
  std::condition_variable space_cv_;
  std::condition_variable idle_cv_;
};

//! Runs completions (outside any lock).
void run_completions(std::vector<Completion>& completions);

//! Validates one request against the options and file table: InvalidArgument
//! (and an assertion in checked builds for misalignment).
Status validate_request(const IoRequest& request, const IoEngineOptions& options, const FileTable& files);

//! Outcome of one transfer attempt of a piece, as both engines interpret it.
enum class PieceStep : std::uint8_t { kDone, kRetry, kFailed };

//! Applies the result of one transfer (bytes moved, or -errno) to `piece`:
//! advances it on a short transfer (kRetry with the remainder), counts an
//! EINTR/EAGAIN (kRetry), or sets `*failure` (kFailed) naming the file and offset.
PieceStep apply_transfer_result(Piece& piece, std::int64_t result, const FileTable& files,
                                IoEngineStats& stats, Status* failure);

}  // namespace strata::offload::detail
