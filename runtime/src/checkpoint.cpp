// Runtime: crash-safe checkpoints of every tier (save_checkpoint, load_checkpoint).
//
// Note [Checkpoint format]
// A checkpoint directory holds one data file per chunk family and a JSON manifest:
//
//   manifest.json          {"format": "strata-checkpoint", "version": 1, "generation": g,
//                           "stripe_bytes", "compute_dtype", "state_dtype", "state_count",
//                           "optimizer", "files": [{name, bytes, crc32c: [per stripe]}],
//                           "tensors": [{name, shape, frozen, steps, group, file,
//                                        states: {param|master|state0|state1: {dtype, offset}}}],
//                           "groups": [{group, lr, weight_decay}]}
//   family-<f>.g<g>.bin    the family's tensors, kind after kind (param, master, states),
//                          each tensor's elements contiguous in its kind's dtype
//
// The layout is per tensor (name, dtype, shape, byte offset), not per chunk, so a
// checkpoint loads into a runtime with another chunk size, other budgets or another
// placement. Every stripe of `stripe_bytes` of a data file carries a CRC32C (the swap
// code's) in the manifest; a load checks every stripe of every file, the shapes and the
// format version before it changes any state, so a bad checkpoint is refused whole.
//
// Note [Checkpoint publish]
// A save writes every `<name>.tmp` (starting each stripe's writeback as it goes), then
// fsyncs each and renames it to a name that carries the new generation (one more than the published
// manifest's), fsyncs the directory, then writes, fsyncs and renames the manifest last and fsyncs the
// directory again. Until that rename the published manifest and its files are untouched, so a crash (or a
// full disk) at any point leaves the previous checkpoint loadable. After publishing, files no manifest names
// (older generations, temporaries of a crashed save) are removed. States are streamed chunk by chunk through
// one host copy at a time (an NVMe chunk is read from its slots into a host buffer, never through the
// device), so a save needs one chunk of host room beyond what the runtime holds, plus one stripe buffer.
//
// Note [Sharded checkpoint]
// With W > 1 data-parallel ranks (Note [Sharded step]) save_checkpoint and
// load_checkpoint are collective: every rank calls them on the same directory.
// A save: each rank does every check that can fail on it alone (begin_save's
// prepare), then the ranks agree (Impl::dp_all_ok: every rank's error text
// reaches every rank) and take the largest generation any found (dp_max). Each
// rank writes, fsyncs and renames the files of its own families (run_save;
// the owner's params, masters, states) and fsyncs the directory; they agree
// again; rank 0 gathers every rank's file entries and tensor entries
// (dp_exchange_text), publishes the manifest (publish_manifest: the same
// format as one rank's, plus "ranks": W) and removes stale files; a last
// agreement hands rank 0's outcome to every rank once the manifest is durable.
// Until rank 0's rename the previous manifest is the published one, so the
// rules of Note [Checkpoint publish] hold for every crash point. The generation
// scan skips ".tmp" names (another rank's probe may be one). begin_checkpoint
// is refused with W > 1: its agreement would run on the save thread, among the
// step's collectives. A load: every rank finishes the last step's param
// all-gathers, checks the manifest and every file (all hold params, which every
// rank needs), and the ranks agree before any applies; each applies params of
// every family and masters/states of the families it owns now, so a checkpoint
// saved at W loads at any W' (the layout is per tensor).
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
#include <vector>

#include "runtime_impl.hpp"
#include "strata/common/log.hpp"
#include "strata/offload/crc32c.hpp"

namespace strata::runtime {

//! Test hook: runs before a save creates each `<name>.tmp`; an error fails that file
//! as a real one would (tests/runtime/test_checkpoint.cpp fails one rank's file).
//! Set before the runtimes run; tests only.
namespace checkpoint_testing {
std::function<Status(const std::string& tmp_path)> before_create;
}  // namespace checkpoint_testing

namespace {

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
//! The nice value of the save's threads (Note [Overlapped save]).
constexpr int kSaveNice = 10;
//! Freed save buffers kept for reuse.
constexpr std::size_t kSaveSpares = 4;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kFormatName = "strata-checkpoint";

//! The kinds a checkpoint stores, in file order.
constexpr StateKind kSavedKinds[] = {StateKind::kParam, StateKind::kMaster, StateKind::kState0,
                                     StateKind::kState1};

std::optional<StateKind> kind_from_name(std::string_view name) {
  for (StateKind k : kSavedKinds) {
    if (state_kind_name(k) == name) return k;
  }
  return std::nullopt;
}

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

Status read_all(int fd, std::byte* p, std::size_t n, std::uint64_t offset, const fs::path& path) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, fmt::format("reading {}", path.string()));
    }
    if (r == 0)
      return corrupt("{}: ends at byte {}, before the data the manifest describes", path.string(), offset);
    p += r;
    offset += static_cast<std::uint64_t>(r);
    n -= static_cast<std::size_t>(r);
  }
  return Status::Ok();
}

Status fsync_dir(const fs::path& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return errno_status(errno, fmt::format("opening directory {} to fsync it", dir.string()));
  if (::fsync(fd.get()) != 0) return errno_status(errno, fmt::format("fsync of directory {}", dir.string()));
  return fd.close(dir);
}

Status pwrite_all(int fd, const std::byte* p, std::size_t n, std::uint64_t offset, const std::string& path) {
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

//! Writes stripes on a thread of its own, so a save's NVMe reads and copies overlap
//! its file writes. Holds kSinkBuffers stripe buffers; take() blocks while all are in
//! flight, so a save holds at most that much memory beyond the chunk it copies.
class StripeSink {
 public:
  StripeSink() : thread_([this] { run(); }) {
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

  std::vector<std::byte> take() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !free_.empty(); });
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
        ::sync_file_range(job.fd->get(), static_cast<off_t>(job.offset), static_cast<off_t>(job.n),
                          SYNC_FILE_RANGE_WRITE);
      }
      lock.lock();
      if (!st.ok() && error_.ok()) error_ = st;
      free_.push_back(std::move(job.buf));
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
  std::thread thread_;  // last: started once the rest is constructed
};

//! Writes a file under a temporary name in stripes through a StripeSink, with a
//! CRC32C per stripe; sync() (after the sink is drained) fsyncs it and rename() renames
//! it to its final name.
class StripedWriter {
 public:
  static Result<StripedWriter> open(fs::path final_path, StripeSink& sink) {
    fs::path tmp = final_path;
    tmp += ".tmp";
    if (checkpoint_testing::before_create)
      STRATA_RETURN_IF_ERROR(checkpoint_testing::before_create(tmp.string()));
    Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      return errno_status(errno, fmt::format("save_checkpoint: creating {} (the checkpoint directory must be "
                                             "writable by this process)",
                                             tmp.string()));
    }
    StripedWriter w;
    w.sink_ = &sink;
    w.fd_ = std::make_shared<Fd>(std::move(fd));
    w.final_ = std::move(final_path);
    w.tmp_ = std::move(tmp);
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
void parallel_for(std::size_t n, const std::function<void(std::size_t, std::size_t)>& fn) {
  std::atomic<std::size_t> next{0};
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < std::min(kIoThreads, n); ++t) {
    threads.emplace_back([&, t] {
      for (std::size_t i = next++; i < n; i = next++) fn(i, t);
    });
  }
  for (std::thread& t : threads) t.join();
}

