// Hot paths do not allocate (Note [Allocation-free hot paths] in
// runtime/src/leases.cpp): this binary replaces the global operator new with
// one that counts, and checks steady-state acquire(), release() and step() on
// an everything-on-GPU plan, a plan with host-homed optimizer states, one with
// NVMe-homed states and one with NVMe-homed params and states, beside the
// runtime's named pool counters (HotPathCounters); and offload::SwapStore's
// slot reads and writes on both I/O engines beside its counters.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <tuple>
#include <vector>

#include "runtime_fixtures.hpp"
#include "sim_device.hpp"
#include "strata/runtime/runtime.hpp"
#include "strata/runtime/stores.hpp"

namespace {
std::atomic<std::uint64_t> g_allocations{0};
// STRATA_ALLOC_TRACE=1 prints the stack of every counted allocation made while
// g_trace is set (to find a new allocation site: `addr2line -Cfe` the addresses).
std::atomic<bool> g_trace{false};
thread_local bool t_in_trace = false;
void trace_allocation() {
  if (t_in_trace) return;
  t_in_trace = true;
  void* frames[24];
  const int n = backtrace(frames, 24);
  static const char kLine[] = "--- allocation\n";
  (void)!write(2, kLine, sizeof(kLine) - 1);
  backtrace_symbols_fd(frames, n, 2);
  t_in_trace = false;
}
}  // namespace

