#include "request_tracker.hpp"

#include <algorithm>
#include <cerrno>

#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::offload::detail {

namespace {
// A transfer that makes no progress (EINTR, EAGAIN, a zero-byte write) is retried
// this many times before the request fails: a bound, not a spin forever.
constexpr std::uint32_t kRetriesMax = 1000;
}  // namespace

Result<FileId> FileTable::add(int fd, std::string_view label) {
  STRATA_CHECK(fd >= 0);
  auto it = std::find(fds_.begin(), fds_.end(), -1);
  if (it == fds_.end()) {
    return out_of_budget("cannot register {}: all {} io engine file slots are in use; raise files_max", label,
                         fds_.size());
  }
  auto index = static_cast<FileId>(it - fds_.begin());
  fds_[index] = fd;
  labels_[index] = std::string(label);
  return index;
}

void FileTable::remove(FileId file) {
  STRATA_CHECK(valid(file));
  fds_[file] = -1;
  labels_[file].clear();
}

RequestTracker::RequestTracker(std::uint32_t requests_max, std::uint32_t pieces_max,
                               std::uint32_t piece_bytes_max)
    : slots_(requests_max), pending_(requests_max), pieces_(pieces_max), piece_bytes_max_(piece_bytes_max) {
  STRATA_CHECK(requests_max > 0);
  STRATA_CHECK(pieces_max > 0);
  STRATA_CHECK(piece_bytes_max > 0);
  free_slots_.reserve(requests_max);
  for (std::uint32_t i = requests_max; i-- > 0;) free_slots_.push_back(i);
  free_pieces_.reserve(pieces_max);
  for (auto& piece : pieces_) free_pieces_.push_back(&piece);
}

bool RequestTracker::admit(Lock& lock, IoRequest& request, int fixed_buffer) {
  space_cv_.wait(lock, [&] { return stopping_ || !free_slots_.empty(); });
  if (stopping_) return false;
  std::uint32_t index = free_slots_.back();
  free_slots_.pop_back();
  Slot& slot = slots_[index];
  STRATA_ASSERT(!slot.in_use);
  slot.request = std::move(request);
  slot.issued_bytes = 0;
  slot.pieces_out = 0;
  slot.fixed_buffer = fixed_buffer;
  slot.status = Status::Ok();
  slot.in_use = true;
  ++requests_in_use_;
  STRATA_ASSERT(pending_count_ < pending_.size());
  pending_[(pending_head_ + pending_count_) % pending_.size()] = index;
  ++pending_count_;
  return true;
}

Piece* RequestTracker::next_piece(const FileTable& files) {
  if (pending_count_ == 0 || free_pieces_.empty()) return nullptr;
  std::uint32_t index = pending_[pending_head_];
  Slot& slot = slots_[index];
  const IoRequest& request = slot.request;
  std::uint64_t size = request.buffer.size();
  STRATA_ASSERT(slot.issued_bytes < size);
  auto length =
      static_cast<std::uint32_t>(std::min<std::uint64_t>(piece_bytes_max_, size - slot.issued_bytes));

  Piece* piece = free_pieces_.back();
  free_pieces_.pop_back();
  *piece = Piece{.request = index,
                 .op = request.op,
                 .file = request.file,
                 .fd = files.fd(request.file),
                 .fixed_buffer = slot.fixed_buffer,
                 .offset_bytes = request.offset_bytes + slot.issued_bytes,
                 .data = request.buffer.data() + slot.issued_bytes,
                 .length_bytes = length,
                 .retries = 0};
  slot.issued_bytes += length;
  ++slot.pieces_out;
  ++pieces_out_;
  ++stats.pieces_submitted;
  if (slot.fixed_buffer >= 0) ++stats.fixed_buffer_pieces;
  if (slot.issued_bytes == size) {
    pending_head_ = (pending_head_ + 1) % pending_.size();
    --pending_count_;
  }
  return piece;
}

std::optional<Completion> RequestTracker::finish_piece(Piece* piece, Status status) {
  Slot& slot = slots_[piece->request];
  STRATA_ASSERT(slot.in_use);
  STRATA_ASSERT(slot.pieces_out > 0);
  if (!status.ok() && slot.status.ok()) slot.status = std::move(status);
  --slot.pieces_out;
  --pieces_out_;
  free_pieces_.push_back(piece);
  if (slot.pieces_out > 0 || slot.issued_bytes < slot.request.buffer.size()) return std::nullopt;
  return release_slot(piece->request);
}

