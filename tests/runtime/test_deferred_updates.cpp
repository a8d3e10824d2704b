// Updates deferred into the next forward (Note [Deferred updates] in
// runtime/src/pipeline/deferred_updates.cpp): with plan.deferred_updates the
// families whose gradients complete first are updated while the next forward
// runs, and training stays bit-identical to a run without deferral: every read
// between steps, an lr changed after step(), tensor_steps and a failure in a
// carried update behave as if each update had ended in its own step.
#include <gtest/gtest.h>

#include <filesystem>

#include "mlp.hpp"
#include "nvme_mlp.hpp"
#include "runtime_fixtures.hpp"
#include "strata/common/bytes.hpp"
#include "strata/runtime/options.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

namespace fs = std::filesystem;
using testing::FaultyNvme;
using testing::IoFaults;
using testing::MlpRun;
using testing::SlowWritesNvme;
using testing::TempDir;

using namespace testing::nvme_mlp;  // the MLP of test_nvme_params.cpp
constexpr std::uint32_t kDeferred = 3;

// Every param and state on NVMe; `deferred` updates carried into the next forward,
// their gradients' room added to the host budget.
RuntimeOptions on_nvme(const fs::path& dir, std::uint32_t deferred) {
  RuntimeOptions o = nvme_params(dir, 0);
  o.budgets.host_bytes += deferred * kChunkBytes;
  o.plan.deferred_updates = deferred;
  return o;
}

struct State {
  std::vector<std::vector<float>> param, s0, s1;
  std::vector<std::int64_t> steps;
  bool operator==(const State&) const = default;
};

// Every tensor's param (the fp32 master), Adam states and step counter, read
// between steps without a flush first.
State read_state(Runtime& rt, const testing::Mlp& mlp) {
  State s;
  for (std::size_t l = 0; l < mlp.layers; ++l) {
    for (TensorId t : {mlp.w[l], mlp.b[l]}) {
      const std::size_t n = t == mlp.w[l] ? mlp.width * mlp.width : mlp.width;
      std::vector<float> p(n), a(n), v(n);
      EXPECT_TRUE(rt.read_tensor(t, StateKind::kParam, p).ok());
      EXPECT_TRUE(rt.read_tensor(t, StateKind::kState0, a).ok());
      EXPECT_TRUE(rt.read_tensor(t, StateKind::kState1, v).ok());
      s.param.push_back(std::move(p));
      s.s0.push_back(std::move(a));
      s.s1.push_back(std::move(v));
      auto steps = rt.tensor_steps(t);
      EXPECT_TRUE(steps.ok());
      s.steps.push_back(steps.ok() ? *steps : -1);
    }
  }
  return s;
}

struct Trained {
  std::vector<float> losses;
  std::vector<StepStats> stats;
  std::vector<State> between;  //!< read after each step(), when asked
  State end;
  Plan plan;
};

struct Schedule {
  bool read_between = false;   //!< read every state after each step()
  bool lr_after_step = false;  //!< a scheduler: a new lr set after each step()
};

Trained train(RuntimeOptions options, int steps, Schedule schedule = {}) {
  Trained out;
  MlpRun run;
  testing::start_mlp(run, std::move(options), kLayers, kWidth);
  if (run.rt == nullptr) return out;
  for (int s = 0; s < steps; ++s) {
    Status st = run.mlp.train_step(*run.rt);
    EXPECT_TRUE(st.ok()) << st;
    auto stats = run.rt->step();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!st.ok() || !stats.ok()) break;
    out.losses.push_back(run.mlp.loss);
    out.stats.push_back(*stats);
    if (schedule.lr_after_step) {
      EXPECT_TRUE(run.rt->set_group_hyper(0, 1e-3f * static_cast<float>(s + 2), 0.01f).ok());
    }
    if (schedule.read_between) out.between.push_back(read_state(*run.rt, run.mlp));
  }
  EXPECT_TRUE(run.rt->flush().ok());
  out.end = read_state(*run.rt, run.mlp);
  out.plan = run.rt->plan();
  return out;
}

