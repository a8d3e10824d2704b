// strata-probe's NVMe measurement (measure_nvme in measure.hpp): the --nvme
// directory's checks, the test size, timed write and read passes through strata's
// own IoEngine + SwapStore, and the pipeline pass.
#include <fmt/ranges.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "measure.hpp"
#include "measure_util.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/offload/io_engine.hpp"
#include "strata/offload/swap_store.hpp"

namespace strata::probe {
using namespace measure_detail;

// Note [Probe NVMe test size]
// The probe writes min(--nvme-bytes, half the free space) (whole MiB), in up to
// 16 slots of up to 16 MiB in flight: smaller slots (down to 1 MiB) and fewer in
// flight when that is less than 256 MiB, so --nvme-bytes is honoured as given
// and the size checked up front is the size used (it once wrote at least 256
// MiB whatever --nvme-bytes said, and a disk with 64-256 MiB free passed the
// first check, then failed creating the swap file). Below kNvmeTestMin (or
// --nvme-bytes, when smaller) there is too little to measure: NoSpace up front.
struct NvmeTestSize {
  std::uint64_t slot_bytes = 0;
  std::uint32_t slots = 0;
  std::size_t in_flight = 0;
};
constexpr std::uint64_t kNvmeTestMin = 16 * kMiB;

Result<NvmeTestSize> nvme_test_size(const std::string& dir, std::uint64_t bytes_max,
                                    std::uint64_t free_bytes) {
  constexpr std::uint64_t kSlotMax = 16 * kMiB;
  constexpr std::size_t kInFlightMax = 16;
  const std::uint64_t bytes = align_down(std::min(bytes_max, free_bytes / 2), kMiB);
  const std::uint64_t needed = std::min(align_down(bytes_max, kMiB), kNvmeTestMin);
  if (bytes < needed || bytes == 0) {
    return no_space(
        "--nvme {}: only {} free; the probe writes min(--nvme-bytes, half the free space) and needs at least "
        "{} of it to measure (twice that free): free space, name another directory, or lower --nvme-bytes",
        dir, format_bytes(free_bytes), format_bytes(std::max(needed, kMiB)));
  }
  NvmeTestSize t;
  t.slot_bytes = std::clamp(align_down(bytes / kInFlightMax, kMiB), kMiB, kSlotMax);
  t.slots = static_cast<std::uint32_t>(bytes / t.slot_bytes);
  t.in_flight = std::min<std::size_t>(kInFlightMax, t.slots);
  return t;
}

namespace {

// The --nvme directory's checks before anything is written: it exists, is a
// writable directory on a writable file system. Returns its free bytes.
Result<std::uint64_t> nvme_free_bytes(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return not_found("--nvme {}: no such directory; create it or name another", dir);
  if (!fs::is_directory(dir, ec)) return invalid_argument("--nvme {}: not a directory", dir);
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return errno_status(errno, fmt::format("--nvme {}: statvfs", dir));
  if ((vfs.f_flag & ST_RDONLY) != 0) {
    return permission_denied("--nvme {}: the file system is mounted read-only; name a writable directory",
                             dir);
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    return permission_denied("--nvme {}: not writable by this user; name a writable directory", dir);
  }
  return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

// What every timed NVMe pass shares: the store, the buffers' region and the limits.
struct NvmeBench {
  const std::string& dir;
  offload::SwapStore& store;
  std::byte* region = nullptr;  //!< in_flight_max buffers of slot_bytes
  std::uint64_t slot_bytes = 0;
  std::size_t in_flight_max = 0;
  double seconds_max = 0;
  const Progress& progress;
  //! Runs the pipeline pass's optimizer kernels (Note [Probe disk pipeline pass]); null: none.
  ThreadPool* pool = nullptr;
};

// op(i) says whether transfer i writes and which slot it uses.
using NvmeOp = std::function<std::pair<bool, offload::SlotId>(std::uint32_t)>;

// What a pass did: transfers, wall seconds, and the process's CPU seconds (user and
// system, every thread: the checksums, the I/O engine, the kernel's side of the I/O).
struct Pass {
  std::uint32_t transfers = 0;
  double seconds = 0;
  double cpu_seconds = 0;
};

// The scheduler's own sum over every thread (user and system), to the nanosecond;
// getrusage's figures move in ticks, coarse beside a pass of a few milliseconds.
double process_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// Writes (or reads) slots with `in_flight` transfers outstanding at all times (a
// sliding window, as the runtime's pipeline keeps its queue full) until `count`
// are done or the time is up.
Result<Pass> timed_pass(const NvmeBench& b, const NvmeOp& op, std::uint32_t count, std::string_view stage,
                        std::size_t in_flight) {
  std::mutex mu;
  std::condition_variable cv;
  std::size_t outstanding = 0;
  Status first_error;
  std::vector<std::size_t> free_buffers;
  for (std::size_t i = 0; i < b.in_flight_max; ++i) free_buffers.push_back(i);
  const auto start = Clock::now();
  const double cpu_start = process_cpu_seconds();
  std::uint32_t issued = 0;
  auto wait_below = [&](std::size_t limit) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return outstanding < limit; });
  };
  while (issued < count && (issued == 0 || since(start) < b.seconds_max)) {
    wait_below(in_flight);
    std::size_t buffer = 0;
    {
      std::lock_guard lock(mu);
      if (!first_error.ok()) break;
      buffer = free_buffers.back();
      free_buffers.pop_back();
      ++outstanding;
    }
    const auto [write, slot] = op(issued);
    std::span<std::byte> buf(b.region + buffer * b.slot_bytes, b.slot_bytes);
    auto done = [&, buffer](Status st) {
      std::lock_guard lock(mu);
      if (!st.ok() && first_error.ok()) first_error = st;
      free_buffers.push_back(buffer);
      --outstanding;
      cv.notify_all();
    };
    Status s = write ? b.store.write_async(slot, slot, buf, done) : b.store.read_async(slot, slot, buf, done);
    if (!s.ok()) {
      done(Status::Ok());
      wait_below(1);
      return s.with_context(fmt::format("--nvme {}", b.dir));
    }
    ++issued;
    report(b.progress, stage, static_cast<double>(issued) / count);
  }
  wait_below(1);
  if (!first_error.ok()) return first_error.with_context(fmt::format("--nvme {}", b.dir));
  return Pass{issued, since(start), process_cpu_seconds() - cpu_start};
}

