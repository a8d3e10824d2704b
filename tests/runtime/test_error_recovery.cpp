// Every error leaves a usable or cleanly closable runtime (Note [Failed steps] in
// runtime/src/step_abort.cpp; issue #24): after OutOfBudget, an NVMe EIO, a CRC
// mismatch or an exception thrown between acquire and release, the step is
// discarded, read_tensor and save_checkpoint give the last good values, the work
// the caller launched has run before the failed call returns, the next step is
// the one a clean run takes once the cause is gone, and a new runtime opens on
// the same swap directory once the old one is gone.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "mlp.hpp"
#include "runtime_fixtures.hpp"
#include "strata/common/bytes.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

namespace fs = std::filesystem;
using testing::FaultyNvme;
using testing::IoFaults;
using testing::Mlp;
using testing::MlpRun;
using testing::TempDir;

// 6 layers of width 64: one family per layer (a 4096-element weight and its bias).
constexpr std::size_t kLayers = 6;
constexpr std::size_t kWidth = 64;
constexpr std::uint64_t kChunkElems = 8192;
constexpr std::uint64_t kChunkBytes = kChunkElems * 4;

RuntimeOptions base_options() {
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-3f;
  o.layout.chunk_elems = kChunkElems;
  o.threads = 2;
  o.budgets = {.gpu_bytes = 4 * kChunkBytes, .host_bytes = 16 * kMiB};
  return o;
}

// Optimizer states (and params) on NVMe behind `store`: the host budget holds the staging only.
RuntimeOptions nvme_options(const fs::path& dir, std::shared_ptr<NvmeStore> store) {
  RuntimeOptions o = base_options();
  // One grad landing slot, a host copy of one gradient per streaming slot (4), one NVMe
  // chunk's temporary copy (2), 4 param staging buffers and one NVMe family in flight (3):
  // Note [Host room] in runtime/plan/planner.cpp, as test_nvme_params.cpp counts it.
  o.budgets = {.gpu_bytes = 4 * kChunkBytes,
               .host_bytes = (1 + 4 + 2 + 4 + 3) * kChunkBytes + kChunkBytes / 2,
               .nvme_bytes = 32 * kMiB};
  o.nvme_dirs = {dir.string()};
  o.nvme_store = std::move(store);
  o.plan.nvme_families_in_flight = 1;
  o.plan.grad_staging_slots = 1;
  o.plan.prefetch_depth_max = 2;
  return o;
}

struct State {
  std::vector<std::vector<float>> param, s0, s1;
  bool operator==(const State&) const = default;
};

State read_state(Runtime& rt, const Mlp& mlp) {
  State s;
  for (std::size_t l = 0; l < mlp.layers; ++l) {
    for (TensorId t : {mlp.w[l], mlp.b[l]}) {
      const std::size_t n = t == mlp.w[l] ? mlp.width * mlp.width : mlp.width;
      std::vector<float> p(n), a(n), v(n);
      EXPECT_TRUE(rt.read_tensor(t, StateKind::kParam, p).ok());
      EXPECT_TRUE(rt.read_tensor(t, StateKind::kState0, a).ok());
      EXPECT_TRUE(rt.read_tensor(t, StateKind::kState1, v).ok());
      s.param.push_back(p);
      s.s0.push_back(a);
      s.s1.push_back(v);
    }
  }
  return s;
}

void start(MlpRun& run, RuntimeOptions options) {
  testing::start_mlp(run, std::move(options), kLayers, kWidth);
}

void train(MlpRun& run, int steps) {
  for (int s = 0; s < steps; ++s) {
    ASSERT_TRUE(run.mlp.train_step(*run.rt).ok());
    auto stats = run.rt->step();
    ASSERT_TRUE(stats.ok()) << stats.status();
  }
}

//! The state a clean run of `options` reaches after `steps` steps.
State clean_state(RuntimeOptions options, int steps) {
  MlpRun run;
  start(run, std::move(options));
  train(run, steps);
  EXPECT_TRUE(run.rt->flush().ok());
  return read_state(*run.rt, run.mlp);
}