std::shared_ptr<SlowWritesNvme> slow_store(const fs::path& dir) {
  std::string why;
  auto inner = testing::store_with_engine(dir, "posix", kChunkBytes, nullptr, &why);
  EXPECT_NE(inner, nullptr) << why;
  return std::make_shared<SlowWritesNvme>(std::move(inner), std::chrono::milliseconds(5));
}

TEST(DeferredUpdates, BitIdenticalToUpdatesInTheirOwnStep) {
  TempDir a, b;
  constexpr int kSteps = 6;
  RuntimeOptions deferred = on_nvme(a.path, kDeferred);
  deferred.nvme_store = slow_store(a.path);
  RuntimeOptions undeferred = on_nvme(b.path, 0);
  undeferred.budgets.host_bytes = deferred.budgets.host_bytes;  // the same homes
  undeferred.nvme_store = slow_store(b.path);
  const Trained d = train(deferred, kSteps);
  const Trained u = train(undeferred, kSteps);
  ASSERT_EQ(d.losses.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(u.losses.size(), static_cast<std::size_t>(kSteps));
  EXPECT_EQ(d.plan.deferred_update_families, kDeferred);
  EXPECT_EQ(u.plan.deferred_update_families, 0u);
  for (const FamilyPlan& f : d.plan.families) EXPECT_EQ(f.optim_home, Tier::kNvme);
  // Every step carries kDeferred, the warm-up step too (its families start at step(),
  // and the plan from the registration order names the deferred ones).
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_EQ(d.stats[static_cast<std::size_t>(s)].updates_deferred, kDeferred) << "step " << s + 1;
    EXPECT_TRUE(d.stats[static_cast<std::size_t>(s)].applied);
    EXPECT_EQ(u.stats[static_cast<std::size_t>(s)].updates_deferred, 0u);
    EXPECT_LE(d.stats[static_cast<std::size_t>(s)].host_high_water_bytes, deferred.budgets.host_bytes);
  }
  EXPECT_EQ(d.losses, u.losses);
  EXPECT_TRUE(d.end == u.end) << "params, optimizer states or step counters differ";
  EXPECT_LT(d.losses.back(), d.losses.front());
}

// Reads right after step() (read_tensor, tensor_steps) and an lr set after step()
// (a scheduler) see and change what they would without deferral.
TEST(DeferredUpdates, ReadsAndAnLrSetBetweenStepsAreAsWithoutDeferral) {
  TempDir a, b;
  constexpr int kSteps = 4;
  const Schedule schedule{.read_between = true, .lr_after_step = true};
  RuntimeOptions deferred = on_nvme(a.path, kDeferred);
  deferred.nvme_store = slow_store(a.path);
  RuntimeOptions undeferred = on_nvme(b.path, 0);
  undeferred.budgets.host_bytes = deferred.budgets.host_bytes;
  const Trained d = train(deferred, kSteps, schedule);
  const Trained u = train(undeferred, kSteps, schedule);
  ASSERT_EQ(d.between.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(u.between.size(), static_cast<std::size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s)
    EXPECT_EQ(d.stats[static_cast<std::size_t>(s)].updates_deferred, kDeferred);
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_TRUE(d.between[static_cast<std::size_t>(s)] == u.between[static_cast<std::size_t>(s)])
        << "the state read after step " << s + 1 << " differs";
  }
  EXPECT_EQ(d.losses, u.losses);
  // The lr changes did change the run: not the constant-lr trajectory.
  EXPECT_NE(d.losses, train(on_nvme(b.path, 0), kSteps).losses);
}

// Not with clipping (the optimizers run at step()): the plan defers nothing.
TEST(DeferredUpdates, OffWhenTheOptimizersWaitForStep) {
  TempDir a;
  RuntimeOptions o = on_nvme(a.path, kDeferred);
  o.clip_max_norm = 1.0;
  const Trained t = train(o, 3);
  ASSERT_EQ(t.stats.size(), 3u);
  EXPECT_EQ(t.plan.deferred_update_families, 0u);
  for (const StepStats& s : t.stats) EXPECT_EQ(s.updates_deferred, 0u);
}