// The replacement pair is malloc/free on purpose; GCC cannot tell that the
// operator delete below is the one matching this operator new.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (g_trace.load(std::memory_order_relaxed)) trace_allocation();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
// asio and others use the aligned form: counted too.
void* operator new(std::size_t n, std::align_val_t a) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (g_trace.load(std::memory_order_relaxed)) trace_allocation();
  const auto align = static_cast<std::size_t>(a);
  if (void* p = std::aligned_alloc(align, (n + align - 1) / align * align)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
// Every other form goes through the two above, so that no form is left to the
// sanitizer's own operator new while its delete is ours (ASan: alloc-dealloc
// mismatch, as std::stable_sort's nothrow temporary buffer showed).
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n);
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  try {
    return ::operator new(n, a);
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n) {
  return ::operator new(n);
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return ::operator new(n, a);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept {
  return ::operator new(n, t);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t& t) noexcept {
  return ::operator new(n, a, t);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}

namespace strata::runtime {
namespace {

using testing::sim_device;

constexpr std::size_t kLayers = 4;
constexpr std::int64_t kWidth = 128;

//! Allocations made by fn() (any thread, so run it while nothing else runs).
//! STRATA_ALLOC_TRACE=1 prints each one's stack.
template <typename Fn>
std::uint64_t allocations_in(Fn&& fn) {
  g_trace = std::getenv("STRATA_ALLOC_TRACE") != nullptr;
  const std::uint64_t before = g_allocations.load();
  fn();
  const std::uint64_t n = g_allocations.load() - before;
  g_trace = false;
  return n;
}

struct Counts {
  std::uint64_t acquire = 0, release = 0, step = 0;
  std::uint64_t calls = 0;
};

//! One step's forward and backward through leases only (no compute), counting
//! the allocations inside acquire() and release(); step() counted apart.
Counts one_step(Runtime& rt, const std::vector<TensorId>& w) {
  Counts c;
  auto acquire = [&](TensorId t, StateKind k, Access a) {
    Result<Lease> l = invalid_argument("unset");
    c.acquire += allocations_in([&] { l = rt.acquire(t, k, a); });
    EXPECT_TRUE(l.ok()) << l.status();
    ++c.calls;
    return l.ok() ? std::move(l).value() : Lease{};
  };
  auto release = [&](Lease& l) { c.release += allocations_in([&] { l.release(); }); };
  for (TensorId t : w) {
    Lease p = acquire(t, StateKind::kParam, Access::kRead);
    release(p);
  }
  for (auto it = w.rbegin(); it != w.rend(); ++it) {
    Lease p = acquire(*it, StateKind::kParam, Access::kRead);
    Lease g = acquire(*it, StateKind::kGrad, Access::kWrite);
    release(g);
    release(p);
  }
  Result<StepStats> st = invalid_argument("unset");
  c.step = allocations_in([&] { st = rt.step(); });
  EXPECT_TRUE(st.ok()) << st.status();
  return c;
}

TEST(AllocFree, SteadyStateAcquireAndReleaseAllocateNothing) {
  // Everything on the GPU, clipping on (optimizers start at step()): after the
  // warm-up steps, a whole step's acquire and release calls allocate nothing.
  auto device = sim_device();
  RuntimeOptions o;
  o.layout.chunk_elems = 20480;
  o.threads = 2;
  o.clip_max_norm = 1.0;
  o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
  auto rt = Runtime::create(*device, o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  std::vector<TensorId> w;
  for (std::size_t l = 0; l < kLayers; ++l) {
    auto id = (*rt)->register_tensor({fmt::format("l{}.w", l), {kWidth, kWidth}});
    ASSERT_TRUE(id.ok()) << id.status();
    w.push_back(*id);
  }
  for (TensorId t : w) ASSERT_TRUE((*rt)->init_tensor(t, std::vector<float>(kWidth * kWidth, 0.5f)).ok());
  // Warm-up: the plan, the trace's room, every pool's and reused vector's high water.
  for (int s = 0; s < 8; ++s) one_step(**rt, w);
  ASSERT_TRUE((*rt)->plan().all_gpu);
  const Counts c = one_step(**rt, w);
  EXPECT_EQ(c.calls, 3 * kLayers);
  EXPECT_EQ(c.acquire, 0u) << "allocations in " << c.calls << " steady-state acquire() calls";
  EXPECT_EQ(c.release, 0u) << "allocations in steady-state release() calls";
  EXPECT_EQ(c.step, 0u) << "allocations in a steady-state step() with clipping (every optimizer runs there)";
}

// --- whole steady steps on four placements ---
// NVMe I/O is covered since #12 (deliverable 6): before, per piece of NVMe I/O
// (a slot of a chunk) offload/SwapStore allocated its SlotOp (make_shared), its
// request batch, locate()'s stripe vector with a copy of each file's path, and
// the request callbacks' closures; the runtime built its piece lists and
// new-slot lists per family and wrapped each piece's completion in a
// std::function too large to keep in place: 416-480 allocations in two steps
// on NvmeStates. Now slot operations and NVMe pieces come from record pools
// (nvme_slot_op_records, nvme_io_records) and the lists are reused.

enum class Placement { kAllGpu, kHostStates, kNvmeStates, kNvmeParams };

std::string placement_name(Placement p) {
  switch (p) {
    case Placement::kAllGpu:
      return "AllGpu";
    case Placement::kHostStates:
      return "HostStates";
    case Placement::kNvmeStates:
      return "NvmeStates";
    case Placement::kNvmeParams:
      return "NvmeParams";
  }
  return "?";
}

constexpr std::uint64_t kChunkBytes = 20480 * 4;
constexpr std::uint64_t kFamilyBytes = 4 * kChunkBytes;  // param, grad, two Adam states

RuntimeOptions options_for(Placement p, const std::string& dir) {
  RuntimeOptions o;
  o.layout.chunk_elems = 20480;
  o.threads = 2;
  switch (p) {
    case Placement::kAllGpu:
      o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
      break;
    case Placement::kHostStates:
      // The GPU holds a few chunks, the optimizer states live on host.
      o.budgets = {.gpu_bytes = 2 * kFamilyBytes, .host_bytes = 64 * kMiB};
      o.plan.allow_gpu_optimizer = false;
      break;
    case Placement::kNvmeStates:
      // Note [Host room]: + host copies of every gradient (4, fewer than the GPU slots) and one NVMe chunk's
      // copy.
      o.budgets = {.gpu_bytes = 2 * kFamilyBytes,
                   .host_bytes = 2 * kFamilyBytes + 6 * kChunkBytes,
                   .nvme_bytes = 64 * kMiB};
      o.nvme_dirs = {dir};
      o.plan.nvme_families_in_flight = 1;
      o.plan.grad_staging_slots = 1;
      break;
    case Placement::kNvmeParams:
      // As tests/runtime/test_nvme_params.cpp (8 layers): host room for one
      // grad landing slot, 4 param staging buffers (prefetch depth 2 + 2) and
      // one NVMe family in flight (param and two states), and no param: every
      // param and state lives on NVMe.
      o.budgets = {
          .gpu_bytes = 2 * kFamilyBytes,
          .host_bytes = (1 + 6 + 2 + 4 + 3) * kChunkBytes + kChunkBytes / 2,  // (test_nvme_params.cpp)
          .nvme_bytes = 64 * kMiB};
      o.nvme_dirs = {dir};
      o.plan.prefetch_depth_max = 2;
      o.plan.nvme_families_in_flight = 1;
      o.plan.grad_staging_slots = 1;
      break;
  }
  return o;
}

//! One training step through leases: forward reads each param, backward reads
//! it again and writes its gradient (a small finite value, on the compute
//! stream through launch()), then step().
Status lease_step(Runtime& rt, const std::vector<TensorId>& w) {
  for (TensorId t : w) {
    STRATA_ASSIGN_OR_RETURN(Lease p, rt.acquire(t, StateKind::kParam, Access::kRead));
    p.release();
  }
  for (auto it = w.rbegin(); it != w.rend(); ++it) {
    STRATA_ASSIGN_OR_RETURN(Lease p, rt.acquire(*it, StateKind::kParam, Access::kRead));
    STRATA_ASSIGN_OR_RETURN(Lease g, rt.acquire(*it, StateKind::kGrad, Access::kWrite));
    float* grad = g.as<float>();
    const std::uint64_t n = g.numel();
    // (A two-value capture: std::function keeps it in place.)
    STRATA_RETURN_IF_ERROR(rt.launch([grad, n] { std::fill(grad, grad + n, 1e-3f); }));
    g.release();
    p.release();
  }
  return rt.step().status();
}

//! The counters of the runtime's pools that grow only past a high water.
auto pools(const Runtime& rt) {
  const HotPathCounters c = rt.hot_path_counters();
  return std::make_tuple(c.copy_records, c.launch_records, c.pool_handler_blocks, c.pool_handlers_oversized,
                         c.nvme_io_records, c.nvme_slot_op_records);
}

//! Allocations in two steady steps (and the write-backs they leave) on
//! `placement`, every thread counted; checks the plan is that placement and
//! that no named pool grew.
std::uint64_t steady_step_allocations(Placement placement) {
  testing::TempDir dir;
  auto device = sim_device();
  auto rt = Runtime::create(*device, options_for(placement, dir.path.string()));
  EXPECT_TRUE(rt.ok()) << rt.status();
  if (!rt.ok()) return ~std::uint64_t{0};
  // With fewer layers than param staging buffers, params fit on host.
  const std::size_t layers = placement == Placement::kNvmeParams ? 2 * kLayers : kLayers;
  std::vector<TensorId> w;
  for (std::size_t l = 0; l < layers; ++l) {
    auto id = (*rt)->register_tensor({fmt::format("l{}.w", l), {kWidth, kWidth}});
    EXPECT_TRUE(id.ok()) << id.status();
    w.push_back(id.ok() ? *id : 0);
  }
  for (TensorId t : w) EXPECT_TRUE((*rt)->init_tensor(t, std::vector<float>(kWidth * kWidth, 0.5f)).ok());
  // Warm-up: the traced step, the plan, and enough steps for every pool, reused
  // vector and per-thread kernel scratch (each pool worker runs some family's
  // kernel) to reach its high water: 12 steps, then until no pool has grown
  // for 8 steps in a row (how far the host runs ahead of the streams, and so
  // the records in flight, depends on the machine's load).
  for (int s = 0; s < 12; ++s) EXPECT_TRUE(lease_step(**rt, w).ok());
  for (int s = 0, stable = 0; s < 64 && stable < 8; ++s) {
    const auto pools_before = pools(**rt);
    EXPECT_TRUE(lease_step(**rt, w).ok());
    stable = pools(**rt) == pools_before ? stable + 1 : 0;
  }
  EXPECT_TRUE((*rt)->flush().ok());
  const Plan& plan = (*rt)->plan();
  int host = 0, nvme = 0, nvme_params = 0;
  for (const FamilyPlan& f : plan.families) {
    host += f.optim_home == Tier::kHost;
    nvme += f.optim_home == Tier::kNvme;
    nvme_params += f.param_home == Tier::kNvme;
  }
  switch (placement) {
    case Placement::kAllGpu:
      EXPECT_TRUE(plan.all_gpu) << plan.summary();
      break;
    case Placement::kHostStates:
      EXPECT_EQ(host, static_cast<int>(kLayers)) << plan.summary();
      break;
    case Placement::kNvmeStates:
      EXPECT_GT(nvme, 0) << plan.summary();
      break;
    case Placement::kNvmeParams:
      EXPECT_EQ(nvme, static_cast<int>(layers)) << plan.summary();
      EXPECT_EQ(nvme_params, static_cast<int>(layers)) << plan.summary();
      break;
  }
  // Two steady steps and the write-backs they leave, every thread counted: the
  // background work (copies, kernels, NVMe I/O) runs inside the window. On a
  // loaded machine the streams can lag the host by more than they did in the
  // warm-up, so a window may set a new high water of records in flight (a pool
  // grows by one record, one allocation) without any per-copy allocation: up to
  // kWindows windows are measured and the first clean one ends the test. A path
  // that allocates on every copy or piece fails every window.
  constexpr int kWindows = 3;
  std::uint64_t allocations = 0;
  for (int window = 1; window <= kWindows; ++window) {
    const HotPathCounters before = (*rt)->hot_path_counters();
    const auto pools_before = pools(**rt);
    Status st = Status::Ok();
    allocations = allocations_in([&] {
      for (int s = 0; s < 2 && st.ok(); ++s) st = lease_step(**rt, w);
      if (st.ok()) st = (*rt)->flush();
    });
    EXPECT_TRUE(st.ok()) << st;
    const HotPathCounters after = (*rt)->hot_path_counters();
    const bool grew = pools(**rt) != pools_before;
    if ((allocations != 0 || grew) && window < kWindows) {
      std::printf("window %d of %d on %s: %llu allocations, a pool grew: %d; measuring another\n", window,
                  kWindows, placement_name(placement).c_str(), static_cast<unsigned long long>(allocations),
                  grew ? 1 : 0);
      continue;
    }
    EXPECT_EQ(after.copy_records, before.copy_records) << "timed copies in flight passed their high water";
    EXPECT_EQ(after.launch_records, before.launch_records) << "launches in flight passed their high water";
    EXPECT_EQ(after.pool_handler_blocks, before.pool_handler_blocks)
        << "posts in flight passed their high water";
    EXPECT_EQ(after.pool_handlers_oversized, before.pool_handlers_oversized)
        << "a posted function outgrew a block";
    EXPECT_EQ(after.nvme_io_records, before.nvme_io_records)
        << "NVMe pieces in flight passed their high water";
    EXPECT_EQ(after.nvme_slot_op_records, before.nvme_slot_op_records)
        << "the swap store's slot reads and writes in flight passed their high water";
    if (placement == Placement::kNvmeStates || placement == Placement::kNvmeParams) {
      EXPECT_GT(after.nvme_io_records, 0u) << "no NVMe piece ran: the NVMe path was not measured";
      EXPECT_GT(after.nvme_slot_op_records, 0u);
    }
    EXPECT_EQ(after.timeline_spans_dropped, 0u);
    EXPECT_GT(after.timeline_spans, before.timeline_spans)
        << "the steps recorded no span: nothing was measured";
    EXPECT_GT(after.copy_records, 0u);
    break;
  }
  return allocations;
}

class SteadyStep : public ::testing::TestWithParam<Placement> {};

TEST_P(SteadyStep, AllocatesNothingAndGrowsNoPool) {
  EXPECT_EQ(steady_step_allocations(GetParam()), 0u)
      << "heap allocations in two steady steps on " << placement_name(GetParam())
      << " (STRATA_ALLOC_TRACE=1 prints their stacks)";
}

INSTANTIATE_TEST_SUITE_P(Placements, SteadyStep,
                         ::testing::Values(Placement::kAllGpu, Placement::kHostStates, Placement::kNvmeStates,
                                           Placement::kNvmeParams),
                         [](const ::testing::TestParamInfo<Placement>& i) {
                           return placement_name(i.param);
                         });

// --- the NVMe store alone ---
// offload::SwapStore under the runtime's NVMe store, on each engine, with two
// directories (every slot in two stripes): once its slot operation records
// reached the high water of I/O in flight, writes and reads allocate nothing.

struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
  Status first = Status::Ok();
  void done(Status s) {
    std::lock_guard g(mu);
    if (!s.ok() && first.ok()) first = std::move(s);
    if (--pending == 0) cv.notify_all();
  }
  Status wait() {
    std::unique_lock g(mu);
    cv.wait(g, [&] { return pending == 0; });
    return first;
  }
};

class SlotIo : public ::testing::TestWithParam<std::string> {};

TEST_P(SlotIo, StoreWritesAndReadsAllocateNothingOnceWarm) {
  testing::TempDir a, b;
  constexpr std::uint64_t kSlotBytes = 256 * 1024;
  constexpr std::size_t kSlots = 4;
  auto store = make_nvme_store({.dirs = {a.path.string(), b.path.string()},
                                .slot_bytes = kSlotBytes,
                                .capacity_bytes = 8 * kMiB,
                                .engine = GetParam()});
  if (!store.ok() && store.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << "engine " << GetParam() << " unavailable here: " << store.status();
  }
  ASSERT_TRUE(store.ok()) << store.status();
  NvmeStore& nvme = **store;
  auto* out = static_cast<std::byte*>(std::aligned_alloc(4096, 2 * kSlots * kSlotBytes));
  ASSERT_NE(out, nullptr);
  std::byte* in = out + kSlots * kSlotBytes;
  std::vector<std::uint32_t> slots;
  for (std::size_t i = 0; i < kSlots; ++i) {
    auto slot = nvme.allocate_slot();
    ASSERT_TRUE(slot.ok()) << slot.status();
    slots.push_back(*slot);
  }
  // One round: every slot written at once, then every slot read back at once.
  Latch latch;
  auto round = [&](int r) {
    for (std::size_t i = 0; i < kSlots; ++i) std::memset(out + i * kSlotBytes, r * 16 + int(i), kSlotBytes);
    latch.pending = kSlots;
    for (std::size_t i = 0; i < kSlots; ++i) {
      auto data = std::span<const std::byte>(out + i * kSlotBytes, kSlotBytes);
      // A one-pointer capture: std::function keeps it in place.
      Status st = nvme.write(slots[i], data, [&latch](Status s) { latch.done(std::move(s)); });
      if (!st.ok()) latch.done(st);
    }
    if (Status st = latch.wait(); !st.ok()) return st;
    std::memset(in, 0xff, kSlots * kSlotBytes);
    latch.pending = kSlots;
    for (std::size_t i = 0; i < kSlots; ++i) {
      auto data = std::span<std::byte>(in + i * kSlotBytes, kSlotBytes);
      Status st = nvme.read(slots[i], data, [&latch](Status s) { latch.done(std::move(s)); });
      if (!st.ok()) latch.done(st);
    }
    return latch.wait();
  };
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(round(r).ok());
  const std::uint64_t records = nvme.io_records();
  EXPECT_GT(records, 0u) << "the store counts no slot operation: nothing to check";
  Status st = Status::Ok();
  const std::uint64_t allocations = allocations_in([&] {
    for (int r = 3; r < 8 && st.ok(); ++r) st = round(r);
  });
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(std::memcmp(in, out, kSlots * kSlotBytes), 0) << "the last round read back other bytes";
  EXPECT_EQ(allocations, 0u) << "heap allocations in 5 rounds of " << kSlots << " slot writes and reads on "
                             << GetParam();
  EXPECT_EQ(nvme.io_records(), records) << "slot operations in flight passed their high water";
  for (std::uint32_t s : slots) nvme.free_slot(s);
  std::free(out);
}

INSTANTIATE_TEST_SUITE_P(Engines, SlotIo, ::testing::Values("posix", "uring"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace strata::runtime