TEST(ErrorRecovery, OutOfBudgetDrainsTheLaunchesDiscardsTheStepAndTrainsOn) {
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(start(run, base_options()));
  ASSERT_NO_FATAL_FAILURE(train(run, 2));
  const State before = read_state(*run.rt, run.mlp);
  // A forward that holds every layer's param at once: the 4 slots cannot.
  auto launched = std::make_shared<std::atomic<int>>(0);
  ASSERT_TRUE(run.rt
                  ->launch([launched] {
                    std::this_thread::sleep_for(std::chrono::milliseconds(300));
                    ++*launched;
                  })
                  .ok());
  std::vector<Lease> held;
  Status failed;
  for (std::size_t l = 0; l < kLayers && failed.ok(); ++l) {
    auto lease = run.rt->acquire(run.mlp.w[l], StateKind::kParam, Access::kRead);
    if (lease.ok()) held.push_back(std::move(lease).value());
    if (!lease.ok()) failed = lease.status();
  }
  ASSERT_EQ(failed.code(), StatusCode::kOutOfBudget) << failed;
  // Before the failed call returned, the work launched before it ran: the caller may free what it used.
  EXPECT_EQ(launched->load(), 1) << "a failed call returned with the caller's launches still queued";
  // The slot message names the real counts.
  EXPECT_NE(failed.message().find("all 4 streaming chunk slots are held (4 by leases"), std::string::npos)
      << failed;
  EXPECT_NE(failed.message().find("4 slots in all"), std::string::npos) << failed;
  // The params still leased read their last good values.
  EXPECT_EQ(read_state(*run.rt, run.mlp), before);
  held.clear();
  auto discarded = run.rt->step();
  ASSERT_FALSE(discarded.ok()) << "a step with a failed acquire must not be applied";
  EXPECT_EQ(discarded.status().code(), StatusCode::kOutOfBudget) << discarded.status();
  EXPECT_NE(discarded.status().message().find("step 3 was discarded"), std::string::npos)
      << discarded.status();
  EXPECT_EQ(read_state(*run.rt, run.mlp), before);
  // The cause gone (a forward that fits), the next step is a clean run's third.
  ASSERT_NO_FATAL_FAILURE(train(run, 1));
  EXPECT_EQ(read_state(*run.rt, run.mlp), clean_state(base_options(), 3));
}

//! Forward and backward as Mlp::train_step, but an exception is thrown in the
//! backward of the last layer (with its gradient leases held and half written),
//! or in the forward of layer 1 (with_backward false).
void throwing_step(Runtime& rt, Mlp& m, bool in_backward) {
  for (std::size_t l = 0; l < m.layers; ++l) {
    auto w = rt.acquire(m.w[l], StateKind::kParam, Access::kRead);
    auto b = rt.acquire(m.b[l], StateKind::kParam, Access::kRead);
    ASSERT_TRUE(w.ok() && b.ok());
    const float* W = w->as<float>();
    const float* B = b->as<float>();
    ASSERT_TRUE(rt.launch([&m, l, W, B] { m.forward(l, W, B, true); }).ok());
    if (!in_backward && l == 1) throw std::runtime_error("user forward failed");
  }
  const std::size_t l = m.layers - 1;
  auto w = rt.acquire(m.w[l], StateKind::kParam, Access::kRead);
  auto gw = rt.acquire(m.w[l], StateKind::kGrad, Access::kWrite);
  auto gb = rt.acquire(m.b[l], StateKind::kGrad, Access::kWrite);
  ASSERT_TRUE(w.ok() && gw.ok() && gb.ok());
  float* GW = gw->as<float>();
  float* GB = gb->as<float>();
  ASSERT_TRUE(rt.launch([GW, GB] {
                  std::fill_n(GW, kWidth * kWidth, 1e6f);  // half a gradient, garbage
                  std::fill_n(GB, kWidth, 1e6f);
                }).ok());
  throw std::runtime_error("user backward failed");
}

void exception_run(bool in_backward) {
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(start(run, base_options()));
  ASSERT_NO_FATAL_FAILURE(train(run, 2));
  const State before = read_state(*run.rt, run.mlp);
  bool thrown = false;
  try {
    throwing_step(*run.rt, run.mlp, in_backward);
  } catch (const std::runtime_error&) {
    thrown = true;
  }
  ASSERT_TRUE(thrown);
  // The leases the unwinding destroyed handed no gradient over: nothing was updated.
  EXPECT_EQ(read_state(*run.rt, run.mlp), before);
  auto discarded = run.rt->step();
  ASSERT_FALSE(discarded.ok());
  EXPECT_EQ(discarded.status().code(), StatusCode::kCancelled) << discarded.status();
  EXPECT_NE(discarded.status().message().find("exception"), std::string::npos) << discarded.status();
  EXPECT_EQ(read_state(*run.rt, run.mlp), before);
  ASSERT_NO_FATAL_FAILURE(train(run, 1));
  EXPECT_EQ(read_state(*run.rt, run.mlp), clean_state(base_options(), 3));
}

TEST(ErrorRecovery, ExceptionInBackwardBetweenAcquireAndReleaseUpdatesNothing) {
  exception_run(/*in_backward=*/true);
}

TEST(ErrorRecovery, ExceptionInForwardBetweenAcquireAndReleaseUpdatesNothing) {
  exception_run(/*in_backward=*/false);
}