// The held gradients' room is the plan's: a host budget without it is refused by name.
TEST(DeferredUpdates, HostRoomForTheHeldGradientsIsPlannedAndNamed) {
  TempDir a;
  RuntimeOptions o = on_nvme(a.path, kDeferred);
  o.budgets.host_bytes -= kDeferred * kChunkBytes;
  MlpRun run;
  auto rt = Runtime::create(*run.device, o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  run.mlp.layers = kLayers;
  run.mlp.width = kWidth;
  Status st = run.mlp.build(**rt);
  ASSERT_EQ(st.code(), StatusCode::kOutOfBudget) << st;
  EXPECT_NE(st.message().find("deferred updates' gradients"), std::string::npos) << st;
  EXPECT_NE(st.message().find("plan.deferred_updates"), std::string::npos) << st;
  EXPECT_NE(st.message().find("raise host_budget to at least"), std::string::npos) << st;
}

TEST(DeferredUpdates, OutOfRangeIsRefused) {
  RuntimeOptions o = on_host();
  o.plan.deferred_updates = kDeferredUpdatesMax + 1;
  MlpRun run;
  auto rt = Runtime::create(*run.device, o);
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rt.status().message().find("plan.deferred_updates"), std::string::npos) << rt.status();
}

// Note [Deferred updates] and Note [Host room]: a deferred family whose gradient
// was written back to host while incomplete (its other piece comes later, as with
// a tensor unused on some steps or a widened family), then loaded again for that
// piece, is parked with its gradient landed in a deferred update's room. Its host
// copy is stale then; held until the update ran in the next forward, it took a
// gradient host room (one per streaming slot) the plan counted for gradients
// written back in this backward: with as many parked as the room holds, the next
// write-back found the room full, and nothing in flight could free it
// (OutOfBudget in step 2's backward, strata-contract seed 3210620127449098498).
// Six families of two half-chunk tensors, three streaming slots, three updates
// deferred; backward reads each param beside its gradient and opens three
// families by one piece before it completes them, twice.
Status train_opened_families(Runtime& r, int steps, StepStats* last) {
  constexpr std::uint64_t kHalf = 2048;
  std::vector<TensorId> ids;
  for (int t = 0; t < 12; ++t) {
    STRATA_ASSIGN_OR_RETURN(TensorId id, r.register_tensor({fmt::format("t{}", t), {kHalf}}));
    ids.push_back(id);
  }
  std::vector<float> init(kHalf, 0.5f);
  for (TensorId id : ids) STRATA_RETURN_IF_ERROR(r.init_tensor(id, init));
  const auto use = [&](TensorId id, Access grad) -> Status {
    STRATA_ASSIGN_OR_RETURN(Lease p, r.acquire(id, StateKind::kParam, Access::kRead));
    if (grad == Access::kRead) return Status::Ok();  // forward
    STRATA_ASSIGN_OR_RETURN(Lease g, r.acquire(id, StateKind::kGrad, Access::kWrite));
    float* gp = g.as<float>();
    const float* pp = p.as<float>();
    return r.launch([gp, pp] {
      for (std::size_t e = 0; e < kHalf; ++e) gp[e] = 1e-3f * pp[e];
    });
  };
  for (int step = 0; step < steps; ++step) {
    STRATA_RETURN_IF_ERROR(r.begin_micro_batch(true));
    for (TensorId id : ids) STRATA_RETURN_IF_ERROR(use(id, Access::kRead));
    // Families 5, 4, 3 opened by their second tensor, then completed; then 2, 1, 0.
    for (int first : {5, 2}) {
      for (int f = first; f > first - 3; --f) STRATA_RETURN_IF_ERROR(use(ids[2 * f + 1], Access::kWrite));
      for (int f = first; f > first - 3; --f) STRATA_RETURN_IF_ERROR(use(ids[2 * f], Access::kWrite));
    }
    STRATA_ASSIGN_OR_RETURN(*last, r.step());
  }
  return r.flush();
}

