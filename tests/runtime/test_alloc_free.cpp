// Hot paths do not allocate (Note [Allocation-free hot paths] in
// runtime/src/leases.cpp): this binary replaces the global operator new with
// one that counts, and checks steady-state acquire(), release() and step() on
// an everything-on-GPU plan, a plan with host-homed optimizer states and one
// with NVMe-homed states, beside the runtime's named pool counters
// (HotPathCounters).
#include <execinfo.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "runtime_fixtures.hpp"
#include "sim_device.hpp"
#include "strata/runtime/runtime.hpp"

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
template <typename Fn>
std::uint64_t allocations_in(Fn&& fn) {
  const std::uint64_t before = g_allocations.load();
  fn();
  return g_allocations.load() - before;
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

// --- whole steady steps on three placements ---
// Not allocation-free yet: NVMe-homed states. Per piece of NVMe I/O (a slot of
// a chunk) offload/SwapStore allocates its SlotOp (make_shared), its request
// batch, locate()'s stripe vector with a copy of each file's path, and the
// request callbacks' closures; the runtime's nvme_pipeline.cpp builds its
// piece lists and new-slot lists per family and wraps each piece's completion
// in a std::function. NvmeStatesStillAllocateInTheirIo measures them and
// checks that the runtime's own pools do not grow there either.

enum class Placement { kAllGpu, kHostStates, kNvmeStates };

std::string placement_name(Placement p) {
  switch (p) {
    case Placement::kAllGpu:
      return "AllGpu";
    case Placement::kHostStates:
      return "HostStates";
    case Placement::kNvmeStates:
      return "NvmeStates";
  }
  return "?";
}

constexpr std::uint64_t kFamilyBytes = 4 * 20480 * 4;  // param, grad, two Adam states

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
      o.budgets = {.gpu_bytes = 2 * kFamilyBytes, .host_bytes = 2 * kFamilyBytes, .nvme_bytes = 64 * kMiB};
      o.nvme_dirs = {dir};
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

//! Allocations in two steady steps (and the write-backs they leave) on
//! `placement`, every thread counted; checks the plan is that placement and
//! that no named pool grew.
std::uint64_t steady_step_allocations(Placement placement) {
  testing::TempDir dir;
  auto device = sim_device();
  auto rt = Runtime::create(*device, options_for(placement, dir.path.string()));
  EXPECT_TRUE(rt.ok()) << rt.status();
  if (!rt.ok()) return ~std::uint64_t{0};
  std::vector<TensorId> w;
  for (std::size_t l = 0; l < kLayers; ++l) {
    auto id = (*rt)->register_tensor({fmt::format("l{}.w", l), {kWidth, kWidth}});
    EXPECT_TRUE(id.ok()) << id.status();
    w.push_back(id.ok() ? *id : 0);
  }
  for (TensorId t : w) EXPECT_TRUE((*rt)->init_tensor(t, std::vector<float>(kWidth * kWidth, 0.5f)).ok());
  // Warm-up: the traced step, the plan, and enough steps for every pool, reused
  // vector and per-thread kernel scratch (each pool worker runs some family's
  // kernel) to reach its high water.
  for (int s = 0; s < 12; ++s) EXPECT_TRUE(lease_step(**rt, w).ok());
  EXPECT_TRUE((*rt)->flush().ok());
  const Plan& plan = (*rt)->plan();
  int host = 0, nvme = 0;
  for (const FamilyPlan& f : plan.families) {
    host += f.optim_home == Tier::kHost;
    nvme += f.optim_home == Tier::kNvme;
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
  }
  // Two steady steps and the write-backs they leave, every thread counted: the
  // background work (copies, kernels, NVMe I/O) runs inside the window.
  const HotPathCounters before = (*rt)->hot_path_counters();
  Status st = Status::Ok();
  g_trace = std::getenv("STRATA_ALLOC_TRACE") != nullptr;
  const std::uint64_t allocations = allocations_in([&] {
    for (int s = 0; s < 2 && st.ok(); ++s) st = lease_step(**rt, w);
    if (st.ok()) st = (*rt)->flush();
  });
  g_trace = false;
  EXPECT_TRUE(st.ok()) << st;
  const HotPathCounters after = (*rt)->hot_path_counters();
  EXPECT_EQ(after.copy_records, before.copy_records) << "timed copies in flight passed their high water";
  EXPECT_EQ(after.launch_records, before.launch_records) << "launches in flight passed their high water";
  EXPECT_EQ(after.pool_handler_blocks, before.pool_handler_blocks)
      << "posts in flight passed their high water";
  EXPECT_EQ(after.pool_handlers_oversized, before.pool_handlers_oversized)
      << "a posted function outgrew a block";
  EXPECT_EQ(after.timeline_spans_dropped, 0u);
  EXPECT_GT(after.timeline_spans, before.timeline_spans)
      << "the steps recorded no span: nothing was measured";
  EXPECT_GT(after.copy_records, 0u);
  return allocations;
}

class SteadyStep : public ::testing::TestWithParam<Placement> {};

TEST_P(SteadyStep, AllocatesNothingAndGrowsNoPool) {
  EXPECT_EQ(steady_step_allocations(GetParam()), 0u)
      << "heap allocations in two steady steps on " << placement_name(GetParam())
      << " (STRATA_ALLOC_TRACE=1 prints their stacks)";
}

// NVMe-homed states are not in this list: their I/O still allocates (see
// NvmeStatesStillAllocateInTheirIo below).
INSTANTIATE_TEST_SUITE_P(Placements, SteadyStep,
                         ::testing::Values(Placement::kAllGpu, Placement::kHostStates),
                         [](const ::testing::TestParamInfo<Placement>& i) {
                           return placement_name(i.param);
                         });

TEST(AllocFree, NvmeStatesStillAllocateInTheirIo) {
  // The sites are listed above SteadyStep; the runtime's pools must not grow
  // here either (checked inside), and the count is recorded for the report.
  const std::uint64_t n = steady_step_allocations(Placement::kNvmeStates);
  EXPECT_GT(n, 0u) << "NVMe I/O no longer allocates: move NvmeStates into SteadyStep's list";
  RecordProperty("nvme_two_step_allocations", static_cast<int>(n));
}

}  // namespace
}  // namespace strata::runtime