//! Publishes `writers` (the sink drained): their fsyncs run on several threads at
//! once, so the file system commits them together (one journal commit for many files
//! rather than one each), then they are renamed in order.
Status publish_all(StripeSink& sink, std::vector<StripedWriter>& writers) {
  STRATA_RETURN_IF_ERROR(sink.drain());
  std::vector<Status> synced(writers.size(), Status::Ok());
  parallel_for(writers.size(), [&](std::size_t i, std::size_t) { synced[i] = writers[i].sync(); });
  for (std::size_t i = 0; i < writers.size(); ++i) {
    STRATA_RETURN_IF_ERROR(synced[i]);
    STRATA_RETURN_IF_ERROR(writers[i].rename());
  }
  writers.clear();
  return Status::Ok();
}

//! `dir` (made absolute) when it is neither one of the NVMe swap directories nor inside one.
Result<fs::path> checkpoint_dir(const Core& core, const std::string& dir, std::string_view what) {
  if (dir.empty()) return invalid_argument("{}: the checkpoint directory is empty", what);
  std::error_code ec;
  const fs::path abs = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  if (ec) return errno_status(ec.value(), fmt::format("{}: resolving {}", what, dir));
  for (const std::string& swap : core.opt.nvme_dirs) {
    const fs::path s = fs::weakly_canonical(fs::absolute(swap, ec), ec);
    if (ec) continue;
    auto [sit, ait] = std::mismatch(s.begin(), s.end(), abs.begin(), abs.end());
    if (sit == s.end() || (std::next(sit) == s.end() && sit->empty())) {
      return invalid_argument(
          "{}: {} is inside the NVMe swap directory {}, whose files are scratch and reclaimed at start; "
          "put checkpoints in a directory of their own",
          what, abs.string(), s.string());
    }
  }
  return abs;
}

//! The published manifest of `dir`, parsed and checked for format and version.
Result<json> read_manifest(const fs::path& dir) {
  const fs::path path = dir / kManifestName;
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) {
      return not_found("load_checkpoint: {} does not exist: {} holds no published checkpoint", path.string(),
                       dir.string());
    }
    return errno_status(errno, fmt::format("load_checkpoint: opening {}", path.string()));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, fmt::format("stat of {}", path.string()));
  std::string text(static_cast<std::size_t>(st.st_size), '\0');
  STRATA_RETURN_IF_ERROR(read_all(fd.get(), reinterpret_cast<std::byte*>(text.data()), text.size(), 0, path));
  json m = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (m.is_discarded() || !m.is_object())
    return corrupt("load_checkpoint: {} is not valid JSON", path.string());
  if (m.value("format", std::string()) != kFormatName)
    return corrupt("load_checkpoint: {} is not a strata checkpoint manifest (no \"format\": \"{}\")",
                   path.string(), kFormatName);
  const int version = m.value("version", 0);
  if (version > kFormatVersion) {
    return failed_precondition(
        "load_checkpoint: {} has format version {}, newer than this build reads ({}); load it with a newer "
        "strata",
        path.string(), version, kFormatVersion);
  }
  if (version < 1) return corrupt("load_checkpoint: {} has no valid format version", path.string());
  return m;
}

//! Checks that every data file the manifest names has its size and every stripe's CRC32C.
//! Checks one data file the manifest names: its size and every stripe's CRC32C.
//! `*opened` is the descriptor it verified (the load reads that file, not whatever
//! has the name later) and `*verified` its stat (the load checks it did not change).
Status verify_file(const fs::path& dir, const json& f, std::uint64_t stripe_bytes,
                   std::vector<std::byte>& buf, Fd* opened, struct stat* verified) {
  const fs::path path = dir / f.at("name").get<std::string>();
  const auto want = f.at("bytes").get<std::uint64_t>();
  const auto& crcs = f.at("crc32c");
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    return errno_status(errno, fmt::format("load_checkpoint: opening {} (named by {})", path.string(),
                                           (dir / kManifestName).string()));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, fmt::format("stat of {}", path.string()));
  *verified = st;
  if (static_cast<std::uint64_t>(st.st_size) != want) {
    return corrupt("load_checkpoint: {} is {} bytes, the manifest says {} (truncated or overwritten)",
                   path.string(), st.st_size, want);
  }
  const std::uint64_t stripes = (want + stripe_bytes - 1) / stripe_bytes;
  if (crcs.size() != stripes)
    return corrupt("load_checkpoint: the manifest has {} CRCs for {} stripes of {}", crcs.size(), stripes,
                   path.string());
  ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_SEQUENTIAL);
  buf.resize(stripe_bytes);
  for (std::uint64_t i = 0; i < stripes; ++i) {
    const std::uint64_t off = i * stripe_bytes;
    const std::size_t n = static_cast<std::size_t>(std::min(stripe_bytes, want - off));
    STRATA_RETURN_IF_ERROR(read_all(fd.get(), buf.data(), n, off, path));
    const std::uint32_t crc = offload::crc32c(std::span<const std::byte>(buf.data(), n));
    if (crc != crcs[i].get<std::uint32_t>()) {
      return corrupt("load_checkpoint: {} bytes [{}, {}) fail their CRC32C ({:08x}, the manifest has {:08x})",
                     path.string(), off, off + n, crc, crcs[i].get<std::uint32_t>());
    }
  }
  *opened = std::move(fd);
  return Status::Ok();
}

//! Checks every data file the manifest names, kIoThreads at once (the disk serves
//! several sequential readers better than one); the first failure in file order.
Status verify_files(const fs::path& dir, const json& files, std::uint64_t stripe_bytes, std::vector<Fd>* fds,
                    std::vector<struct stat>* stats) {
  std::vector<Status> checked(files.size(), Status::Ok());
  fds->resize(files.size());
  stats->resize(files.size());
  std::vector<std::vector<std::byte>> bufs(kIoThreads);
  parallel_for(files.size(), [&](std::size_t i, std::size_t thread) {
    try {
      checked[i] = verify_file(dir, files[i], stripe_bytes, bufs[thread], &(*fds)[i], &(*stats)[i]);
    } catch (const json::exception& e) {
      checked[i] = corrupt("load_checkpoint: {} is malformed: {}", (dir / kManifestName).string(), e.what());
    }
  });
  for (Status& st : checked) STRATA_RETURN_IF_ERROR(st);
  return Status::Ok();
}

void convert(const std::byte* src, DType from, std::byte* dst, DType to, std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; ++i) {
    float v;
    if (from == DType::kF32) {
      std::memcpy(&v, src + 4 * i, 4);
    } else {
      std::uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      v = from == DType::kBF16 ? kernels::bf16_to_float(h) : kernels::f16_to_float(h);
    }
    if (to == DType::kF32) {
      std::memcpy(dst + 4 * i, &v, 4);
    } else {
      const std::uint16_t h = to == DType::kBF16 ? kernels::float_to_bf16(v) : kernels::float_to_f16(v);
      std::memcpy(dst + 2 * i, &h, 2);
    }
  }
}