TEST(ErrorRecovery, AbortStepIsRefusedWhileLeasesAreHeld) {
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(start(run, base_options()));
  auto lease = run.rt->acquire(run.mlp.w[0], StateKind::kParam, Access::kRead);
  ASSERT_TRUE(lease.ok());
  Status st = run.rt->abort_step();
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
  lease->release();
  EXPECT_TRUE(run.rt->abort_step().ok());
}

enum class NvmeFault { kEioRead, kCorrupt };

// Trains 2 clean steps on NVMe-homed states and saves a checkpoint, injects
// `fault`, and checks that the runtime reports it, keeps the last good state
// (readable and saved), trains on once the cause is gone (a corrupted slot's
// cause is gone once a good checkpoint is loaded over it), and closes so that a
// new runtime opens on the same swap directory.
void nvme_fault_run(NvmeFault fault) {
  TempDir dir, ckpt_good, ckpt_after;
  IoFaults faults;
  std::string why;
  auto faulty =
      std::make_shared<FaultyNvme>(testing::store_with_engine(dir.path, "posix", kChunkBytes, &faults, &why));
  faulty->swap_dir_ = dir.path;
  auto run = std::make_unique<MlpRun>();
  ASSERT_NO_FATAL_FAILURE(start(*run, nvme_options(dir.path, faulty)));
  ASSERT_NO_FATAL_FAILURE(train(*run, 2));
  ASSERT_TRUE(run->rt->flush().ok());
  const State before = read_state(*run->rt, run->mlp);
  ASSERT_TRUE(run->rt->save_checkpoint(ckpt_good.path.string()).ok());
  if (fault == NvmeFault::kEioRead) faults.eio_reads = true;
  if (fault == NvmeFault::kCorrupt) faulty->corrupt_next_read_ = true;
  Status failed = run->mlp.train_step(*run->rt);
  if (failed.ok()) failed = run->rt->step().status();
  ASSERT_FALSE(failed.ok()) << "the injected fault went unnoticed";
  EXPECT_EQ(failed.code(), fault == NvmeFault::kEioRead ? StatusCode::kIoError : StatusCode::kCorrupt)
      << failed;
  run->rt->step().status().ignore();  // discards the step if the failed call was not step()
  faults.eio_reads = false;
  if (fault == NvmeFault::kEioRead) {
    // The failed read happened before any update: every state is the last good one, saved so too.
    EXPECT_EQ(read_state(*run->rt, run->mlp), before);
    ASSERT_TRUE(run->rt->save_checkpoint(ckpt_after.path.string()).ok());
  } else {
    // The corrupted slot stays bad: its family fails again, by name, until a good checkpoint is loaded.
    Status again = run->mlp.train_step(*run->rt);
    if (again.ok()) again = run->rt->step().status();
    EXPECT_EQ(again.code(), StatusCode::kCorrupt) << again;
    run->rt->step().status().ignore();
    ASSERT_TRUE(run->rt->load_checkpoint(ckpt_good.path.string()).ok());
    EXPECT_EQ(read_state(*run->rt, run->mlp), before);
  }
  ASSERT_NO_FATAL_FAILURE(train(*run, 1));
  ASSERT_TRUE(run->rt->flush().ok());
  TempDir clean_dir;
  std::string clean_why;
  auto clean_store = testing::store_with_engine(clean_dir.path, "posix", kChunkBytes, nullptr, &clean_why);
  EXPECT_EQ(read_state(*run->rt, run->mlp),
            clean_state(nvme_options(clean_dir.path, std::move(clean_store)), 3));
  // Closing takes no time and frees the directory for a new runtime.
  const auto t0 = std::chrono::steady_clock::now();
  run.reset();
  faulty.reset();
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
  MlpRun again;
  ASSERT_NO_FATAL_FAILURE(start(again, nvme_options(dir.path, nullptr)));
  if (fault == NvmeFault::kEioRead) {
    ASSERT_TRUE(again.rt->load_checkpoint(ckpt_after.path.string()).ok());
    EXPECT_EQ(read_state(*again.rt, again.mlp), before);
  }
  ASSERT_NO_FATAL_FAILURE(train(again, 1));
}

TEST(ErrorRecovery, NvmeEioKeepsTheLastGoodStateSavesItAndTrainsOnOnceTheDiskWorks) {
  nvme_fault_run(NvmeFault::kEioRead);
}

TEST(ErrorRecovery, CrcMismatchFailsByNameUntilAGoodCheckpointIsLoaded) {
  nvme_fault_run(NvmeFault::kCorrupt);
}

}  // namespace
}  // namespace strata::runtime