TEST(DeferredUpdates, ParkedGradientsLeaveTheGradientHostRoom) {
  TempDir dir;
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-3f;
  o.layout.chunk_elems = 4096;
  o.threads = 2;
  o.budgets = {.gpu_bytes = 3 * 4096 * 4, .host_bytes = 320 * kKiB, .nvme_bytes = 64 * kMiB};
  o.nvme_dirs = {dir.path.string()};
  o.plan.prefetch_depth_max = 1;
  o.plan.grad_staging_slots = 1;
  o.plan.nvme_families_in_flight = 1;
  o.plan.deferred_updates = 3;
  auto device = testing::sim_device();
  auto rt = Runtime::create(*device, o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  StepStats last;
  const Status st = train_opened_families(**rt, 4, &last);
  ASSERT_TRUE(st.ok()) << st;
  const Plan& plan = (*rt)->plan();
  EXPECT_EQ(plan.gpu_cache_slots, 3u);
  EXPECT_EQ(plan.deferred_update_families, 3u);
  EXPECT_EQ(plan.grad_host_bytes, 3u * 4096 * 4);
  EXPECT_EQ(last.updates_deferred, 3u);
  EXPECT_LE(last.host_high_water_bytes, plan.host_bytes);
}

// A write that fails in a carried update (during the next forward) is the next
// call's error, names the family and its step, and keeps the updated state in
// host memory: nothing is lost, and nothing hangs. Every family's update is
// deferred, so every write after step() is a carried update's.
TEST(DeferredUpdates, AFailedCarriedWriteIsTheNextCallsError) {
  TempDir dir;
  IoFaults faults;
  std::string why;
  auto inner = testing::store_with_engine(dir.path, "posix", kChunkBytes, &faults, &why);
  ASSERT_NE(inner, nullptr) << why;
  RuntimeOptions o = on_nvme(dir.path, kLayers);
  o.nvme_store = std::make_shared<FaultyNvme>(std::move(inner));
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(testing::start_mlp(run, o, kLayers, kWidth));
  StepStats last;
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(run.mlp.train_step(*run.rt).ok());
    auto st = run.rt->step();
    ASSERT_TRUE(st.ok()) << st.status();
    last = *st;
  }
  ASSERT_EQ(last.updates_deferred, kLayers);
  // The carried updates write now, in the next forward.
  faults.eio_writes = true;
  Status failed = run.mlp.train_step(*run.rt);
  if (failed.ok()) failed = run.rt->step().status();
  if (failed.ok()) failed = run.rt->flush();
  ASSERT_FALSE(failed.ok()) << "the failed write went unnoticed";
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed;
  EXPECT_NE(failed.message().find("family"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("kept in host memory"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("after step 3"), std::string::npos) << "names its step: " << failed;
  EXPECT_TRUE(run.rt->abort_step().ok());
  faults.eio_writes = false;
  // Nothing lost, nothing mixed: each family holds step 2's state (its carried update
  // did not run, which the error says) or step 3's (it ran; a failed write's result
  // stays in host memory), param, states and step counter alike.
  TempDir ref;
  const State step2 = train(on_nvme(ref.path, 0), 2).end;
  const State step3 = train(on_nvme(ref.path, 0), 3).end;
  const State after = read_state(*run.rt, run.mlp);
  int at3 = 0;
  for (std::size_t j = 0; j < after.param.size(); ++j) {
    const auto same = [&](const State& s) {
      return after.param[j] == s.param[j] && after.s0[j] == s.s0[j] && after.s1[j] == s.s1[j] &&
             after.steps[j] == s.steps[j];
    };
    EXPECT_TRUE(same(step2) || same(step3)) << "tensor " << j << " holds neither step 2's nor step 3's state";
    at3 += same(step3) ? 1 : 0;
  }
  EXPECT_GT(at3, 0) << "the failed write's family keeps its update";
  if (at3 < static_cast<int>(after.param.size())) {
    EXPECT_NE(failed.message().find("did not run"), std::string::npos)
        << "names the updates it dropped: " << failed;
  }
}

}  // namespace
}  // namespace strata::runtime