//! The kinds a family of this runtime holds a chunk of, in file order.
std::vector<StateKind> family_kinds(Core& core, FamilyId f) {
  std::vector<StateKind> kinds;
  for (StateKind k : kSavedKinds) {
    if (k == StateKind::kMaster && !core.separate_master) continue;
    if (core.chunk(f, k).bytes > 0) kinds.push_back(k);
  }
  return kinds;
}

}  // namespace

// Note [Overlapped save]
// begin_checkpoint captures the state as of the call and returns; a background
// thread (CheckpointSave::run) writes it while training goes on. Forward and
// backward only read params, so only an optimizer update changes what the save
// must write: family f's update does not start until f is captured
// (Runtime::Impl::checkpoint_allows_update, asked by the scheduler before every
// launch). Capturing f takes, under the lock:
//   - a chunk whose value is on NVMe: its slots, pinned (Note [Pinned NVMe slots]
//     in core.hpp). The copy-on-write write-back of f's update goes to fresh
//     slots and the old ones are released only when the save has read them, so
//     NVMe states stream from their slots and never pass through the device;
//   - any other chunk: a copy into a host buffer of the host store (the budget).
// The save thread captures ahead, in reverse family order (the order backward
// completes them), as much as its room holds (a quarter of the host budget, in
// ordinary memory: the plan gives the host store to training), and writes one
// family at a time, captured ones first. The training thread captures a family
// not yet captured itself before launching its update (release, step()), waiting
// while the room is full until the writer frees some; a family it could not
// capture (an error) is held back and launched by the save thread once captured,
// and step() waits for such held-back launches. The threads of a save begun by
// begin_checkpoint run at nice kSaveNice (save_checkpoint's, which nothing runs
// beside, do not). Metadata (step counters,
// groups, the step index) is taken at the call. Files are published as Note
// [Checkpoint publish] says; an error ends the save, releases every held update
// and surfaces in finish_checkpoint / checkpoint_in_flight, and the published
// checkpoint is untouched. write_tensor, init_tensor and load_checkpoint wait
// until every family is captured; a second begin_checkpoint waits for the first.

//! Test hook: runs in load_checkpoint between the CRC32C pass and the apply pass
//! (tests/runtime/test_checkpoint.cpp writes a file there). Not thread-safe; tests only.
namespace checkpoint_testing {
extern std::function<void(const std::string& dir)> after_verify;
}  // namespace checkpoint_testing

struct CheckpointSave {
  //! One captured chunk: a host copy (buf) or the pinned NVMe slots it lives in.
  struct Piece {
    StateKind kind = StateKind::kParam;
    std::uint64_t bytes = 0;
    std::byte* buf = nullptr;
    bool borrowed = false;  //!< buf is the chunk's own host copy (a blocking save)
    std::vector<std::uint32_t> slots;
  };
  enum class Stage : std::uint8_t { kPending, kCaptured, kWritten };

  fs::path root;
  std::int64_t generation = 0;
  json tensors_meta;  //!< per tensor: name, shape, frozen, steps, group, file (taken at the call)
  json groups = json::array();
  std::int64_t step_index = 0;
  double t0 = 0;
  std::shared_ptr<NvmeStore> nvme;
  std::vector<std::vector<StateKind>> kinds;  //!< per family
  std::vector<Stage> stage;
  std::vector<bool> held;  //!< the family's update waits for its capture
  std::vector<std::vector<Piece>> pieces;
  std::uint64_t room = 0;        //!< host bytes the training thread may capture into
  std::uint64_t held_bytes = 0;  //!< bytes of the save's buffers
  std::uint64_t high_water = 0;  //!< the most held_bytes
  std::vector<std::pair<std::uint64_t, std::byte*>> spares;  //!< freed buffers kept for reuse (in held_bytes)
  //! save_checkpoint: nothing runs beside it, so host copies are written in place
  //! (borrowed) and nothing is captured ahead.
  bool blocking = false;
  ~CheckpointSave() {
    for (auto& [bytes, p] : spares) std::free(p);
  }
  std::size_t held_count = 0;
  std::size_t uncaptured = 0;
  //! Data parallelism (Note [Sharded checkpoint]): this rank writes its own families
  //! only (`owned` of them), and run_save leaves their file and tensor entries here
  //! for rank 0's manifest instead of publishing one.
  bool sharded = false;
  std::size_t owned = 0;
  json shard_files = json::array();    //!< {family, name, bytes, crc32c}
  json shard_tensors = json::array();  //!< {id, entry}
  bool done = false;
  Status status = Status::Ok();
  std::thread thread;
};

namespace {

//! A buffer of the save (Note [Overlapped save]): ordinary memory, 4096-aligned as
//! NVMe reads need, never the host store's (the plan gave all of it to training).
//! Within the save's room, or past it with `force` (the save thread, one family at a
//! time); null otherwise.
std::byte* save_allocate(CheckpointSave& s, std::uint64_t bytes, bool force) {
  if (!force && s.held_bytes + bytes > s.room) return nullptr;
  std::byte* p = nullptr;
  // A spare of the same size first: chunks are mostly one size, and a fresh buffer
  // costs a page fault per 4 KiB.
  for (auto it = s.spares.begin(); it != s.spares.end(); ++it) {
    if (it->first == bytes) {
      p = it->second;
      s.spares.erase(it);
      s.held_bytes -= bytes;  // (counted again below)
      break;
    }
  }
  if (p == nullptr) p = static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  if (p == nullptr) return nullptr;
  s.held_bytes += bytes;
  s.high_water = std::max(s.high_water, s.held_bytes);
  return p;
}

void save_free(CheckpointSave& s, std::byte* p, std::uint64_t bytes) {
  s.held_bytes -= bytes;
  if (s.spares.size() < kSaveSpares && s.held_bytes + bytes <= s.room) {
    s.spares.emplace_back(bytes, p);
    s.held_bytes += bytes;  // a spare counts in the room
    return;
  }
  std::free(p);
}

void release_pieces(Core& core, std::vector<CheckpointSave::Piece>& pieces, CheckpointSave& s) {
  for (CheckpointSave::Piece& p : pieces) {
    if (p.buf != nullptr && !p.borrowed) save_free(s, p.buf, p.bytes);
    for (std::uint32_t slot : p.slots) core.unpin_nvme_slot(slot);
  }
  pieces.clear();
}

}  // namespace