std::vector<Completion> RequestTracker::cancel_unissued() {
  std::vector<Completion> done;
  for (; pending_count_ > 0; --pending_count_) {
    std::uint32_t index = pending_[pending_head_];
    pending_head_ = (pending_head_ + 1) % pending_.size();
    Slot& slot = slots_[index];
    if (slot.status.ok()) {
      slot.status =
          cancelled("{} of {} bytes at offset {} not issued: the engine was shut down in cancel mode",
                    slot.request.buffer.size() - slot.issued_bytes, slot.request.buffer.size(),
                    slot.request.offset_bytes);
    }
    slot.issued_bytes = slot.request.buffer.size();
    if (slot.pieces_out == 0) done.push_back(release_slot(index));
  }
  return done;
}

Completion RequestTracker::release_slot(std::uint32_t index) {
  Slot& slot = slots_[index];
  Completion completion{std::move(slot.request.on_done), std::move(slot.status)};
  slot.request = IoRequest{};
  slot.in_use = false;
  free_slots_.push_back(index);
  --requests_in_use_;
  ++stats.requests_completed;
  ++callbacks_running_;  // until callbacks_finished(); keeps idle() false meanwhile
  space_cv_.notify_one();
  return completion;
}

void RequestTracker::callbacks_finished(std::size_t count) {
  STRATA_ASSERT(callbacks_running_ >= count);
  callbacks_running_ -= count;
  if (idle()) idle_cv_.notify_all();
}

void run_completions(std::vector<Completion>& completions) {
  for (auto& completion : completions) {
    if (completion.callback) completion.callback(std::move(completion.status));
  }
  completions.clear();
}

Status validate_request(const IoRequest& request, const IoEngineOptions& options, const FileTable& files) {
  const std::uint64_t alignment = options.alignment_bytes;
  const auto address = reinterpret_cast<std::uintptr_t>(request.buffer.data());
  // Note [Misaligned requests]: a misaligned request is a programmer error, so
  // checked builds stop at the assertion; release builds return the Status so a
  // caller's bug cannot turn into an EINVAL deep inside the kernel path.
  STRATA_ASSERT(address % alignment == 0);
  STRATA_ASSERT(request.offset_bytes % alignment == 0);
  STRATA_ASSERT(request.buffer.size() % alignment == 0);
  if (address % alignment != 0 || request.offset_bytes % alignment != 0 ||
      request.buffer.size() % alignment != 0) {
    return invalid_argument(
        "misaligned I/O request: buffer {} ({} bytes) at file offset {}: address, length and offset must be "
        "multiples of alignment_bytes={}",
        static_cast<const void*>(request.buffer.data()), request.buffer.size(), request.offset_bytes,
        alignment);
  }
  if (request.buffer.empty())
    return invalid_argument("empty I/O request at file offset {}", request.offset_bytes);
  if (!files.valid(request.file)) {
    return invalid_argument("I/O request names file id {}, which is not registered with the engine",
                            request.file);
  }
  return Status::Ok();
}

PieceStep apply_transfer_result(Piece& piece, std::int64_t result, const FileTable& files,
                                IoEngineStats& stats, Status* failure) {
  const char* verb = piece.op == IoOp::kRead ? "read" : "write";
  if (result < 0) {
    int err = static_cast<int>(-result);
    if ((err == EINTR || err == EAGAIN) && piece.retries < kRetriesMax) {
      ++piece.retries;
      ++stats.eagain_eintr_retried;
      return PieceStep::kRetry;
    }
    if (err == ECANCELED) {
      *failure = cancelled("{} of {} bytes at offset {} of {} cancelled by engine shutdown", verb,
                           piece.length_bytes, piece.offset_bytes, files.label(piece.file));
      return PieceStep::kFailed;
    }
    *failure = errno_status(err, fmt::format("{} of {} bytes at offset {} of {}", verb, piece.length_bytes,
                                             piece.offset_bytes, files.label(piece.file)));
    return PieceStep::kFailed;
  }
  auto moved = static_cast<std::uint64_t>(result);
  STRATA_CHECK(moved <= piece.length_bytes);
  if (moved == piece.length_bytes) return PieceStep::kDone;
  if (moved == 0) {
    if (piece.op == IoOp::kRead) {
      *failure = io_error(
          "unexpected end of file reading {} bytes at offset {} of {}: the file is shorter than "
          "strata wrote it (truncated behind strata's back?)",
          piece.length_bytes, piece.offset_bytes, files.label(piece.file));
      return PieceStep::kFailed;
    }
    if (++piece.retries > kRetriesMax) {
      *failure = io_error("write of {} bytes at offset {} of {} makes no progress after {} attempts",
                          piece.length_bytes, piece.offset_bytes, files.label(piece.file), kRetriesMax);
      return PieceStep::kFailed;
    }
    return PieceStep::kRetry;
  }
  // Short transfer: resubmit the remainder.
  piece.offset_bytes += moved;
  piece.data += moved;
  piece.length_bytes -= static_cast<std::uint32_t>(moved);
  ++stats.short_transfers_retried;
  return PieceStep::kRetry;
}

}  // namespace strata::offload::detail