// Note [Probe disk pipeline pass]
// The rate the step-time model charges the disk as a whole (Rates::
// disk_mixed_bytes_per_s, Note [Step-time model]) is measured the way the
// runtime's optimizer pipeline uses the disk (Note [Pipeline places] in
// optimizer_pipeline.cpp): kPipelinePlaces families in flight, each
// reading its kPipelinePieces state pieces together and waiting for them,
// running AdamW over them on a pool of the host's cores (as the runtime's kernel
// runs between a family's read and its write-back), then writing them to other
// slots and waiting again before its next family. The pass used to keep four
// reads and writes interleaved in flight at all times, one sweep of the file:
// on this sandbox's virtio disk it measured 1.0-2.0 GiB/s where the runtime's
// pipeline got 0.6-0.8 GiB/s, because a queue that never drains is not what the
// pipeline gives the disk (each place drains between its read, its kernel and
// its write, and every hop is a thread wake-up), and one sweep of the tests'
// 64 MiB file took ~50 ms, so its rate swung 2x between identical runs. So this
// pass keeps the pipeline's shape and repeats its sweep for kPipelineMinSeconds
// (or --nvme-seconds, when shorter). With it and Note [NVMe pipeline window] in
// cost_model.cpp, optim-nvme at 24M params went from a median ratio of 1.91
// (1.16-2.17) to 1.15 (0.96-1.42), five runs each at load average 5-7 on 2 cores
// (scripts/probe-accuracy; docs/probe.md has every configuration).
constexpr std::size_t kPipelinePlaces = 2;  // PlanOptions::nvme_families_in_flight's default
constexpr std::size_t kPipelinePieces = 2;  // AdamW's two states
constexpr double kPipelineMinSeconds = 0.5;

