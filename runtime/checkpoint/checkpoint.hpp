#pragma once
// Checkpoint (private to runtime/checkpoint/; README.md there): what the checkpoint
// files share. The format side (format.cpp: manifest, data file layout, CRC32C
// stripes, fsync/rename publishing, Note [Checkpoint format], Note [Checkpoint
// publish], Note [Sharded checkpoint]), the capture side (capture.cpp: the save's
// buffers and its hold on optimizer updates, Note [Overlapped save]), the save
// (prepare.cpp: a save's checks and description; save.cpp: save_checkpoint,
// begin_checkpoint, starting the save thread, Note [Save I/O priority];
// save_thread.cpp: the save thread's work; shards.cpp: data-parallel assembly) and
// the load (load.cpp: the check pass, then the apply pass; shadow.cpp, load.hpp).
// They may call Core, Runtime::Impl (finalize, the pipeline's wait_all and
// launches, with_host_copy, the data-parallel agreements) and each other through
// this header; nothing outside them includes it. Test hooks are in test_hooks.hpp,
// not here. Every function expecting Core::mu held says so.

#include <fcntl.h>
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "../src/runtime_impl.hpp"
#include "strata/common/log.hpp"
#include "strata/offload/crc32c.hpp"

namespace strata::runtime {

namespace checkpoint_detail {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kFormatVersion = 1;
constexpr std::uint64_t kStripeBytes = 1u << 20;
//! Data files written before they are fsynced together (bounds open descriptors).
constexpr std::size_t kWritersOpenMax = 256;
//! Threads that fsync a save's files, or verify a load's, at once.
constexpr std::size_t kIoThreads = 8;
//! The save's buffers (outside the host store) hold at most host budget / this, or one
//! family when that is larger (Note [Overlapped save]).
constexpr std::uint64_t kSaveRoomDivisor = 4;
//! ioprio_set(2) for an overlapped save's threads: class idle (Note [Save I/O priority]).
constexpr int kIoprioWhoProcess = 1;  // IOPRIO_WHO_PROCESS: a thread id
constexpr int kIoprioClassIdle = 3;   // IOPRIO_CLASS_IDLE
constexpr int kIoprioClassShift = 13;
//! Families of an overlapped save whose NVMe pieces may wait while host copies are
//! written first (each holds an open file and a part-filled stripe).
constexpr std::size_t kDeferredMax = 64;
//! Freed save buffers kept for reuse.
constexpr std::size_t kSaveSpares = 4;
//! NVMe reads a save keeps in flight ahead of its writer (Note [Save read-ahead]).
constexpr std::uint64_t kSaveReadAheadBytes = std::uint64_t{32} << 20;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kFormatName = "strata-checkpoint";

//! The kinds a checkpoint stores, in file order.
constexpr StateKind kSavedKinds[] = {StateKind::kParam, StateKind::kMaster, StateKind::kState0,
                                     StateKind::kState1};

//! The saved kind called `name` ("param", "master", "state0", "state1").
std::optional<StateKind> kind_from_name(std::string_view name);

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
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  //! Closes now and reports close's error (a delayed write error surfaces here).
  Status close(const fs::path& path) {
    const int fd = fd_;
    fd_ = -1;
    if (fd >= 0 && ::close(fd) != 0) return errno_status(errno, fmt::format("closing {}", path.string()));
    return Status::Ok();
  }

 private:
  int fd_;
};

//! Reads n bytes at offset; a file that ends first is corrupt.
Status read_all(int fd, std::byte* p, std::size_t n, std::uint64_t offset, const fs::path& path);
//! fsyncs the directory (a rename in it is durable once this returns).
Status fsync_dir(const fs::path& dir);
//! Writes n bytes at offset, retrying short writes.
Status pwrite_all(int fd, const std::byte* p, std::size_t n, std::uint64_t offset, const std::string& path);

//! Writes stripes on a thread of its own, so a save's NVMe reads and copies overlap
//! its file writes. Holds kSinkBuffers stripe buffers; take() blocks while all are in
//! flight, so a save holds at most that much memory beyond the chunk it copies.
class StripeSink {
 public:
  //! `start_writeback`: each stripe's writeback starts as soon as it is written (a
  //! blocking save, whose fsync then waits for little); else the stripes stay in the
  //! page cache until the save's fsyncs (Note [Save I/O priority]).
  explicit StripeSink(bool start_writeback = true)
      : start_writeback_(start_writeback), thread_([this] { run(); }) {
    for (std::size_t i = 0; i < kSinkBuffers; ++i) free_.emplace_back(kStripeBytes);
  }
  ~StripeSink() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  StripeSink(const StripeSink&) = delete;
  StripeSink& operator=(const StripeSink&) = delete;