//! Captures family f (Note [Overlapped save]). `force` (the save thread): past the
//! save's room, in ordinary memory; else false when the copies do not fit the room.
static Result<bool> capture_family(Runtime::Impl& m, CheckpointSave& s, FamilyId f, bool force) {
  Core& core = m.core;
  std::uint64_t need = 0;
  for (StateKind k : s.kinds[f]) {
    const Chunk& c = core.chunk(f, k);
    if (c.value != ChunkValue::kNvme) need += c.bytes;
  }
  if (!force && s.held_bytes + need > s.room) return false;
  std::vector<CheckpointSave::Piece> pieces;
  Status st = Status::Ok();
  for (StateKind k : s.kinds[f]) {
    Chunk& c = core.chunk(f, k);
    CheckpointSave::Piece p{.kind = k, .bytes = c.bytes};
    if (c.value == ChunkValue::kNvme) {
      p.slots = c.nvme_slots;
      for (std::uint32_t slot : p.slots) core.pin_nvme_slot(slot);
      pieces.push_back(std::move(p));
      continue;
    }
    if (s.blocking && c.value == ChunkValue::kHost) {
      p.buf = c.host;
      p.borrowed = true;
      pieces.push_back(p);
      continue;
    }
    p.buf = save_allocate(s, c.bytes, force);
    if (p.buf == nullptr) {
      st = out_of_budget("checkpoint save: no room for a copy of family {} {}", f, state_kind_name(k));
      break;
    }
    pieces.push_back(p);
    // Copied without changing where the chunk lives: the plan's host room is training's.
    switch (c.value) {
      case ChunkValue::kHost:
        std::memcpy(p.buf, c.host, c.bytes);
        break;
      case ChunkValue::kAbsent:  // optimizer states start as zeros
        std::memset(p.buf, 0, c.bytes);
        break;
      case ChunkValue::kDevice: {  // the device copy is the only one: copy it, as a write-back would
        DeviceSlot& slot = m.residency.slot_of(c);
        st = core.device.wait(core.d2h, slot.fence);
        if (st.ok())
          st = core.device.copy_async(core.d2h, p.buf, slot.ptr, c.bytes, memory::CopyKind::kDeviceToHost);
        if (st.ok()) st = core.device.record(slot.fence, core.d2h);
        if (st.ok()) st = core.device.synchronize(core.d2h);
        break;
      }
      default:
        st = internal_error("checkpoint save: family {} {} is in the optimizer pipeline's staging", f,
                            state_kind_name(k));
    }
    if (!st.ok()) break;
  }
  if (!st.ok()) {
    release_pieces(core, pieces, s);
    if (!force && st.code() == StatusCode::kOutOfBudget) return false;
    return st;
  }
  s.pieces[f] = std::move(pieces);
  s.stage[f] = CheckpointSave::Stage::kCaptured;
  --s.uncaptured;
  if (s.held[f]) {
    s.held[f] = false;
    --s.held_count;
    m.pipeline.launch_optimizer(f);
  }
  core.cv.notify_all();
  return true;
}

//! Ends the save's hold on every update (after an error): they launch now.
static void release_all_holds(Runtime::Impl& m, CheckpointSave& s) {
  for (FamilyId f = 0; f < s.stage.size(); ++f) {
    if (s.stage[f] == CheckpointSave::Stage::kPending) {
      s.stage[f] = CheckpointSave::Stage::kWritten;
      --s.uncaptured;
    }
    release_pieces(m.core, s.pieces[f], s);
    if (s.held[f]) {
      s.held[f] = false;
      --s.held_count;
      m.pipeline.launch_optimizer(f);
    }
  }
  m.core.cv.notify_all();
}

//! Appends family f's captured pieces to its file; entries get each state's dtype and offset.
static Status write_family(Core& core, CheckpointSave& s, FamilyId f, StripedWriter& w,
                           std::vector<json>& entries) {
  const FamilyLayout& fam = core.layout.families[f];
  for (CheckpointSave::Piece& p : s.pieces[f]) {
    const DType dtype = core.kind_dtype(p.kind);
    const std::uint64_t esize = dtype_bytes(dtype);
    std::byte* base = p.buf;
    std::byte* read_buf = nullptr;
    if (base == nullptr) {  // pinned NVMe slots: read them into a buffer of the save
      {
        std::lock_guard lock(core.mu);
        read_buf = save_allocate(s, p.bytes, true);
      }
      const std::uint64_t piece = s.nvme->slot_bytes();
      struct Latch {
        std::mutex mu;
        std::condition_variable cv;
        std::size_t pending = 0;
        Status status;
      } latch;
      latch.pending = p.slots.size();
      for (std::size_t i = 0; i < p.slots.size(); ++i) {
        const std::uint64_t begin = i * piece;
        std::span<std::byte> part(read_buf + begin, std::min<std::uint64_t>(piece, p.bytes - begin));
        auto done = [&latch](Status st) {
          std::lock_guard g(latch.mu);
          if (!st.ok() && latch.status.ok()) latch.status = std::move(st);
          if (--latch.pending == 0) latch.cv.notify_all();
        };
        Status st = s.nvme->read(p.slots[i], part, done);
        if (!st.ok()) done(st);
      }
      Status read;
      {
        std::unique_lock g(latch.mu);
        latch.cv.wait(g, [&] { return latch.pending == 0; });
        read = latch.status;
      }
      if (read.ok()) base = read_buf;
      if (!read.ok()) {
        std::lock_guard lock(core.mu);
        save_free(s, read_buf, p.bytes);
        return read;
      }
    }
    for (std::size_t i = 0; i < fam.tensors.size(); ++i) {
      const TensorSlot& ts = core.layout.slots[fam.tensors[i]];
      entries[i]["states"][std::string(state_kind_name(p.kind))] = {
          {"dtype", std::string(runtime::dtype_name(dtype))}, {"offset", w.size()}};
      w.append(base + ts.offset_elems * esize, ts.numel * esize);
    }
    if (read_buf != nullptr) {
      std::lock_guard lock(core.mu);
      save_free(s, read_buf, p.bytes);
    }
  }
  return Status::Ok();
}

static Status publish_manifest(Core& core, CheckpointSave& s, json files, json tensors, std::uint64_t total);