// Waits until `n` transfers issued with `done()` have completed; the first error.
class Countdown {
 public:
  std::function<void(Status)> done() {
    {
      std::lock_guard lock(mu_);
      ++pending_;
    }
    return [this](Status st) {
      std::lock_guard lock(mu_);
      if (!st.ok() && first_error_.ok()) first_error_ = st;
      --pending_;
      cv_.notify_all();
    };
  }
  Status wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return pending_ == 0; });
    return first_error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::size_t pending_ = 0;
  Status first_error_;
};

// AdamW over one family's states as the runtime's kernel runs it between their
// read and their write-back: `m` and `v` are the pieces read.
struct PipelineKernel {
  explicit PipelineKernel(std::size_t n) : master(n, 0.5f), grad(n, 1e-3f) {}
  Status run(ThreadPool& pool, std::byte* m, std::byte* v, std::uint64_t step) {
    kernels::Span span;
    span.master = master.data();
    span.grad = grad.data();
    span.state = {m, v};
    span.n = master.size();
    kernels::StepArgs args;
    args.hyper.optimizer = kernels::Optimizer::kAdamW;
    args.spans = std::span<const kernels::Span>(&span, 1);
    args.pool = &pool;
    args.step = step;
    return on_pool(pool, [&]() -> Status { return kernels::step(args).status(); });
  }
  std::vector<float> master, grad;
};

// One place of the pipeline pass: families `place`, `place + places`, ... until
// `stop()`; each reads `pieces` slots of the first half, runs the optimizer over
// them (two pieces: its states), then writes them to the second. Returns the
// bytes moved.
Result<std::uint64_t> pipeline_place(const NvmeBench& b, std::size_t place, std::size_t places,
                                     std::size_t pieces, std::uint32_t half,
                                     const std::function<bool(std::uint64_t)>& stop) {
  std::uint64_t moved = 0;
  std::byte* buffers = b.region + place * pieces * b.slot_bytes;
  PipelineKernel kernel(b.pool != nullptr && pieces == 2 ? b.slot_bytes / sizeof(float) : 0);
  for (std::uint64_t family = place; !stop(family); family += places) {
    for (bool write : {false, true}) {
      if (write && !kernel.master.empty()) {
        Status s = kernel.run(*b.pool, buffers, buffers + b.slot_bytes, family / places + 1);
        if (!s.ok()) return s.with_context(fmt::format("--nvme {}: the pipeline pass's optimizer", b.dir));
      }
      Countdown io;
      for (std::size_t j = 0; j < pieces; ++j) {
        const auto slot = static_cast<offload::SlotId>((family * pieces + j) % half + (write ? half : 0));
        std::span<std::byte> buf(buffers + j * b.slot_bytes, b.slot_bytes);
        Status s = write ? b.store.write_async(slot, slot, buf, io.done())
                         : b.store.read_async(slot, slot, buf, io.done());
        if (!s.ok()) {
          (void)io.wait();
          return s.with_context(fmt::format("--nvme {}", b.dir));
        }
      }
      if (Status s = io.wait(); !s.ok()) return s.with_context(fmt::format("--nvme {}", b.dir));
      moved += pieces * b.slot_bytes;
    }
  }
  return moved;
}