  //! A stripe buffer; waits while kSinkBuffers stripes are being written. Buffers a
  //! writer holds part-filled (an overlapped save's deferred files) do not count.
  std::vector<std::byte> take() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return jobs_.size() + static_cast<std::size_t>(busy_) < kSinkBuffers; });
    if (free_.empty()) return std::vector<std::byte>(kStripeBytes);
    std::vector<std::byte> b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  //! Writes buf[0, n) at `offset` of *fd (kept open until the write is done).
  void submit(std::shared_ptr<Fd> fd, std::uint64_t offset, std::vector<std::byte> buf, std::size_t n,
              const fs::path& path) {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(Job{std::move(fd), offset, std::move(buf), n, path.string()});
    }
    cv_.notify_all();
  }
  //! Waits until every submitted stripe is written; the first write error.
  Status drain() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return jobs_.empty() && busy_ == 0; });
    return error_;
  }

 private:
  static constexpr std::size_t kSinkBuffers = 4;
  struct Job {
    std::shared_ptr<Fd> fd;
    std::uint64_t offset;
    std::vector<std::byte> buf;
    std::size_t n;
    std::string path;
  };
  void run() {
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
        st = pwrite_all(job.fd->get(), job.buf.data(), job.n, job.offset, job.path);
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

//! Writes a file under a temporary name in stripes through a StripeSink, with a
//! CRC32C per stripe; sync() (after the sink is drained) fsyncs it and rename() renames
//! it to its final name.
class StripedWriter {
 public:
  static Result<StripedWriter> open(fs::path final_path, StripeSink& sink) {
    STRATA_ASSIGN_OR_RETURN(Fd fd, create_tmp(final_path));
    return adopt(std::move(final_path), std::move(fd), sink);
  }
  //! Creates (or truncates) `<final_path>.tmp` for writing.
  static Result<Fd> create_tmp(const fs::path& final_path);
  //! A writer of `fd`, which create_tmp(final_path) made.
  static StripedWriter adopt(fs::path final_path, Fd fd, StripeSink& sink) {
    StripedWriter w;
    w.sink_ = &sink;
    w.fd_ = std::make_shared<Fd>(std::move(fd));
    w.tmp_ = final_path;
    w.tmp_ += ".tmp";
    w.final_ = std::move(final_path);
    return w;
  }

  void append(const std::byte* p, std::size_t n) {
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

  //! Hands the last stripe to the sink.
  void finish() {
    if (fill_ > 0) flush_stripe();
  }

  //! fsyncs and closes the file. The sink must be drained.
  Status sync() {
    if (::fsync(fd_->get()) != 0) return errno_status(errno, fmt::format("fsync of {}", tmp_.string()));
    return fd_->close(tmp_);
  }
  //! Renames the synced file to its final name.
  Status rename() {
    if (::rename(tmp_.c_str(), final_.c_str()) != 0) {
      return errno_status(errno, fmt::format("renaming {} to {}", tmp_.string(), final_.string()));
    }
    return Status::Ok();
  }

  //! Bytes appended so far (the next append's offset).
  std::uint64_t size() const { return bytes_ + fill_; }
  const std::vector<std::uint32_t>& crcs() const { return crcs_; }

 private:
  StripedWriter() = default;
  void flush_stripe() {
    crcs_.push_back(offload::crc32c(std::span<const std::byte>(buf_.data(), fill_)));
    sink_->submit(fd_, bytes_, std::move(buf_), fill_, tmp_);
    buf_ = {};
    bytes_ += fill_;
    fill_ = 0;
  }

  StripeSink* sink_ = nullptr;
  std::shared_ptr<Fd> fd_;  //!< shared with the sink's writes in flight
  fs::path final_, tmp_;
  std::vector<std::byte> buf_;
  std::size_t fill_ = 0;
  std::uint64_t bytes_ = 0;
  std::vector<std::uint32_t> crcs_;
};

//! Runs fn(i, thread) for i in [0, n) on up to kIoThreads threads.
void parallel_for(std::size_t n, const std::function<void(std::size_t, std::size_t)>& fn);
//! Publishes `writers`: drains the sink, fsyncs them together, renames them in order.
Status publish_all(StripeSink& sink, std::vector<StripedWriter>& writers);
//! `dir` (made absolute) when it is neither one of the NVMe swap directories nor inside one.
Result<fs::path> checkpoint_dir(const Core& core, const std::string& dir, std::string_view what);
//! The published manifest of `dir`, its format and version checked.
Result<json> read_manifest(const fs::path& dir);
//! Opens every data file the manifest names and checks its size; `fds` and `stats`
//! get each file's descriptor and its stat before any read.
Status open_files(const fs::path& dir, const json& files, std::vector<Fd>* fds,
                  std::vector<struct stat>* stats);
//! Checks every stripe's CRC32C of the files open_files opened, kIoThreads at once.
Status verify_files(const fs::path& dir, const json& files, std::uint64_t stripe_bytes,
                    const std::vector<Fd>& fds);
//! Converts n elements between float dtypes (f32, bf16, f16).
void convert(const std::byte* src, DType from, std::byte* dst, DType to, std::uint64_t n);
//! The kinds a family of this runtime holds a chunk of, in file order.
std::vector<StateKind> family_kinds(Core& core, FamilyId f);

}  // namespace checkpoint_detail

struct CheckpointSave {
  using json = checkpoint_detail::json;
  //! One captured chunk: a host copy (buf) or the pinned NVMe slots it lives in.
  struct Piece {
    StateKind kind = StateKind::kParam;
    std::uint64_t bytes = 0;
    std::byte* buf = nullptr;
    bool borrowed = false;  //!< buf is the chunk's own host copy (a blocking save)
    std::vector<std::uint32_t> slots;
  };
  enum class Stage : std::uint8_t { kPending, kCaptured, kWritten };

  std::filesystem::path root;
  std::int64_t generation = 0;
  json tensors_meta;  //!< per tensor: name, shape, frozen, steps, group, file (taken at the call)
  json groups = json::array();
  std::int64_t step_index = 0;
  double t0 = 0;
  std::shared_ptr<NvmeStore> nvme;
  std::vector<std::vector<StateKind>> kinds;  //!< per family
  std::vector<Stage> stage;
  std::vector<bool> held;  //!< the family's update waits for its capture
  //! Captured, its host copies written, its NVMe pieces not yet (Note [Save I/O priority]).
  std::vector<bool> deferred;
  std::vector<std::vector<Piece>> pieces;
  std::uint64_t room = 0;        //!< host bytes the training thread may capture into
  std::uint64_t held_bytes = 0;  //!< bytes of the save's buffers
  std::uint64_t high_water = 0;  //!< the most held_bytes
  std::vector<std::pair<std::uint64_t, std::byte*>> spares;  //!< freed buffers kept for reuse (in held_bytes)
  //! save_checkpoint: nothing runs beside it, so host copies are written in place
  //! (borrowed), and families are captured ahead only for the read-ahead (Note
  //! [Save read-ahead]).
  bool blocking = false;
  //! Every buffer save_allocate made and save_free has not freed, spares included.
  //! The destructor frees what is left: one buffer of an overlapped save begun while
  //! write-backs run is lost track of in about one run in three (the asan build's
  //! leak check found it in Checkpoint.AnOverlappedSaveBegunWhileWriteBacksRun...;
  //! an open bug, its cause not yet found). Such a buffer is held until the save ends.
  std::unordered_set<std::byte*> allocated;
  ~CheckpointSave();
  std::size_t held_count = 0;
  std::size_t uncaptured = 0;
  //! Data parallelism (Note [Sharded checkpoint]): this rank writes families f mod W =
  //! its rank only (`owned` of them; assemble_shards gathered their state shards), and
  //! run_save leaves their file and tensor entries here
  //! for rank 0's manifest instead of publishing one.
  bool sharded = false;
  std::size_t owned = 0;
  json shard_files = json::array();    //!< {family, name, bytes, crc32c}
  json shard_tensors = json::array();  //!< {id, entry}
  bool done = false;
  Status status = Status::Ok();
  std::thread thread;
};

namespace checkpoint_detail {

// The capture side (capture.cpp); Core::mu held.
//! A buffer of the save's own (4096-aligned, outside the host store): within its
//! room, or past it with `force`; null otherwise.
std::byte* save_allocate(CheckpointSave& s, std::uint64_t bytes, bool force);
//! Frees (or keeps as a spare) a buffer of save_allocate.
void save_free(CheckpointSave& s, std::byte* p, std::uint64_t bytes);
//! Frees a save's captured pieces of one family (buffers back, NVMe slots unpinned).
void release_pieces(Core& core, std::vector<CheckpointSave::Piece>& pieces, CheckpointSave& s);
//! Captures family f (Note [Overlapped save]). `force` (the save thread): past the
//! save's room, in ordinary memory; else false when the copies do not fit the room.
Result<bool> capture_family(Runtime::Impl& m, CheckpointSave& s, FamilyId f, bool force);
//! Ends the save's hold on every update (after an error): they launch now.
void release_all_holds(Runtime::Impl& m, CheckpointSave& s);

// The format side (format.cpp); Core::mu not needed.
//! Writes, fsyncs and renames the manifest (the data files are published), then
//! removes what no manifest names (Note [Checkpoint publish]).
Status publish_manifest(Core& core, CheckpointSave& s, json files, json tensors, std::uint64_t total);

//! With W > 1: all-gathers every family's optimizer shards so that rank f mod W
//! holds family f's whole pieces as captured (shards.cpp). Core::mu held.
Status assemble_shards(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, CheckpointSave& s);
//! Everything of a save that can fail on one rank alone (prepare.cpp):
//! after this, only collectives and the save thread. Core::mu held.
Status prepare_save(Runtime::Impl& m, std::unique_lock<std::mutex>& lock, CheckpointSave& s,
                    const std::string& dir, bool wait_write_backs);
//! The save's metadata as of the call (step counters, groups, the step index) and its
//! per-family progress: another rank's families are done already. Core::mu held.
void describe_save(Runtime::Impl& m, CheckpointSave& s);

// The save thread (save_thread.cpp); takes Core::mu itself.
//! Writes every family this rank owns and, on rank 0 or alone, the manifest
//! (Note [Save read-ahead], Note [Save file creation]). Blocks until done.
Status run_save(Runtime::Impl& m, CheckpointSave& s);
//! Removes a failed save's temporary files, written or not.
void remove_temporaries(const Core& core, const CheckpointSave& s);

}  // namespace checkpoint_detail

}  // namespace strata::runtime