//! The save thread: captures and writes every family, then publishes (Note [Overlapped save]).
static Status run_save(Runtime::Impl& m, CheckpointSave& s) {
  Core& core = m.core;
  const std::size_t families = s.stage.size();
  json files = json::array();
  std::vector<json> file_entries(families);
  std::vector<json> tensor_entries(core.tensors.size());
  std::uint64_t total = 0;
  StripeSink sink;                     // its jobs keep their files open until written
  std::vector<StripedWriter> writers;  // fsynced together once all are written
  std::vector<json> files_by_family(families);
  for (std::size_t written = 0; written < s.owned; ++written) {
    // Captures ahead, in backward order, what the room holds (one family per lock hold),
    // so the training thread finds its families captured and copies nothing itself.
    for (FamilyId g = families; g-- > 0 && !s.blocking;) {
      std::unique_lock lock(core.mu);
      if (s.stage[g] != CheckpointSave::Stage::kPending) continue;
      STRATA_ASSIGN_OR_RETURN(const bool captured, capture_family(m, s, g, /*force=*/false));
      if (!captured) break;
    }
    FamilyId f = 0;
    {
      std::unique_lock lock(core.mu);
      // Captured ones first; then a held-back one; then in backward order.
      std::optional<FamilyId> pick;
      for (FamilyId g = 0; g < families && !pick; ++g) {
        if (s.stage[g] == CheckpointSave::Stage::kCaptured) pick = g;
      }
      for (FamilyId g = 0; g < families && !pick; ++g) {
        if (s.held[g]) pick = g;
      }
      for (FamilyId g = families; g-- > 0 && !pick;) {
        if (s.stage[g] == CheckpointSave::Stage::kPending) pick = g;
      }
      STRATA_CHECK(pick.has_value());
      f = *pick;
      if (s.stage[f] == CheckpointSave::Stage::kPending) {
        STRATA_ASSIGN_OR_RETURN(const bool captured, capture_family(m, s, f, /*force=*/true));
        STRATA_CHECK(captured);
      }
    }
    const std::string name = fmt::format("family-{}.g{}.bin", f, s.generation);
    STRATA_ASSIGN_OR_RETURN(StripedWriter w, StripedWriter::open(s.root / name, sink));
    const FamilyLayout& fam = core.layout.families[f];
    std::vector<json> entries(fam.tensors.size());
    STRATA_RETURN_IF_ERROR(write_family(core, s, f, w, entries));
    {
      std::unique_lock lock(core.mu);
      release_pieces(core, s.pieces[f], s);
      s.stage[f] = CheckpointSave::Stage::kWritten;
      // Room freed: held-back updates whose copies fit now are captured and launched.
      for (FamilyId g = 0; g < families; ++g) {
        if (s.held[g] && s.stage[g] == CheckpointSave::Stage::kPending) {
          STRATA_ASSIGN_OR_RETURN(const bool captured, capture_family(m, s, g, /*force=*/false));
          if (!captured) break;
        }
      }
      core.cv.notify_all();
    }
    const std::uint64_t bytes = w.size();
    w.finish();
    total += bytes;
    files_by_family[f] = {{"name", name}, {"bytes", bytes}, {"crc32c", w.crcs()}};
    writers.push_back(std::move(w));
    if (writers.size() == kWritersOpenMax) STRATA_RETURN_IF_ERROR(publish_all(sink, writers));
    for (std::size_t i = 0; i < fam.tensors.size(); ++i) {
      json e = s.tensors_meta[fam.tensors[i]];
      e["states"] = std::move(entries[i]["states"]);
      tensor_entries[fam.tensors[i]] = std::move(e);
    }
  }
  STRATA_RETURN_IF_ERROR(publish_all(sink, writers));
  if (s.sharded) {  // rank 0 publishes the manifest (Note [Sharded checkpoint])
    for (FamilyId f = 0; f < families; ++f) {
      if (!core.owns(f)) continue;
      json e = std::move(files_by_family[f]);
      e["family"] = f;
      s.shard_files.push_back(std::move(e));
      for (TensorId id : core.layout.families[f].tensors)
        s.shard_tensors.push_back({{"id", id}, {"entry", std::move(tensor_entries[id])}});
    }
    return fsync_dir(s.root);
  }
  for (json& f : files_by_family) files.push_back(std::move(f));
  json tensors = json::array();
  // In family order, as a blocking save wrote them (the manifest is the same whatever the capture order).
  for (const FamilyLayout& fam : core.layout.families) {
    for (TensorId id : fam.tensors) tensors.push_back(std::move(tensor_entries[id]));
  }
  return publish_manifest(core, s, std::move(files), std::move(tensors), total);
}

//! Writes, fsyncs and renames the manifest (the data files are published), then
//! removes what no manifest names (Note [Checkpoint publish]).
static Status publish_manifest(Core& core, CheckpointSave& s, json files, json tensors, std::uint64_t total) {
  StripeSink sink;
  const std::size_t families = files.size();
  const json manifest = {{"format", kFormatName},
                         {"version", kFormatVersion},
                         {"generation", s.generation},
                         {"step", s.step_index},
                         {"stripe_bytes", kStripeBytes},
                         {"compute_dtype", std::string(runtime::dtype_name(core.opt.compute_dtype))},
                         {"state_dtype", std::string(runtime::dtype_name(core.opt.state_dtype))},
                         {"state_count", core.state_count},
                         {"optimizer", std::string(kernels::optimizer_name(core.opt.hyper.optimizer))},
                         {"ranks", core.dp_ranks()},
                         {"files", std::move(files)},
                         {"tensors", std::move(tensors)},
                         {"groups", s.groups}};
  STRATA_RETURN_IF_ERROR(fsync_dir(s.root));
  {
    const std::string text = manifest.dump(1);
    STRATA_ASSIGN_OR_RETURN(StripedWriter w, StripedWriter::open(s.root / kManifestName, sink));
    w.append(reinterpret_cast<const std::byte*>(text.data()), text.size());
    w.finish();
    std::vector<StripedWriter> one;
    one.push_back(std::move(w));
    STRATA_RETURN_IF_ERROR(publish_all(sink, one));
  }
  STRATA_RETURN_IF_ERROR(fsync_dir(s.root));

  // Published: remove what no manifest names (older generations, a crashed save's temporaries).
  const std::string suffix = fmt::format(".g{}.bin", s.generation);
  std::size_t removed = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(s.root, ec)) {
    const std::string fname = entry.path().filename().string();
    const bool ours = fname.starts_with("family-") || fname == std::string(kManifestName) + ".tmp";
    const bool current = fname.starts_with("family-") && fname.ends_with(suffix);
    if (ours && !current && fs::remove(entry.path(), ec)) ++removed;
  }
  STRATA_LOG_DEBUG(
      "checkpoint: {} generation {} ({} bytes, {} files) in {:.3f} s; {} stale files removed; buffers held "
      "at most {} bytes",
      s.root.string(), s.generation, total, families, (core.timeline.now_us() - s.t0) * 1e-6, removed,
      s.high_water);
  return Status::Ok();
}

bool Runtime::Impl::checkpoint_allows_update(FamilyId f) {
  CheckpointSave* s = checkpoint.get();
  if (s == nullptr || s->done || s->stage[f] == CheckpointSave::Stage::kCaptured ||
      s->stage[f] == CheckpointSave::Stage::kWritten)
    return true;
  if (s->held[f]) return false;
  auto captured = capture_family(*this, *s, f, /*force=*/false);
  if (captured.ok() && *captured) return true;
  if (!captured.ok()) {
    // The save thread captures it again (and reports the error if it persists).
    STRATA_LOG_DEBUG("checkpoint: capturing family {} on the training thread: {}", f,
                     captured.status().to_string());
  }
  s->held[f] = true;
  ++s->held_count;
  core.cv.notify_all();
  return false;
}

Status Runtime::Impl::checkpoint_capture_for_update(std::unique_lock<std::mutex>& lock, FamilyId f) {
  std::shared_ptr<CheckpointSave> s = checkpoint;
  if (s == nullptr) return Status::Ok();
  bool updates = false;
  for (TensorId t : core.layout.families[f].tensors)
    updates = updates || (core.tensors[t].grad_written && !core.tensors[t].spec.frozen);
  if (!updates) return Status::Ok();
  while (!s->done && s->stage[f] == CheckpointSave::Stage::kPending) {
    auto captured = capture_family(*this, *s, f, /*force=*/false);
    if (!captured.ok() || *captured) return captured.status();
    core.cv.wait(lock);  // the save thread frees room as it writes
  }
  return Status::Ok();
}

Status Runtime::Impl::checkpoint_wait_captured(std::unique_lock<std::mutex>& lock, bool every_family) {
  std::shared_ptr<CheckpointSave> s = checkpoint;
  if (s == nullptr) return Status::Ok();
  core.cv.wait(lock,
               [&] { return s->done || (s->held_count == 0 && (!every_family || s->uncaptured == 0)); });
  return Status::Ok();
}

