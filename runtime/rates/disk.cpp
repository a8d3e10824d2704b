// The rate measurer's disk passes (RateMeasurer::measure_disk, Note [One rate
// measurer] in rate_measurer.hpp): timed write, read and mixed passes through
// strata's own IoEngine + SwapStore, in rounds, and the pipeline pass.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <ctime>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "measure_util.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/thread_pool.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/offload/io_engine.hpp"
#include "strata/offload/swap_store.hpp"
#include "strata/rates/rate_measurer.hpp"

namespace strata::rates {
using namespace detail;
namespace {

// What every timed disk pass shares: the options, the store and the buffers' region.
struct DiskBench {
  const DiskOptions& o;
  offload::SwapStore& store;
  std::byte* region = nullptr;  //!< o.in_flight buffers of o.slot_bytes
  const Progress& progress;
  //! Runs the pipeline pass's optimizer kernels (Note [Probe disk pipeline pass]); null: none.
  ThreadPool* pool = nullptr;
};

// op(i) says whether transfer i writes and which slot it uses.
using DiskOp = std::function<std::pair<bool, offload::SlotId>(std::uint32_t)>;

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

// Writes (or reads) slots with o.in_flight transfers outstanding at all times (a
// sliding window, as the runtime's pipeline keeps its queue full) until `count`
// are done or o.pass_seconds_max is up.
Result<Pass> timed_pass(const DiskBench& b, const DiskOp& op, std::uint32_t count, std::string_view stage) {
  std::mutex mu;
  std::condition_variable cv;
  std::size_t outstanding = 0;
  Status first_error;
  std::vector<std::size_t> free_buffers;
  for (std::size_t i = 0; i < b.o.in_flight; ++i) free_buffers.push_back(i);
  const auto start = Clock::now();
  const double cpu_start = process_cpu_seconds();
  std::uint32_t issued = 0;
  auto wait_below = [&](std::size_t limit) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return outstanding < limit; });
  };
  while (issued < count && (issued == 0 || since(start) < b.o.pass_seconds_max)) {
    wait_below(b.o.in_flight);
    std::size_t buffer = 0;
    {
      std::lock_guard lock(mu);
      if (!first_error.ok()) break;
      buffer = free_buffers.back();
      free_buffers.pop_back();
      ++outstanding;
    }
    const auto [write, slot] = op(issued);
    std::span<std::byte> buf(b.region + buffer * b.o.slot_bytes, b.o.slot_bytes);
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
      return s.with_context(b.o.context);
    }
    ++issued;
    report(b.progress, stage, static_cast<double>(issued) / count);
  }
  wait_below(1);
  if (!first_error.ok()) return first_error.with_context(b.o.context);
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
Result<std::uint64_t> pipeline_place(const DiskBench& b, std::size_t place, std::size_t places,
                                     std::size_t pieces, std::uint32_t half,
                                     const std::function<bool(std::uint64_t)>& stop) {
  const std::uint64_t slot_bytes = b.o.slot_bytes;
  std::uint64_t moved = 0;
  std::byte* buffers = b.region + place * pieces * slot_bytes;
  PipelineKernel kernel(b.pool != nullptr && pieces == 2 ? slot_bytes / sizeof(float) : 0);
  for (std::uint64_t family = place; !stop(family); family += places) {
    for (bool write : {false, true}) {
      if (write && !kernel.master.empty()) {
        Status s = kernel.run(*b.pool, buffers, buffers + slot_bytes, family / places + 1);
        if (!s.ok()) return s.with_context(fmt::format("{}: the pipeline pass's optimizer", b.o.context));
      }
      Countdown io;
      for (std::size_t j = 0; j < pieces; ++j) {
        const auto slot = static_cast<offload::SlotId>((family * pieces + j) % half + (write ? half : 0));
        std::span<std::byte> buf(buffers + j * slot_bytes, slot_bytes);
        Status s = write ? b.store.write_async(slot, slot, buf, io.done())
                         : b.store.read_async(slot, slot, buf, io.done());
        if (!s.ok()) {
          (void)io.wait();
          return s.with_context(b.o.context);
        }
      }
      if (Status s = io.wait(); !s.ok()) return s.with_context(b.o.context);
      moved += pieces * slot_bytes;
    }
  }
  return moved;
}

