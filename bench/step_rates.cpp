// Note [Rates lower bound]: the peaks, each the best of a few timed runs.
#include "step_rates.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

#include "strata/common/thread_pool.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/offload/io_engine.hpp"
#include "strata/offload/swap_store.hpp"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

//! Page-aligned anonymous memory in transparent huge pages where available, as
//! the runtime's pinned host pool; touched once. Move-only.
class HostBuffer {
 public:
  explicit HostBuffer(std::size_t bytes) : bytes_(bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    ::madvise(p, bytes, MADV_HUGEPAGE);
    std::memset(p, 1, bytes);
    data_ = static_cast<std::byte*>(p);
  }
  ~HostBuffer() {
    if (data_ != nullptr) ::munmap(data_, bytes_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  std::byte* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  std::byte* data_ = nullptr;
  std::size_t bytes_;
};

//! The best of `repeats` runs of fn() (seconds), after one untimed warm-up run.
template <typename Fn>
Result<double> best_seconds(int repeats, const Fn& fn) {
  double best = 0;
  for (int r = 0; r <= repeats; ++r) {
    const auto t0 = Clock::now();
    STRATA_RETURN_IF_ERROR(fn());
    const double s = since(t0);
    if (r > 0 && (best == 0 || s < best)) best = s;
  }
  return best;
}

Status measure_copies(memory::Device& device, const PeakOptions& o, HostBuffer& host, PeakRates& out) {
  STRATA_ASSIGN_OR_RETURN(memory::DeviceAllocation dev, device.allocate(o.chunk_bytes));
  STRATA_ASSIGN_OR_RETURN(memory::Stream stream, device.create_stream());
  constexpr int kCopies = 3;
  auto copies = [&](memory::CopyKind kind, void* dst, const void* src) -> Status {
    for (int i = 0; i < kCopies; ++i)
      STRATA_RETURN_IF_ERROR(device.copy_async(stream, dst, src, o.chunk_bytes, kind));
    return device.synchronize(stream);
  };
  const double bytes = double(o.chunk_bytes) * kCopies;
  STRATA_ASSIGN_OR_RETURN(double h2d, best_seconds(o.repeats, [&] {
                            return copies(memory::CopyKind::kHostToDevice, dev.data(), host.data());
                          }));
  STRATA_ASSIGN_OR_RETURN(double d2h, best_seconds(o.repeats, [&] {
                            return copies(memory::CopyKind::kDeviceToHost, host.data(), dev.data());
                          }));
  out.h2d_bytes_per_s = bytes / h2d;
  out.d2h_bytes_per_s = bytes / d2h;
  return Status::Ok();
}

//! What a disk pass does to each slot.
enum class DiskOp : std::uint8_t { kWrite, kRead, kMixed /*!< even slots written, odd ones read */ };

//! Transfers every slot with `in_flight` transfers outstanding; blocks until all are done.
Status disk_pass(offload::SwapStore& store, DiskOp op, std::uint32_t slots, std::uint32_t in_flight,
                 const HostBuffer& buffers) {
  std::mutex mu;
  std::condition_variable cv;
  std::uint32_t outstanding = 0;
  Status failure;
  std::vector<std::uint32_t> free_buffers;
  for (std::uint32_t b = 0; b < in_flight; ++b) free_buffers.push_back(b);
  const std::uint64_t slot_bytes = store.slot_bytes();
  for (std::uint32_t slot = 0; slot < slots; ++slot) {
    std::uint32_t b = 0;
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] { return outstanding < in_flight; });
      if (!failure.ok()) break;
      b = free_buffers.back();
      free_buffers.pop_back();
      ++outstanding;
    }
    std::span<std::byte> buf(buffers.data() + b * slot_bytes, slot_bytes);
    auto done = [&, b](Status st) {
      std::lock_guard lock(mu);
      if (!st.ok() && failure.ok()) failure = std::move(st);
      free_buffers.push_back(b);
      --outstanding;
      cv.notify_all();
    };
    const bool write = op == DiskOp::kWrite || (op == DiskOp::kMixed && slot % 2 == 0);
    Status s = write ? store.write_async(slot, slot, buf, done) : store.read_async(slot, slot, buf, done);
    if (!s.ok()) {
      done(std::move(s));
      break;
    }
  }
  std::unique_lock lock(mu);
  cv.wait(lock, [&] { return outstanding == 0; });
  return failure;
}