Status Runtime::Impl::checkpoint_finish(std::unique_lock<std::mutex>& lock) {
  std::shared_ptr<CheckpointSave> s = checkpoint;  // kept while it runs: its holds stay in force
  if (s == nullptr) return Status::Ok();
  lock.unlock();
  if (s->thread.joinable()) s->thread.join();
  lock.lock();
  if (checkpoint == s) checkpoint.reset();
  return s->status;
}

//! Starts a save (Note [Overlapped save]); `background`: its threads run at kSaveNice
//! (begin_checkpoint: training runs beside it), not for save_checkpoint, which waits.
static Status begin_save(Runtime::Impl& m, const std::string& dir, bool background) {
  std::unique_lock lock(m.core.mu);
  InvariantCheck check(m, &lock);
  const bool sharded = m.core.dp_ranks() > 1;
  if (sharded && background) {
    // The same answer on every rank, so no rank waits in a collective for it.
    return failed_precondition(
        "begin_checkpoint({}): this runtime is rank {} of {} (data parallelism); an overlapped save is not "
        "implemented for data-parallel ranks (its agreement would interleave with the step's collectives); "
        "call save_checkpoint on every rank instead (Note [Sharded checkpoint])",
        dir, m.core.dp_rank(), m.core.dp_ranks());
  }
  auto s = std::make_shared<CheckpointSave>();
  // Everything that can fail on one rank alone happens before the ranks agree
  // (Note [Sharded checkpoint]): after that, only collectives and the save thread.
  auto prepare = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(m.checkpoint_finish(lock));
    STRATA_ASSIGN_OR_RETURN(s->root, checkpoint_dir(m.core, dir, "save_checkpoint"));
    const fs::path& root = s->root;
    if (m.leases_out > 0)
      return failed_precondition("save_checkpoint({}) while leases are held", root.string());
    std::error_code ec;
    fs::create_directories(root, ec);
    if (ec) {
      return errno_status(
          ec.value(),
          fmt::format("save_checkpoint: creating {} (choose a writable directory)", root.string()));
    }
    STRATA_RETURN_IF_ERROR(m.finalize(lock));
    STRATA_RETURN_IF_ERROR(m.pipeline.wait_all(lock));
    STRATA_RETURN_IF_ERROR(m.core.background_error);
    // Note [Checkpoint publish]: the new files carry the next generation, so the
    // published manifest's files are never written.
    // Past every generation in the directory too: a manifest this build cannot read (a
    // newer format) still has its files kept.
    s->generation = 1;
    if (auto prev = read_manifest(root); prev.ok())
      s->generation = prev->value("generation", std::int64_t{0}) + 1;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      const std::string fname = entry.path().filename().string();
      const auto g = fname.find(".g");
      // Temporaries are never named by a manifest (and another rank's probe may be one).
      if (!fname.starts_with("family-") || fname.ends_with(".tmp") || g == std::string::npos) continue;
      s->generation = std::max<std::int64_t>(s->generation, std::atoll(fname.c_str() + g + 2) + 1);
    }
    // A file that cannot be created fails here, at once (a read-only directory).
    const fs::path probe = root / fmt::format("family-{}.g{}.bin.tmp", m.core.dp_rank(), s->generation);
    Fd fd(::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) {
      return errno_status(errno, fmt::format("save_checkpoint: creating {} (the checkpoint directory must be "
                                             "writable by this process)",
                                             probe.string()));
    }
    return Status::Ok();
  };
  if (!sharded) {
    STRATA_RETURN_IF_ERROR(prepare());
  } else {
    STRATA_RETURN_IF_ERROR(m.dp_all_ok(lock, prepare(), "save_checkpoint"));
    // Params are written by their owner: they must be rank 0's initial values if
    // no step has run yet (Note [Sharded step]).
    STRATA_RETURN_IF_ERROR(m.dp_broadcast_initial(lock));
    // One generation for every rank's files: the largest any rank found.
    STRATA_ASSIGN_OR_RETURN(s->generation, m.dp_max(lock, s->generation));
  }
  s->t0 = m.core.timeline.now_us();
  const std::size_t families = m.core.layout.families.size();
  s->nvme = m.core.nvme;
  s->stage.assign(families, CheckpointSave::Stage::kPending);
  s->held.assign(families, false);
  s->pieces.resize(families);
  s->sharded = sharded;
  for (FamilyId f = 0; f < families; ++f) {
    if (m.core.owns(f)) {
      ++s->owned;
    } else {  // another rank's (Note [Sharded checkpoint]): nothing to capture or write here
      s->stage[f] = CheckpointSave::Stage::kWritten;
    }
  }
  s->uncaptured = s->owned;
  for (FamilyId f = 0; f < families; ++f) s->kinds.push_back(family_kinds(m.core, f));
  s->tensors_meta = json::array();
  std::vector<FamilyId> family_of(m.core.tensors.size(), 0);
  for (FamilyId f = 0; f < families; ++f) {
    for (TensorId id : m.core.layout.families[f].tensors) family_of[id] = f;
  }
  for (TensorId id = 0; id < m.core.tensors.size(); ++id) {
    const TensorInfo& info = m.core.tensors[id];
    s->tensors_meta.push_back({{"name", info.spec.name},
                               {"shape", info.spec.shape},
                               {"frozen", info.spec.frozen},
                               {"steps", info.updates},
                               {"group", info.group},
                               {"file", family_of[id]}});
  }
  for (std::size_t g = 0; g < m.core.groups.size(); ++g) {
    if (m.core.groups[g].set) {
      s->groups.push_back(
          {{"group", g}, {"lr", m.core.groups[g].lr}, {"weight_decay", m.core.groups[g].weight_decay}});
    }
  }
  s->step_index = static_cast<std::int64_t>(m.tracker.step_index());
  s->room = m.core.host->budget_bytes() / kSaveRoomDivisor;
  s->blocking = !background;
  m.checkpoint = s;
  s->thread = std::thread([&m, s = s.get(), background] {
    // Background work: the save (and its writer thread, which inherits this) yields the
    // CPU to training's optimizer and copies (Linux nice is per thread).
    if (background && ::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), kSaveNice) != 0)
      STRATA_LOG_DEBUG("checkpoint: setpriority of the save thread: {}", std::strerror(errno));
    Status st = run_save(m, *s);
    std::lock_guard guard(m.core.mu);
    if (!st.ok()) {
      STRATA_LOG_WARN("checkpoint: the save into {} failed (the published checkpoint is untouched): {}",
                      s->root.string(), st.to_string());
      release_all_holds(m, *s);
    }
    for (auto& pieces : s->pieces) release_pieces(m.core, pieces, *s);
    s->status = std::move(st);
    s->done = true;
    m.core.cv.notify_all();
  });
  return Status::Ok();
}

Status Runtime::begin_checkpoint(const std::string& dir) {
  return begin_save(*impl_, dir, /*background=*/true);
}

Status Runtime::finish_checkpoint() {
  Impl& m = *impl_;
  std::unique_lock lock(m.core.mu);
  InvariantCheck check(m, &lock);
  return m.checkpoint_finish(lock);
}