// Note [Probe disk pipeline pass]: bytes read + written a second, and the bytes a
// family moves each way per hop.
Result<std::pair<double, std::uint64_t>> pipeline_pass(const DiskBench& b) {
  const std::uint32_t half = std::max<std::uint32_t>(b.o.slots / 2, 1);
  const std::size_t pieces = std::clamp<std::size_t>(half / kPipelinePlaces, 1, kPipelinePieces);
  const std::size_t places = std::min<std::size_t>(kPipelinePlaces, b.o.in_flight / pieces);
  const double min_s = std::min(kPipelineMinSeconds, b.o.pass_seconds_max);
  const std::uint64_t families = std::max<std::uint64_t>(half / pieces, places);  // one sweep of the half
  const auto start = Clock::now();
  auto stop = [&](std::uint64_t family) {
    const double t = since(start);
    return t >= b.o.pass_seconds_max || (family >= families && t >= min_s);
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
  return std::pair{static_cast<double>(moved) / since(start), std::uint64_t{pieces} * b.o.slot_bytes};
}

// The mixed pass of options.mixed: bytes read + written a second, and the bytes a
// family moves each way per hop (0 for the interleaved pass: every family size).
Result<std::pair<double, std::uint64_t>> mixed_pass(const DiskBench& b) {
  if (b.o.mixed == MixedPass::kPipeline) return pipeline_pass(b);
  auto interleaved = [](std::uint32_t i) { return std::pair{i % 2 == 0, i}; };  // even slots written
  STRATA_ASSIGN_OR_RETURN(Pass p, timed_pass(b, interleaved, b.o.slots, "nvme mixed"));
  return std::pair{static_cast<double>(std::uint64_t{p.transfers} * b.o.slot_bytes) / p.seconds,
                   std::uint64_t{0}};
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
// (kDiskRounds is the probe's DiskOptions::rounds; strata-bench step runs its
// passes in the same rounds and takes the best of each: Note [One rate measurer].)

// The passes over every slot: the warm-up of options.warm_up, then options.rounds
// rounds of timed write, read and mixed passes, into `rates` and `facts`.
Status disk_rounds(const DiskBench& b, runtime::Rates& rates, DiskFacts& facts) {
  const std::uint32_t slots = b.o.slots;
  for (std::uint32_t i = 0; i < slots; ++i) {
    STRATA_ASSIGN_OR_RETURN(offload::SlotId s, b.store.allocate());
    STRATA_CHECK(s < slots);
  }
  // The first pass writes fresh (fallocated, unwritten) extents, which costs the
  // file system extent conversions the runtime's steady state never pays: it
  // rewrites its slots. So the first pass is a warm-up.
  auto write_op = [](std::uint32_t i) { return std::pair{true, i}; };
  auto read_op = [](std::uint32_t i) { return std::pair{false, i}; };
  STRATA_ASSIGN_OR_RETURN(Pass warm, timed_pass(b, write_op, slots, "nvme warm-up"));
  std::vector<double> write_rates, read_rates, mixed_rates;
  double cpu_seconds = 0, bytes_moved = 0;
  const int first = b.o.warm_up == DiskWarmUp::kRound ? -1 : 0;  // round -1: the rest of the warm-up
  for (int round = first; round < b.o.rounds; ++round) {
    std::uint32_t written_slots = warm.transfers;  // the slots a read pass may read
    if (round >= 0) {
      STRATA_ASSIGN_OR_RETURN(Pass written, timed_pass(b, write_op, warm.transfers, "nvme write"));
      const double written_bytes = static_cast<double>(std::uint64_t{written.transfers} * b.o.slot_bytes);
      write_rates.push_back(written_bytes / written.seconds);
      if (round == 0) facts.bytes_tested = std::uint64_t{written.transfers} * b.o.slot_bytes;
      cpu_seconds += written.cpu_seconds;
      bytes_moved += written_bytes;
      written_slots = written.transfers;
    }
    STRATA_ASSIGN_OR_RETURN(Pass read, timed_pass(b, read_op, written_slots, "nvme read"));
    STRATA_ASSIGN_OR_RETURN(auto mixed, mixed_pass(b));
    if (round < 0) continue;
    const double read_bytes = static_cast<double>(std::uint64_t{read.transfers} * b.o.slot_bytes);
    read_rates.push_back(read_bytes / read.seconds);
    mixed_rates.push_back(mixed.first);
    rates.disk_mixed_family_bytes = static_cast<double>(mixed.second);
    cpu_seconds += read.cpu_seconds;
    bytes_moved += read_bytes;
  }
  STRATA_LOG_DEBUG("rates: disk rounds (GiB/s): write {:.3f}, read {:.3f}, mixed {:.3f}",
                   fmt::join(scaled(write_rates), " "), fmt::join(scaled(read_rates), " "),
                   fmt::join(scaled(mixed_rates), " "));
  rates.disk_write_bytes_per_s = reduce(b.o.statistic, write_rates);
  rates.disk_read_bytes_per_s = reduce(b.o.statistic, read_rates);
  rates.disk_mixed_bytes_per_s = reduce(b.o.statistic, mixed_rates);
  // Note [Host cores as a resource]: what a disk byte costs the host's cores.
  rates.disk_cpu_seconds_per_byte = cpu_seconds / bytes_moved;
  return Status::Ok();
}

}  // namespace

Result<DiskFacts> RateMeasurer::measure_disk(const DiskOptions& o) {
  if (o.slot_bytes == 0 || o.slot_bytes % 4096 != 0 || o.slots == 0 || o.in_flight == 0 ||
      o.in_flight > o.slots || o.rounds < 1) {
    return invalid_argument(
        "{}: disk passes of {} slots of {} bytes, {} in flight, {} rounds: slots a positive multiple of "
        "4096, 1 to that many in flight, at least 1 round",
        o.context, o.slots, o.slot_bytes, o.in_flight, o.rounds);
  }
  if (o.mixed == MixedPass::kPipeline && o.slots < 2) {
    return invalid_argument("{}: the pipeline pass needs 2 slots, has {}", o.context, o.slots);
  }
  DiskFacts facts;
  // One region for every in-flight buffer, registered with io_uring as fixed
  // buffers, as the runtime registers its pinned host region.
  AlignedBuffer region(o.slot_bytes * o.in_flight);
  if (region.data == nullptr) {
    return out_of_memory("{}: no memory for {} disk buffers of {}", o.context, o.in_flight,
                         format_bytes(o.slot_bytes));
  }
  // Small normal floats: the pipeline pass runs AdamW over what it reads back.
  for (std::size_t b = 0; b + sizeof(float) <= region.size; b += sizeof(float)) {
    const float v = 1e-3f * static_cast<float>(1 + (b / sizeof(float)) % 97);
    std::memcpy(region.data + b, &v, sizeof(float));
  }
  offload::IoEngineOptions eo;
  eo.fixed_buffer_regions = {std::span<std::byte>(region.data, region.size)};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::IoEngine> engine, offload::make_io_engine(eo));
  facts.engine = std::string(engine->name());
  std::unique_ptr<ThreadPool> pool;
  if (o.mixed == MixedPass::kPipeline && o.pipeline_threads > 0) {
    STRATA_ASSIGN_OR_RETURN(pool, ThreadPool::create({.threads = o.pipeline_threads}));
  }
  Status status;
  {
    auto store =
        offload::SwapStore::create(*engine, {.dirs = {o.dir}, .slot_bytes = o.slot_bytes, .slots = o.slots});
    if (!store.ok()) return Status(store.status()).with_context(o.context);
    facts.direct_io = (*store)->direct_io();
    const DiskBench bench{
        .o = o, .store = **store, .region = region.data, .progress = progress_, .pool = pool.get()};
    status = disk_rounds(bench, rates_, facts);
  }  // the store removes its swap file
  engine->shutdown(offload::ShutdownMode::kDrain);
  STRATA_RETURN_IF_ERROR(status);
  return facts;
}

}  // namespace strata::rates