Status measure_disk(const PeakOptions& o, PeakRates& out) {
  HostBuffer buffers(o.chunk_bytes * o.disk_in_flight);
  if (buffers.data() == nullptr)
    return out_of_memory("rates: no memory for {} disk buffers", o.disk_in_flight);
  offload::IoEngineOptions eo;
  eo.fixed_buffer_regions = {std::span<std::byte>(buffers.data(), buffers.bytes())};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::IoEngine> engine, offload::make_io_engine(eo));
  out.disk_engine = std::string(engine->name());
  Status status;
  {
    auto store = offload::SwapStore::create(
        *engine, {.dirs = {o.dir}, .slot_bytes = o.chunk_bytes, .slots = o.disk_slots});
    if (!store.ok()) return Status(store.status()).with_context("rates: disk in " + o.dir.string());
    out.disk_direct_io = (*store)->direct_io();
    for (std::uint32_t i = 0; i < o.disk_slots && status.ok(); ++i) status = (*store)->allocate().status();
    // The first write meets fresh extents (best_seconds' warm-up); the runtime rewrites.
    double seconds[3] = {};
    for (DiskOp op : {DiskOp::kWrite, DiskOp::kRead, DiskOp::kMixed}) {
      if (!status.ok()) break;
      Result<double> t = best_seconds(
          o.repeats, [&] { return disk_pass(**store, op, o.disk_slots, o.disk_in_flight, buffers); });
      status = t.status();
      if (t.ok()) seconds[static_cast<int>(op)] = *t;
    }
    if (status.ok()) {
      const double bytes = double(o.chunk_bytes) * o.disk_slots;
      out.disk_write_bytes_per_s = bytes / seconds[static_cast<int>(DiskOp::kWrite)];
      out.disk_read_bytes_per_s = bytes / seconds[static_cast<int>(DiskOp::kRead)];
      out.disk_mixed_bytes_per_s = bytes / seconds[static_cast<int>(DiskOp::kMixed)];
    }
  }  // the store removes its swap file
  engine->shutdown(offload::ShutdownMode::kDrain);
  return status;
}

Status measure_cpu(const PeakOptions& o, HostBuffer& host, PeakRates& out) {
  std::unique_ptr<ThreadPool> pool;
  if (o.threads > 1) {
    STRATA_ASSIGN_OR_RETURN(pool, ThreadPool::create({.threads = o.threads}));  // the caller is one of them
  }
  const std::size_t n = o.chunk_bytes / 4;
  std::vector<float> master(n, 0.5f), grad(n, 1e-3f), m(n, 0.0f), v(n, 0.0f);
  kernels::Span span;
  span.master = master.data();
  span.grad = grad.data();
  span.state = {m.data(), v.data()};
  span.n = n;
  const kernels::GradStats checked{.sum_squares = 1.0, .finite = true};
  kernels::StepArgs args;
  args.hyper.optimizer = kernels::Optimizer::kAdamW;
  args.spans = std::span<const kernels::Span>(&span, 1);
  args.pool = pool.get();
  args.check = kernels::GradCheck::kCallerChecked;
  args.checked = &checked;
  STRATA_ASSIGN_OR_RETURN(double step_s, best_seconds(o.repeats, [&] {
                            ++args.step;
                            return kernels::step(args).status();
                          }));
  out.cpu_optimizer_params_per_s = double(n) / step_s;
  // Host memory: the chunk copied within `host` (first half to second half).
  const std::size_t half = host.bytes() / 2;
  STRATA_ASSIGN_OR_RETURN(double copy_s, best_seconds(o.repeats, [&] {
                            auto body = [&](std::size_t, std::size_t lo, std::size_t hi) {
                              std::memcpy(host.data() + half + lo * 4096, host.data() + lo * 4096,
                                          (hi - lo) * 4096);
                            };
                            if (pool) {
                              pool->parallel_for(half / 4096, 0, body);
                            } else {
                              body(0, 0, half / 4096);
                            }
                            return Status::Ok();
                          }));
  out.host_memory_bytes_per_s = 2.0 * double(half / 4096 * 4096) / copy_s;
  return Status::Ok();
}

}  // namespace

Result<PeakRates> measure_peaks(memory::Device& device, const PeakOptions& o) {
  if (o.chunk_bytes == 0 || o.chunk_bytes % 4096 != 0) {
    return invalid_argument("rates: chunk_bytes = {} must be a positive multiple of 4096", o.chunk_bytes);
  }
  PeakRates out;
  HostBuffer host(2 * o.chunk_bytes);
  if (host.data() == nullptr) return out_of_memory("rates: no memory for 2 x {} bytes", o.chunk_bytes);
  STRATA_RETURN_IF_ERROR(measure_copies(device, o, host, out));
  STRATA_RETURN_IF_ERROR(measure_disk(o, out));
  STRATA_RETURN_IF_ERROR(measure_cpu(o, host, out));
  return out;
}

}  // namespace strata::bench