Result<bool> Runtime::checkpoint_in_flight() {
  Impl& m = *impl_;
  std::lock_guard lock(m.core.mu);
  if (m.checkpoint == nullptr) return false;
  if (!m.checkpoint->done) return true;
  STRATA_RETURN_IF_ERROR(m.checkpoint->status);
  return false;
}

Status Runtime::save_checkpoint(const std::string& dir) {
  STRATA_RETURN_IF_ERROR(begin_save(*impl_, dir, /*background=*/false));
  Impl& m = *impl_;
  if (m.core.dp_ranks() == 1) return finish_checkpoint();
  // Note [Sharded checkpoint]: every rank's files are written, fsynced and renamed;
  // the ranks agree, rank 0 publishes the manifest, and a last agreement returns
  // rank 0's outcome on every rank once the manifest is durable.
  std::unique_lock lock(m.core.mu);
  InvariantCheck check(m, &lock);
  std::shared_ptr<CheckpointSave> s = m.checkpoint;
  Status written = m.checkpoint_finish(lock);
  STRATA_RETURN_IF_ERROR(m.dp_all_ok(lock, std::move(written), "save_checkpoint (writing the files)"));
  const json mine = {{"files", std::move(s->shard_files)}, {"tensors", std::move(s->shard_tensors)}};
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> all, m.dp_exchange_text(lock, mine.dump()));
  Status published = Status::Ok();
  if (m.core.dp_rank() == 0) {
    const std::size_t families = m.core.layout.families.size();
    json files = json::array();
    std::vector<json> by_family(families);
    std::vector<json> tensor_entries(m.core.tensors.size());
    std::uint64_t total = 0;
    try {
      for (const std::string& text : all) {
        const json part = json::parse(text);
        for (const json& f : part.at("files")) {
          const auto family = f.at("family").get<std::size_t>();
          STRATA_CHECK(family < families);
          total += f.at("bytes").get<std::uint64_t>();
          by_family[family] = {{"name", f.at("name")}, {"bytes", f.at("bytes")}, {"crc32c", f.at("crc32c")}};
        }
        for (const json& t : part.at("tensors"))
          tensor_entries.at(t.at("id").get<std::size_t>()) = t.at("entry");
      }
    } catch (const json::exception& e) {
      published = internal_error("save_checkpoint: a rank's file list is malformed: {}", e.what());
    }
    for (FamilyId f = 0; f < families && published.ok(); ++f) {
      if (by_family[f].is_null()) {
        published = internal_error("save_checkpoint: no rank wrote family {} (its owner is rank {})", f,
                                   f % static_cast<FamilyId>(m.core.dp_ranks()));
        break;
      }
      files.push_back(std::move(by_family[f]));
    }
    json tensors = json::array();
    for (const FamilyLayout& fam : m.core.layout.families) {
      for (TensorId id : fam.tensors) tensors.push_back(std::move(tensor_entries[id]));
    }
    if (published.ok()) published = publish_manifest(m.core, *s, std::move(files), std::move(tensors), total);
  }
  return m.dp_all_ok(lock, std::move(published), "save_checkpoint (publishing the manifest on rank 0)");
}

namespace checkpoint_testing {
std::function<void(const std::string&)> after_verify;
}  // namespace checkpoint_testing

