#include "uring_engine.hpp"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::offload::detail {

// Note [Uring threading]
// One ring per engine and one reaper thread per ring, and only the reaper
// submits I/O: a submitting thread queues its request in the tracker and, unless
// one is already on its way, submits a NOP that wakes the reaper, which then
// prepares and submits the pieces. Why: io_uring completes a request's last
// step (task work) in the thread that submitted it; with user threads
// submitting, every completion had to wake that thread before the reaper could
// see it — measured 30-40 % slower reads under CPU contention than fio, whose one
// thread does both. Now completions run in the reaper, which is waiting inside
// io_uring_enter anyway, and the ring can use COOP_TASKRUN. `mutex_` serialises
// every SQ access (the reaper's and the wake NOPs) and the tracker. The reaper
// waits for completions without the lock (liburing allows one thread waiting on
// the CQ while another fills the SQ). Callbacks run on the reaper, outside the
// lock. At most queue_depth pieces are out, the SQ has room for them plus the
// wake, cancel and stop entries, and the CQ (twice the SQ) cannot overflow.
//
// Note [Measured defaults]
// request_bytes 4 MiB and queue_depth 32, measured with `strata-bench io` and fio
// on the development machine (virtio disk, ext4, kernel 6.18, 2 shared cores,
// run-to-run spread +-40 %):
// - piece size: in one session, 2 GiB, 4 MiB blocks, 8 in flight, medians of 3:
//   4 MiB pieces wrote 5.07 and read 3.09 GiB/s, 1 MiB pieces 4.33 and 2.65
//   (at the same bytes in flight); 256 KiB pieces were never better and cost 16x
//   the submissions. A 4 MiB chunk is then one request per device stripe.
// - depth: 2 pieces of 4 MiB (or 8 of 1 MiB) in flight read 0.9-1.5 GiB/s; 8 or
//   more of 4 MiB (32 of 1 MiB) reached the disk's speed; more gained nothing.
//   32 keeps smaller requests (stripes of small chunks) deep enough too; depth
//   only bounds, it reserves nothing but SQ entries.
// Re-measure on real NVMe: `strata-bench io --dir ... --qd N --request BYTES`.
//
// Note [One piece per submission]
// pump() submits each piece with its own io_uring_enter, as fio does with its
// default iodepth_batch_submit=1. Several SQEs in one enter run under a block
// plug, which merges pieces at adjacent offsets into one device request: four
// 256 KiB reads in flight reached this virtio disk as one 1 MiB request
// (/proc/diskstats: 1040 reads, 3071 merged, for 4096 pieces), all four
// completed together and the disk idled while the next four were prepared,
// so the queue depth the caller asked for was never at the device. Submitted
// one by one they stay 4096 requests, and the pipeline stays full. Measured
// with a stand-alone liburing loop, 1 GiB in 256 KiB blocks, 4 in flight,
// paired with fio run by run (medians of 8): batched reads 0.85x fio, one per
// enter 1.04x; writes 1.31x and 1.51x. strata-bench io at that point, the
// engine before and after, interleaved, 40 runs each paired with fio on
// huge pages (load 4-12): read 0.86x -> 1.01x, write 1.15x -> 1.27x (medians of
// the per-run ratios). The cost is one syscall per piece
// (4 MiB by default). Pieces larger than the device's max_sectors_kb cannot
// merge anyway, so the default 4 MiB / qd 8 point does not move.

namespace {
// user_data tags; Piece pointers are 8-byte aligned, so they never collide.
constexpr std::uint64_t kStopTag = 1;
constexpr std::uint64_t kCancelTag = 3;
constexpr std::uint64_t kWakeTag = 5;
constexpr std::uint64_t kFixedBufferPieceBytesMax = kGiB;
constexpr unsigned kCqeBatch = 64;
}  // namespace

Result<std::unique_ptr<IoEngine>> UringEngine::create(IoEngineOptions options) {
  STRATA_RETURN_IF_ERROR(validate_io_engine_options(options));
  std::unique_ptr<UringEngine> engine(new UringEngine(std::move(options)));
  STRATA_RETURN_IF_ERROR(engine->setup());
  {
    std::lock_guard lock(engine->mutex_);  // reaper_id_ is read under the lock
    engine->reaper_ = std::thread([e = engine.get()] { e->reaper_loop(); });
    engine->reaper_id_ = engine->reaper_.get_id();
  }
  return std::unique_ptr<IoEngine>(std::move(engine));
}

