#pragma once
// IoEngine: asynchronous reads and writes of aligned spans at file offsets.
//
// Two implementations sit behind one factory (make_io_engine): UringEngine
// (io_uring, registered files, fixed buffers, one reaper thread per ring) and
// PosixEngine (a bounded pool of threads doing pread/pwrite). Callers never name
// the implementation's type; they pick a kind in IoEngineOptions or let the
// factory choose (Note [Engine fallback] in io_engine.cpp).
//
// Note [Completion contract]
// Every request accepted by submit() has its callback invoked exactly once, with
// Ok when all of its bytes were transferred, or with the first failure: IoError
// (EIO, unexpected end of file), NoSpace (ENOSPC, EFBIG), Cancelled (shutdown in
// cancel mode), ... The callback runs on an engine thread (the uring reaper, a
// posix worker), or on the submitting thread for a request that was still
// waiting for space when a shutdown began (it completes with Cancelled). A
// callback must be short and must not block on I/O of the same engine (it may
// post work elsewhere, or submit when it can be sure not to block); it must not
// throw. A request's slot is freed before its callback runs, so a callback may
// submit one new request per completed one without blocking (how a pipeline
// keeps the queue full without a thread in between). Short transfers, EINTR and EAGAIN are retried inside the
// engine for the remainder; the caller sees only whole transfers or a failure.
//
// Note [Bounded in flight]
// At most `requests_in_flight_max` requests are accepted and not yet completed
// (their callbacks counted as in flight until they return). submit() BLOCKS while
// the engine is full: back-pressure, never an unbounded queue. Inside the engine,
// each request is split into pieces of at most `request_bytes`, and at most
// `queue_depth` pieces are in the kernel (or in posix workers) at once.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/status.hpp"

namespace strata::offload {

//! Which way a request moves bytes.
enum class IoOp : std::uint8_t { kRead, kWrite };

//! Which implementation the factory builds.
enum class EngineKind : std::uint8_t {
  kAuto,   //!< io_uring; the posix engine when io_uring cannot be set up (logged)
  kUring,  //!< io_uring or an Unavailable error
  kPosix,  //!< thread pool of pread/pwrite
};

//! How shutdown() treats requests that have not completed.
enum class ShutdownMode : std::uint8_t {
  kDrain,   //!< wait for every accepted request to complete normally
  kCancel,  //!< drop unissued work and ask the kernel to cancel issued work; those complete with Cancelled
};

//! Index of a file registered with an engine.
using FileId = std::uint32_t;
inline constexpr FileId kInvalidFile = ~FileId{0};

//! Called once per request with its outcome (Note [Completion contract]). Must not throw.
using IoCallback = std::function<void(Status)>;

//! One read or write. `buffer` is owned by the caller and must stay valid (and,
//! for a write, unchanged) until the callback runs. Its address, length and
//! `offset_bytes` must be multiples of the engine's `alignment_bytes`.
struct IoRequest {
  IoOp op = IoOp::kRead;
  FileId file = kInvalidFile;
  std::uint64_t offset_bytes = 0;
  std::span<std::byte> buffer;
  IoCallback on_done;  //!< may be empty (the outcome is then dropped)
};

//! Where a result filter is applied: one system call's worth of one request.
struct IoSite {
  IoOp op;
  FileId file;
  std::uint64_t offset_bytes;
  std::uint64_t length_bytes;
};

//! Test hook (see FaultInjectingEngine): sees each transfer's raw result (bytes
//! moved, or -errno) and returns the result the engine should act on. It may
//! shorten a transfer (the engine resubmits the remainder), or turn it into
//! -EIO, -EINTR or -EAGAIN. Called on engine threads; must be thread-safe.
using IoResultFilter = std::function<std::int64_t(const IoSite& site, std::int64_t result)>;

//! Engine settings. queue_depth and request_bytes were chosen by measurement on
//! the development machine (virtio disk, ext4, kernel 6.18) with strata-bench io:
//! see Note [Measured defaults] in uring_engine.cpp.
struct IoEngineOptions {
  EngineKind kind = EngineKind::kAuto;
  //! Pieces in the kernel at once (io_uring SQ depth; posix: worker threads).
  std::uint32_t queue_depth = 32;
  //! Largest piece one request is split into; a multiple of alignment_bytes.
  std::uint32_t request_bytes = 4 * 1024 * 1024;
  //! Requests accepted and not yet completed; submit() blocks beyond it.
  std::uint32_t requests_in_flight_max = 256;
  //! Registered files at most (io_uring's registered file table).
  std::uint32_t files_max = 64;
  //! Address, length and offset granularity (4096 for O_DIRECT on any device;
  //! 1 allows any, for buffered files only).
  std::uint32_t alignment_bytes = 4096;
  //! Caller memory to register as io_uring fixed buffers (each split into
  //! pieces of at most 1 GiB). Must outlive the engine. Requests whose buffer
  //! lies inside one use READ_FIXED/WRITE_FIXED; others plain READ/WRITE.
  std::vector<std::span<std::byte>> fixed_buffer_regions;
  //! Test hook: pretend io_uring_queue_init failed with this errno (0: off).
  int simulate_uring_setup_errno = 0;
  //! Test hook: see IoResultFilter (empty: off).
  IoResultFilter result_filter;
};

//! Counters since creation. A snapshot; thread-safe to read.
struct IoEngineStats {
  std::uint64_t requests_completed = 0;
  std::uint64_t pieces_submitted = 0;
  std::uint64_t fixed_buffer_pieces = 0;  //!< pieces issued as READ_FIXED/WRITE_FIXED
  std::uint64_t short_transfers_retried = 0;
  std::uint64_t eagain_eintr_retried = 0;
};

//! An asynchronous block I/O engine (Note [Completion contract]). All methods
//! are thread-safe. Destruction performs shutdown(kDrain) if not done yet.
class IoEngine {
 public:
  virtual ~IoEngine() = default;