// Note [Probe disk pipeline pass]: bytes read + written a second, and the bytes a
// family moves each way per hop.
Result<std::pair<double, std::uint64_t>> pipeline_pass(const NvmeBench& b, std::uint32_t slots) {
  const std::uint32_t half = std::max<std::uint32_t>(slots / 2, 1);
  if (slots < 2) return internal_error("--nvme {}: the pipeline pass needs 2 slots, has {}", b.dir, slots);
  const std::size_t pieces = std::clamp<std::size_t>(half / kPipelinePlaces, 1, kPipelinePieces);
  const std::size_t places = std::min<std::size_t>(kPipelinePlaces, b.in_flight_max / pieces);
  const double min_s = std::min(kPipelineMinSeconds, b.seconds_max);
  const std::uint64_t families = std::max<std::uint64_t>(half / pieces, places);  // one sweep of the half
  const auto start = Clock::now();
  auto stop = [&](std::uint64_t family) {
    const double t = since(start);
    return t >= b.seconds_max || (family >= families && t >= min_s);
  };
  std::vector<std::future<Result<std::uint64_t>>> runs;
  for (std::size_t p = 0; p < places; ++p) {
    runs.push_back(
        std::async(std::launch::async, [&, p] { return pipeline_place(b, p, places, pieces, half, stop); }));
  }
  std::uint64_t moved = 0;
  Status first_error;
  for (auto& r : runs) {
    Result<std::uint64_t> m = r.get();
    if (!m.ok() && first_error.ok()) first_error = m.status();
    if (m.ok()) moved += *m;
  }
  if (!first_error.ok()) return first_error;
  report(b.progress, "nvme pipeline", 1.0);
  return std::pair{static_cast<double>(moved) / since(start), std::uint64_t{pieces} * b.slot_bytes};
}

std::vector<double> scaled(std::vector<double> v) {
  for (double& x : v) x /= static_cast<double>(kGiB);
  return v;
}

// Note [Probe disk rounds]
// A disk shared with other work moves from one pass to the next: on this project's
// machine the read pass gave 1.24 to 2.04 GiB/s in four probe runs a few seconds
// apart (2026-12-06), and the 3.2 B prediction moved from 31.7 to 46.9 s with it.
// So the write, read and pipeline passes run kDiskRounds times, in turn, and each
// rate is the median of its rounds: one slow pass no longer decides the prediction.
// Each pass is still bounded by --nvme-seconds. Six runs afterwards gave 30.3 to
// 33.2 s, the rounds of one run differing by up to 10 % (a debug log line lists
// them); not interleaved with the old probe, so part of that may be a quieter disk.
// What the median cannot remove is a disk that is slower for a whole run.
constexpr int kDiskRounds = 3;