Status Runtime::load_checkpoint(const std::string& dir) {
  Impl& m = *impl_;
  std::unique_lock lock(m.core.mu);
  InvariantCheck check(m, &lock);
  fs::path root;
  json manifest;
  std::string mpath;
  // Everything is checked before any state changes (Note [Checkpoint format]).
  struct Source {
    std::uint32_t file = 0;
    std::uint64_t offset[kStateKindCount] = {};
    DType dtype[kStateKindCount] = {};
    bool has[kStateKindCount] = {};
    std::int64_t steps = 0;
    std::uint32_t group = 0;
  };
  std::vector<Source> src(m.core.tensors.size());
  std::vector<bool> seen(m.core.tensors.size(), false);
  std::vector<fs::path> file_paths;
  std::vector<std::uint64_t> file_bytes;
  std::vector<std::pair<std::uint32_t, GroupHyper>> groups;
  std::vector<Fd> fds;                // the verified files, read by the apply pass
  std::vector<struct stat> verified;  // as they were when verified
  // Everything a rank may find wrong on its own is found before the ranks agree
  // (Note [Sharded checkpoint]): no rank applies anything unless every rank can.
  auto prepare = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(root, checkpoint_dir(m.core, dir, "load_checkpoint"));
    if (m.leases_out > 0)
      return failed_precondition("load_checkpoint({}) while leases are held", root.string());
    STRATA_RETURN_IF_ERROR(m.finalize(lock));
    STRATA_RETURN_IF_ERROR(m.pipeline.wait_all(lock));
    STRATA_RETURN_IF_ERROR(m.checkpoint_wait_captured(lock, /*every_family=*/true));
    // Params already gathered must not overwrite what is loaded (Note [Sharded checkpoint]).
    STRATA_RETURN_IF_ERROR(m.dp_finish_all_gathers(lock));
    STRATA_ASSIGN_OR_RETURN(manifest, read_manifest(root));
    mpath = (root / kManifestName).string();

    try {
      const auto stripe = manifest.at("stripe_bytes").get<std::uint64_t>();
      if (stripe == 0) return corrupt("load_checkpoint: {} has stripe_bytes 0", mpath);
      const auto state_count = manifest.at("state_count").get<std::uint32_t>();
      if (state_count != m.core.state_count) {
        return failed_precondition(
            "load_checkpoint: {} holds {} optimizer state(s) per element (optimizer {}), this runtime's "
            "optimizer "
            "{} keeps {}; load it with the optimizer it was saved with",
            mpath, state_count, manifest.value("optimizer", std::string("?")),
            kernels::optimizer_name(m.core.opt.hyper.optimizer), m.core.state_count);
      }
      for (const json& f : manifest.at("files")) {
        file_paths.push_back(root / f.at("name").get<std::string>());
        file_bytes.push_back(f.at("bytes").get<std::uint64_t>());
      }
      const json& tensors = manifest.at("tensors");
      if (tensors.size() != m.core.tensors.size()) {
        return failed_precondition(
            "load_checkpoint: {} holds {} tensors, this runtime has {} registered: it is another model's "
            "checkpoint",
            mpath, tensors.size(), m.core.tensors.size());
      }
      for (const json& t : tensors) {
        const auto name = t.at("name").get<std::string>();
        auto it = m.core.by_name.find(name);
        if (it == m.core.by_name.end()) {
          return failed_precondition(
              "load_checkpoint: {} holds tensor \"{}\", which this runtime has not registered: it is another "
              "model's checkpoint",
              mpath, name);
        }
        const TensorInfo& info = m.core.tensors[it->second];
        const auto shape = t.at("shape").get<std::vector<std::int64_t>>();
        if (shape != info.spec.shape) {
          return failed_precondition("load_checkpoint: {}: tensor \"{}\" has shape [{}] there, [{}] here",
                                     mpath, name, fmt::join(shape, ", "), fmt::join(info.spec.shape, ", "));
        }
        Source& s = src[it->second];
        seen[it->second] = true;
        s.file = t.at("file").get<std::uint32_t>();
        if (s.file >= file_paths.size())
          return corrupt("load_checkpoint: {}: tensor \"{}\" names file {} of {}", mpath, name, s.file,
                         file_paths.size());
        s.steps = t.at("steps").get<std::int64_t>();
        s.group = t.at("group").get<std::uint32_t>();
        if (s.steps < 0 || s.group >= 65536)
          return corrupt("load_checkpoint: {}: tensor \"{}\" has a bad step counter or group", mpath, name);
        for (const auto& [kname, st] : t.at("states").items()) {
          const auto kind = kind_from_name(kname);
          if (!kind)
            return corrupt("load_checkpoint: {}: tensor \"{}\" has unknown state \"{}\"", mpath, name, kname);
          const auto k = static_cast<std::size_t>(*kind);
          STRATA_ASSIGN_OR_RETURN(s.dtype[k], parse_dtype(st.at("dtype").get<std::string>()));
          s.offset[k] = st.at("offset").get<std::uint64_t>();
          s.has[k] = true;
          if (s.offset[k] + info.numel * dtype_bytes(s.dtype[k]) > file_bytes[s.file]) {
            return corrupt("load_checkpoint: {}: tensor \"{}\" {} lies past the end of {}", mpath, name,
                           kname, file_paths[s.file].string());
          }
        }
        if (!s.has[static_cast<std::size_t>(StateKind::kParam)])
          return corrupt("load_checkpoint: {}: tensor \"{}\" has no param", mpath, name);
      }
      for (TensorId id = 0; id < seen.size(); ++id) {
        if (!seen[id]) {
          return failed_precondition(
              "load_checkpoint: {} lacks tensor \"{}\": it is another model's checkpoint", mpath,
              m.core.tensors[id].spec.name);
        }
      }
      // The states this runtime keeps must all be there (the optimizer's states of trainable tensors).
      for (FamilyId f = 0; f < m.core.layout.families.size(); ++f) {
        for (StateKind k : family_kinds(m.core, f)) {
          if (k == StateKind::kParam || k == StateKind::kMaster) continue;
          for (TensorId id : m.core.layout.families[f].tensors) {
            if (!src[id].has[static_cast<std::size_t>(k)] && !m.core.tensors[id].spec.frozen) {
              return failed_precondition("load_checkpoint: {}: tensor \"{}\" has no {} there", mpath,
                                         m.core.tensors[id].spec.name, state_kind_name(k));
            }
          }
        }
      }
      for (const json& g : manifest.value("groups", json::array())) {
        const auto group = g.at("group").get<std::uint32_t>();
        const GroupHyper h{
            .set = true, .lr = g.at("lr").get<float>(), .weight_decay = g.at("weight_decay").get<float>()};
        if (group >= 65536 || !std::isfinite(h.lr) || h.lr < 0 || !std::isfinite(h.weight_decay) ||
            h.weight_decay < 0)
          return corrupt("load_checkpoint: {}: group {} has a bad id, lr or weight decay", mpath, group);
        groups.emplace_back(group, h);
      }
      STRATA_RETURN_IF_ERROR(verify_files(root, manifest.at("files"), stripe, &fds, &verified));
    } catch (const json::exception& e) {
      return corrupt("load_checkpoint: {} is malformed: {}", mpath, e.what());
    }

    // Apply: chunk by chunk, each tensor's bytes read from its file (converted when the
    // dtypes differ). Every tensor of the chunk is written (padding stays zero), so an
    // NVMe chunk's old value is not read first.
    if (checkpoint_testing::after_verify) checkpoint_testing::after_verify(root.string());
    // The files read are the ones verified (their descriptors); one written since
    // (its size or modification time moved) is refused before anything is applied.
    for (std::size_t i = 0; i < fds.size(); ++i) {
      struct stat now {};
      if (::fstat(fds[i].get(), &now) != 0)
        return errno_status(errno, fmt::format("load_checkpoint: stat of {}", file_paths[i].string()));
      if (now.st_size != verified[i].st_size || now.st_mtim.tv_sec != verified[i].st_mtim.tv_sec ||
          now.st_mtim.tv_nsec != verified[i].st_mtim.tv_nsec) {
        return corrupt(
            "load_checkpoint: {} was written while it was being loaded (after its CRC32C check); "
            "nothing was loaded: load it again once the writer is done",
            file_paths[i].string());
      }
    }
    return Status::Ok();
  };
  if (m.core.dp_ranks() == 1) {
    STRATA_RETURN_IF_ERROR(prepare());
  } else {
    STRATA_RETURN_IF_ERROR(m.dp_all_ok(lock, prepare(), "load_checkpoint"));
  }
  std::vector<std::byte> staging;
  for (FamilyId f = 0; f < m.core.layout.families.size(); ++f) {
    const FamilyLayout& fam = m.core.layout.families[f];
    for (StateKind k : family_kinds(m.core, f)) {
      const DType dtype = m.core.kind_dtype(k);
      const std::uint64_t esize = dtype_bytes(dtype);
      Status read = Status::Ok();
      STRATA_RETURN_IF_ERROR(m.with_host_copy(
          lock, m.core.chunk(f, k), true,
          [&](std::byte* base) {
            for (std::size_t i = 0; i < fam.tensors.size() && read.ok(); ++i) {
              const TensorId id = fam.tensors[i];
              const TensorSlot& ts = m.core.layout.slots[id];
              const Source& s = src[id];
              // A master the checkpoint lacks (saved with fp32 compute) is its param.
              auto sk = static_cast<std::size_t>(k);
              if (!s.has[sk] && k == StateKind::kMaster) sk = static_cast<std::size_t>(StateKind::kParam);
              std::byte* dst = base + ts.offset_elems * esize;
              if (!s.has[sk]) {  // a frozen tensor's optimizer state
                std::memset(dst, 0, ts.numel * esize);
                continue;
              }
              const std::uint64_t n = ts.numel * dtype_bytes(s.dtype[sk]);
              if (s.dtype[sk] == dtype) {
                read = read_all(fds[s.file].get(), dst, n, s.offset[sk], file_paths[s.file]);
              } else {
                staging.resize(n);
                read = read_all(fds[s.file].get(), staging.data(), n, s.offset[sk], file_paths[s.file]);
                if (read.ok()) convert(staging.data(), s.dtype[sk], dst, dtype, ts.numel);
              }
            }
          },
          /*whole=*/true));
      STRATA_RETURN_IF_ERROR(read);
    }
  }
  for (TensorId id = 0; id < src.size(); ++id) {
    m.core.tensors[id].updates = src[id].steps;
    m.core.tensors[id].group = src[id].group;
  }
  for (const auto& [group, h] : groups) {
    if (m.core.groups.size() <= group) m.core.groups.resize(group + 1);
    m.core.groups[group] = h;
  }
  STRATA_LOG_DEBUG("load_checkpoint: {} generation {} loaded", root.string(),
                   manifest.value("generation", json()).dump());
  return Status::Ok();
}

}  // namespace strata::runtime