Status UringEngine::setup() {
  // Room for queue_depth pieces, a wake, a cancel and a stop entry.
  auto entries = static_cast<unsigned>(std::bit_ceil(options_.queue_depth + 3U));
  int rc = -options_.simulate_uring_setup_errno;
  if (rc == 0) {
    // COOP_TASKRUN (Linux 5.19): completions wait for the reaper's next kernel
    // entry instead of interrupting it; older kernels refuse the flag.
    rc = io_uring_queue_init(entries, &ring_, IORING_SETUP_COOP_TASKRUN);
    if (rc == -EINVAL) rc = io_uring_queue_init(entries, &ring_, 0);
  }
  if (rc < 0) {
    return errno_status(-rc, fmt::format("io_uring_queue_init({} entries){}", entries,
                                         options_.simulate_uring_setup_errno != 0 ? " [simulated]" : ""));
  }
  ring_ready_ = true;

  rc = io_uring_register_files_sparse(&ring_, options_.files_max);
  if (rc < 0) {
    STRATA_LOG_INFO("io_uring: registering a file table of {} failed ({}); using plain file descriptors",
                    options_.files_max, errno_status(-rc, "io_uring_register_files_sparse").message());
  } else {
    files_registered_ = true;
  }
  register_buffers();
  STRATA_LOG_DEBUG(
      "uring io engine: {} SQ entries, queue depth {}, pieces of {} bytes, {} fixed buffers, "
      "registered files {}",
      entries, options_.queue_depth, options_.request_bytes, regions_.size(), files_registered_);
  return Status::Ok();
}

void UringEngine::register_buffers() {
  if (options_.fixed_buffer_regions.empty()) return;
  std::vector<iovec> iovecs;
  for (auto region : options_.fixed_buffer_regions) {
    for (std::uint64_t at = 0; at < region.size(); at += kFixedBufferPieceBytesMax) {
      std::uint64_t length = std::min<std::uint64_t>(kFixedBufferPieceBytesMax, region.size() - at);
      iovecs.push_back(iovec{region.data() + at, length});
    }
  }
  int rc = io_uring_register_buffers(&ring_, iovecs.data(), static_cast<unsigned>(iovecs.size()));
  if (rc < 0) {
    STRATA_LOG_WARN(
        "io_uring: registering {} fixed buffers failed ({}); chunk I/O uses plain READ/WRITE "
        "(raise RLIMIT_MEMLOCK, `ulimit -l`, if this says ENOMEM)",
        iovecs.size(), errno_status(-rc, "io_uring_register_buffers").message());
    return;
  }
  for (std::size_t i = 0; i < iovecs.size(); ++i) {
    auto* begin = static_cast<const std::byte*>(iovecs[i].iov_base);
    regions_.push_back(Region{begin, begin + iovecs[i].iov_len, static_cast<int>(i)});
  }
  std::sort(regions_.begin(), regions_.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
}

int UringEngine::fixed_buffer_for(std::span<const std::byte> buffer) const {
  auto it = std::upper_bound(regions_.begin(), regions_.end(), buffer.data(),
                             [](const std::byte* p, const Region& r) { return p < r.begin; });
  if (it == regions_.begin()) return -1;
  --it;
  if (buffer.data() + buffer.size() > it->end) return -1;
  return it->index;
}

UringEngine::~UringEngine() {
  shutdown(ShutdownMode::kDrain);
  if (ring_ready_) io_uring_queue_exit(&ring_);
}

Result<FileId> UringEngine::register_file(int fd, std::string_view label) {
  std::lock_guard lock(mutex_);
  STRATA_ASSIGN_OR_RETURN(FileId file, files_.add(fd, label));
  if (files_registered_) {
    int rc = io_uring_register_files_update(&ring_, file, &fd, 1);
    if (rc < 0) {
      files_.remove(file);
      return errno_status(-rc, fmt::format("io_uring_register_files_update for {}", label));
    }
  }
  return file;
}

Status UringEngine::unregister_file(FileId file) {
  std::lock_guard lock(mutex_);
  if (!files_.valid(file)) return invalid_argument("file id {} is not registered", file);
  if (files_registered_) {
    int none = -1;
    int rc = io_uring_register_files_update(&ring_, file, &none, 1);
    if (rc < 0)
      return errno_status(-rc, fmt::format("io_uring_register_files_update removing {}", files_.label(file)));
  }
  files_.remove(file);
  return Status::Ok();
}

void UringEngine::prep_piece(Piece* piece) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  STRATA_CHECK(sqe != nullptr);  // Note [Uring threading]: the SQ has room for every piece
  int fd = files_registered_ ? static_cast<int>(piece->file) : piece->fd;
  auto offset = static_cast<__u64>(piece->offset_bytes);
  if (piece->op == IoOp::kRead) {
    if (piece->fixed_buffer >= 0) {
      io_uring_prep_read_fixed(sqe, fd, piece->data, piece->length_bytes, offset, piece->fixed_buffer);
    } else {
      io_uring_prep_read(sqe, fd, piece->data, piece->length_bytes, offset);
    }
  } else {
    if (piece->fixed_buffer >= 0) {
      io_uring_prep_write_fixed(sqe, fd, piece->data, piece->length_bytes, offset, piece->fixed_buffer);
    } else {
      io_uring_prep_write(sqe, fd, piece->data, piece->length_bytes, offset);
    }
  }
  if (files_registered_) sqe->flags |= IOSQE_FIXED_FILE;
  io_uring_sqe_set_data(sqe, piece);
}