  //! "uring" or "posix" (or "faulty(<inner>)"). Never fails.
  virtual std::string_view name() const = 0;

  //! The options in effect (after validation and fallbacks).
  virtual const IoEngineOptions& options() const = 0;

  //! Registers an open file; `label` (its path) names it in error messages. The
  //! fd stays owned by the caller and must stay open until unregister_file().
  //! Fails with OutOfBudget when files_max are registered, or IoError from the
  //! kernel's file table.
  virtual Result<FileId> register_file(int fd, std::string_view label) = 0;

  //! Forgets a registered file. No request on it may be in flight (programmer error).
  virtual Status unregister_file(FileId file) = 0;

  //! Accepts a batch of requests (Note [Bounded in flight]: blocks while full).
  //! Fails, with no callback invoked, when a request is invalid (misaligned:
  //! an assertion in checked builds; unregistered file; empty buffer), or with
  //! FailedPrecondition when the engine is shut down. Otherwise every callback
  //! will run exactly once.
  virtual Status submit(std::span<IoRequest> batch) = 0;

  //! Stops accepting requests, drains or cancels what is in flight, waits until
  //! every callback has returned, and stops the engine's threads. Blocks.
  //! Idempotent; must not be called from a callback.
  virtual void shutdown(ShutdownMode mode) = 0;

  //! Counters (for tests and benchmarks).
  virtual IoEngineStats stats() const = 0;

  //! Convenience: submit one request.
  Status submit_one(IoRequest request) { return submit(std::span<IoRequest>(&request, 1)); }
};

//! Builds the engine `options.kind` asks for. With kAuto, an io_uring setup
//! failure (ENOSYS, EPERM, ENOMEM, ...) falls back to the posix engine and the
//! log says why. Fails with InvalidArgument naming the setting for a bad option,
//! or Unavailable when kUring was asked for and io_uring cannot be set up.
Result<std::unique_ptr<IoEngine>> make_io_engine(IoEngineOptions options);

//! Checks the options alone (no system calls). InvalidArgument names the setting.
Status validate_io_engine_options(const IoEngineOptions& options);

//! Waits for a set of requests: hand each request `group.add()` as its callback,
//! then wait(). Not movable; must outlive its callbacks (wait() guarantees that).
//! add() and wait() from any thread; wait() blocks.
class IoGroup {
 public:
  IoGroup() = default;
  IoGroup(const IoGroup&) = delete;
  IoGroup& operator=(const IoGroup&) = delete;
  ~IoGroup();

  //! A callback that must be invoked exactly once (or discarded with cancel_one()).
  IoCallback add();
  //! Takes back one add() whose callback will never run (its submit failed).
  void cancel_one();
  //! Blocks until every added callback has run; returns the first failure.
  Status wait();

 private:
  void done(Status status);
  std::mutex mutex_;
  std::condition_variable cv_;
  std::uint64_t pending_ = 0;
  Status first_failure_;
};

//! Submits one request and returns a future of its outcome. A failed submit is
//! returned through the future.
std::future<Status> submit_future(IoEngine& engine, IoRequest request);

//! Calls start(callback); when it returns Ok, blocks until the callback ran and
//! returns its status; otherwise returns start's failure (the callback is then
//! never run, per Note [Completion contract]).
Status start_and_wait(const std::function<Status(IoCallback)>& start);

//! Submits one request and waits for it. Blocks.
Status submit_and_wait(IoEngine& engine, IoRequest request);

}  // namespace strata::offload
