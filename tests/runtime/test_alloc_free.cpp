// Hot paths do not allocate (Note [Allocation-free hot paths] in
// runtime/src/leases.cpp): this binary replaces the global operator new with
// one that counts, and checks steady-state acquire() and release().
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "sim_device.hpp"
#include "strata/runtime/runtime.hpp"

namespace {
std::atomic<std::uint64_t> g_allocations{0};
}  // namespace

// The replacement pair is malloc/free on purpose; GCC cannot tell that the
// operator delete below is the one matching this operator new.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
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
  for (int s = 0; s < 3; ++s) one_step(**rt, w);  // warm-up: the plan, the trace's room
  ASSERT_TRUE((*rt)->plan().all_gpu);
  const Counts c = one_step(**rt, w);
  EXPECT_EQ(c.calls, 3 * kLayers);
  EXPECT_EQ(c.acquire, 0u) << "allocations in " << c.calls << " steady-state acquire() calls";
  EXPECT_EQ(c.release, 0u) << "allocations in steady-state release() calls";
  // step() is not allocation-free yet (optimizer launches, timeline spans): say how far.
  RecordProperty("step_allocations", static_cast<int>(c.step));
}

}  // namespace
}  // namespace strata::runtime