void UringEngine::start_admitted() {
  // A callback submitting from the reaper needs no wake: the reaper pumps right
  // after its callbacks return.
  if (std::this_thread::get_id() != reaper_id_) wake_reaper();
}

void UringEngine::wake_reaper() {
  if (wake_pending_) return;  // the reaper pumps when that NOP completes
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  STRATA_CHECK(sqe != nullptr);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, kWakeTag);
  wake_pending_ = true;
  submit_ring();
}

void UringEngine::pump() {
  // One io_uring_enter per piece (Note [One piece per submission]).
  while (Piece* piece = tracker_.next_piece(files_)) {
    prep_piece(piece);
    submit_ring();
  }
  submit_ring();  // retries handle_cqe prepared
}

void UringEngine::submit_ring() {
  while (io_uring_sq_ready(&ring_) > 0) {
    int rc = io_uring_submit(&ring_);
    if (rc >= 0 || rc == -EINTR || rc == -EAGAIN || rc == -EBUSY) continue;
    // Per-request errors come back as CQEs; a failing io_uring_enter is a bug.
    STRATA_LOG_ERROR("io_uring_submit failed: {}", errno_status(-rc, "io_uring_enter").message());
    STRATA_CHECK_MSG(rc >= 0, "io_uring_submit failed");
  }
}

void UringEngine::reaper_loop() {
  std::vector<Completion> done;
  done.reserve(options_.requests_in_flight_max);
  io_uring_cqe* cqes[kCqeBatch];
  bool stop = false;
  while (!stop) {
    io_uring_cqe* first = nullptr;
    int rc = io_uring_wait_cqe(&ring_, &first);
    if (rc == -EINTR || rc == -EAGAIN) continue;
    STRATA_CHECK_MSG(rc == 0, "io_uring_wait_cqe failed");
    unsigned count = io_uring_peek_batch_cqe(&ring_, cqes, kCqeBatch);
    RequestTracker::Lock lock(mutex_);
    for (unsigned i = 0; i < count; ++i) handle_cqe(cqes[i], done, stop);
    io_uring_cq_advance(&ring_, count);
    pump();
    if (!done.empty()) {
      run_completions_unlocked(lock, done);
      pump();  // what the callbacks submitted
    }
  }
}

void UringEngine::handle_cqe(io_uring_cqe* cqe, std::vector<Completion>& done, bool& stop) {
  std::uint64_t tag = cqe->user_data;
  if (tag == kStopTag) {
    stop = true;
    return;
  }
  if (tag == kWakeTag) {
    wake_pending_ = false;  // the pump() after this batch takes what was queued
    return;
  }
  if (tag == kCancelTag) {
    STRATA_LOG_DEBUG("io_uring: cancel request finished with {}", cqe->res);
    return;
  }
  auto* piece = reinterpret_cast<Piece*>(tag);
  std::int64_t result = cqe->res;
  if (options_.result_filter) {
    result = options_.result_filter(IoSite{piece->op, piece->file, piece->offset_bytes, piece->length_bytes},
                                    result);
  }
  Status failure;
  switch (apply_transfer_result(*piece, result, files_, tracker_.stats, &failure)) {
    case PieceStep::kRetry:
      prep_piece(piece);
      return;
    case PieceStep::kDone:
      failure = Status::Ok();
      break;
    case PieceStep::kFailed:
      break;
  }
  if (auto completion = tracker_.finish_piece(piece, std::move(failure)))
    done.push_back(std::move(*completion));
}

void UringEngine::shutdown(ShutdownMode mode) {
  RequestTracker::Lock lock(mutex_);
  if (shut_down_ || !reaper_.joinable()) return;
  shut_down_ = true;
  tracker_.set_stopping();
  if (mode == ShutdownMode::kCancel) {
    std::vector<Completion> done = tracker_.cancel_unissued();
    if (tracker_.pieces_out() > 0) {
      // Pieces already at the device usually cannot be cancelled; those complete normally.
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      STRATA_CHECK(sqe != nullptr);
      io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
      io_uring_sqe_set_data64(sqe, kCancelTag);
      submit_ring();
    }
    run_completions_unlocked(lock, done);
  }
  tracker_.wait_idle(lock);
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  STRATA_CHECK(sqe != nullptr);
  io_uring_prep_nop(sqe);
  io_uring_sqe_set_data64(sqe, kStopTag);
  submit_ring();
  lock.unlock();
  reaper_.join();
}

}  // namespace strata::offload::detail