// The passes over every slot: a warm-up write, then kDiskRounds rounds of timed write
// and read passes and the pipeline pass (Note [Probe disk pipeline pass]), into `info`.
Status nvme_passes(const NvmeBench& b, std::uint32_t slots, NvmeInfo& info) {
  for (std::uint32_t i = 0; i < slots; ++i) {
    STRATA_ASSIGN_OR_RETURN(offload::SlotId s, b.store.allocate());
    STRATA_CHECK(s < slots);
  }
  // The first pass writes fresh (fallocated, unwritten) extents, which costs the
  // file system extent conversions the runtime's steady state never pays: it
  // rewrites its slots. So the first pass is a warm-up and the second is timed.
  auto write_op = [](std::uint32_t i) { return std::pair{true, i}; };
  auto read_op = [](std::uint32_t i) { return std::pair{false, i}; };
  STRATA_ASSIGN_OR_RETURN(Pass warm, timed_pass(b, write_op, slots, "nvme warm-up", b.in_flight_max));
  std::vector<double> write_rates, read_rates, mixed_rates;
  double cpu_seconds = 0, bytes_moved = 0;
  for (int round = 0; round < kDiskRounds; ++round) {
    STRATA_ASSIGN_OR_RETURN(Pass written,
                            timed_pass(b, write_op, warm.transfers, "nvme write", b.in_flight_max));
    STRATA_ASSIGN_OR_RETURN(Pass read,
                            timed_pass(b, read_op, written.transfers, "nvme read", b.in_flight_max));
    STRATA_ASSIGN_OR_RETURN(auto mixed, pipeline_pass(b, slots));
    const double written_bytes = static_cast<double>(std::uint64_t{written.transfers} * b.slot_bytes);
    const double read_bytes = static_cast<double>(std::uint64_t{read.transfers} * b.slot_bytes);
    write_rates.push_back(written_bytes / written.seconds);
    read_rates.push_back(read_bytes / read.seconds);
    mixed_rates.push_back(mixed.first);
    info.mixed_family_bytes = mixed.second;
    if (round == 0) info.bytes_tested = std::uint64_t{written.transfers} * b.slot_bytes;
    cpu_seconds += written.cpu_seconds + read.cpu_seconds;
    bytes_moved += written_bytes + read_bytes;
  }
  STRATA_LOG_DEBUG("probe: nvme rounds (GiB/s): write {:.3f}, read {:.3f}, pipeline {:.3f}",
                   fmt::join(scaled(write_rates), " "), fmt::join(scaled(read_rates), " "),
                   fmt::join(scaled(mixed_rates), " "));
  info.write_bytes_per_s = median3(write_rates);
  info.read_bytes_per_s = median3(read_rates);
  info.mixed_bytes_per_s = median3(mixed_rates);
  // Note [Host cores as a resource]: what a disk byte costs the host's cores.
  info.cpu_seconds_per_byte = cpu_seconds / bytes_moved;
  return Status::Ok();
}

}  // namespace

Result<NvmeInfo> measure_nvme(const std::string& dir, std::uint64_t bytes_max, double seconds_max,
                              std::size_t optimizer_threads, const Progress& progress) {
  NvmeInfo info;
  info.path = dir;
  STRATA_ASSIGN_OR_RETURN(info.free_bytes, nvme_free_bytes(dir));
  // Note [Probe NVMe test size]: what is checked here is what is written.
  STRATA_ASSIGN_OR_RETURN(const NvmeTestSize size, nvme_test_size(dir, bytes_max, info.free_bytes));

  // One region for every in-flight buffer, registered with io_uring as fixed
  // buffers, as the runtime registers its pinned host region.
  AlignedBuffer region(size.slot_bytes * size.in_flight);
  // Small normal floats: the pipeline pass runs AdamW over what it reads back.
  for (std::size_t b = 0; b + sizeof(float) <= region.size; b += sizeof(float)) {
    const float v = 1e-3f * static_cast<float>(1 + (b / sizeof(float)) % 97);
    std::memcpy(region.data + b, &v, sizeof(float));
  }
  offload::IoEngineOptions eo;
  eo.fixed_buffer_regions = {std::span<std::byte>(region.data, region.size)};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::IoEngine> engine, offload::make_io_engine(eo));
  info.engine = std::string(engine->name());
  auto store = offload::SwapStore::create(
      *engine, {.dirs = {fs::path(dir)}, .slot_bytes = size.slot_bytes, .slots = size.slots});
  if (!store.ok()) return Status(store.status()).with_context(fmt::format("--nvme {}", dir));
  info.direct_io = (*store)->direct_io();
  std::unique_ptr<ThreadPool> pool;
  if (optimizer_threads > 0) {
    STRATA_ASSIGN_OR_RETURN(pool, ThreadPool::create({.threads = optimizer_threads}));
  }
  const NvmeBench bench{.dir = dir,
                        .store = **store,
                        .region = region.data,
                        .slot_bytes = size.slot_bytes,
                        .in_flight_max = size.in_flight,
                        .seconds_max = seconds_max,
                        .progress = progress,
                        .pool = pool.get()};
  STRATA_RETURN_IF_ERROR(nvme_passes(bench, size.slots, info));
  store->reset();  // removes the swap file
  engine->shutdown(offload::ShutdownMode::kDrain);
  return info;
}

}  // namespace strata::probe
