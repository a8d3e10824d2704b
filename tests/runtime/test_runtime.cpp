// Runtime tests on the sim device: exactness across tiers, budgets, deviation,
// accumulation, bad input and NVMe faults.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "mlp.hpp"
#include "runtime_fixtures.hpp"
#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

namespace fs = std::filesystem;
using testing::FaultyNvme;
using testing::Mlp;
using testing::sim_device;
using testing::SlowWritesNvme;
using testing::TempDir;

// Layers of width 128: W (16384) + b (128) = 16512 elements -> one family per layer
// with chunk_elems 20480 (80 KiB fp32 chunks).
constexpr std::size_t kLayers = 8;
constexpr std::size_t kWidth = 128;
constexpr std::uint64_t kChunkElems = 20480;

RuntimeOptions base_options(kernels::Optimizer optimizer) {
  RuntimeOptions o;
  o.hyper.optimizer = optimizer;
  o.hyper.lr = optimizer == kernels::Optimizer::kLamb ? 1e-2f : 1e-3f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = kChunkElems;
  o.threads = 2;
  return o;
}

// Model-state bytes: params + grads + 2 fp32 Adam/LAMB states, per family.
constexpr std::uint64_t kFamilyStateBytes = 4 * kChunkElems * 4;
constexpr std::uint64_t kModelStateBytes = kLayers * kFamilyStateBytes;

RuntimeOptions resident(kernels::Optimizer optimizer) {
  RuntimeOptions o = base_options(optimizer);
  o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
  return o;
}

RuntimeOptions tiered(kernels::Optimizer optimizer, const fs::path& dir) {
  RuntimeOptions o = base_options(optimizer);
  // GPU <= 1/4 and host <= 1/2 of the model state; the rest on NVMe.
  o.budgets = {
      .gpu_bytes = kModelStateBytes / 4, .host_bytes = kModelStateBytes / 2, .nvme_bytes = 64 * kMiB};
  // Note [Host room]: host copies of one gradient per GPU slot, one NVMe chunk's copy (two states).
  o.budgets.host_bytes += o.budgets.gpu_bytes + 8 * kChunkElems;
  o.nvme_dirs = {dir.string()};
  o.plan.prefetch_depth_max = 2;
  // One family in the optimizer pipeline: its staging fits beside two families'
  // states on host, so the run uses host and NVMe for optimizer states.
  o.plan.nvme_families_in_flight = 1;
  o.plan.grad_staging_slots = 1;
  return o;
}

struct Snapshot {
  std::vector<std::vector<float>> master, s0, s1;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(Runtime& rt, const Mlp& mlp) {
  Snapshot s;
  for (std::size_t l = 0; l < mlp.layers; ++l) {
    for (TensorId t : {mlp.w[l], mlp.b[l]}) {
      const std::size_t n = t == mlp.w[l] ? mlp.width * mlp.width : mlp.width;
      std::vector<float> m(n), a(n), v(n);
      EXPECT_TRUE(rt.read_tensor(t, StateKind::kMaster, m).ok());
      if (rt.read_tensor(t, StateKind::kState0, a).ok()) {
        EXPECT_TRUE(rt.read_tensor(t, StateKind::kState1, v).ok());
      }
      s.master.push_back(m);
      s.s0.push_back(a);
      s.s1.push_back(v);
    }
  }
  return s;
}

struct Trained {
  Snapshot state;
  std::vector<float> losses;
  std::vector<StepStats> stats;
  Plan plan;
};

Trained train(RuntimeOptions options, int steps, std::size_t frozen = ~std::size_t{0},
              std::function<std::size_t(int)> skip = nullptr) {
  Mlp mlp;  // outlives the device: queued kernels use it
  auto device = sim_device();
  auto rt = Runtime::create(*device, std::move(options));
  EXPECT_TRUE(rt.ok()) << rt.status();
  mlp.layers = kLayers;
  mlp.width = kWidth;
  EXPECT_TRUE(mlp.build(**rt, frozen).ok());
  Trained out;
  for (int s = 0; s < steps; ++s) {
    Status st = mlp.train_step(**rt, skip ? skip(s) : ~std::size_t{0});
    EXPECT_TRUE(st.ok()) << st;
    auto stats = (*rt)->step();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!stats.ok()) break;
    out.losses.push_back(mlp.loss);
    out.stats.push_back(*stats);
  }
  out.state = snapshot(**rt, mlp);
  out.plan = (*rt)->plan();
  return out;
}

class Exactness : public ::testing::TestWithParam<kernels::Optimizer> {};

TEST_P(Exactness, ThreeTiersMatchOneTierBitForBit) {
  TempDir dir;
  Trained one = train(resident(GetParam()), 6);
  Trained three = train(tiered(GetParam(), dir.path), 6);
  EXPECT_TRUE(one.plan.all_gpu);
  // The tiered run really used all three tiers.
  int host = 0, nvme = 0;
  for (const FamilyPlan& f : three.plan.families) {
    host += f.optim_home == Tier::kHost;
    nvme += f.optim_home == Tier::kNvme;
  }
  EXPECT_FALSE(three.plan.all_gpu);
  EXPECT_GT(host, 0);
  EXPECT_GT(nvme, 0);
  EXPECT_LT(three.plan.gpu_cache_slots, kLayers);
  std::uint64_t disk_read = 0, h2d = 0;
  for (const StepStats& s : three.stats) {
    disk_read += s.bytes_disk_read;
    h2d += s.bytes_h2d;
    // Budgets held at every step.
    EXPECT_LE(s.gpu_high_water_bytes, kModelStateBytes / 4);
    EXPECT_LE(s.host_high_water_bytes, three.plan.host_bytes);
    EXPECT_LE(three.plan.host_bytes, kModelStateBytes / 2 + kModelStateBytes / 4 + 8 * kChunkElems);
  }
  EXPECT_GT(disk_read, 0u);
  EXPECT_GT(h2d, 0u);
  ASSERT_EQ(one.losses.size(), three.losses.size());
  EXPECT_EQ(one.losses, three.losses);
  EXPECT_TRUE(one.state == three.state)
      << "master or optimizer states differ between tiered and resident runs";
  EXPECT_LT(one.losses.back(), one.losses.front());
  // Steps after the warm-up follow the plan.
  EXPECT_FALSE(three.stats[0].followed_plan);
  EXPECT_TRUE(three.stats.back().followed_plan);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, Exactness,
                         ::testing::Values(kernels::Optimizer::kAdamW, kernels::Optimizer::kLamb),
                         [](const auto& p) { return std::string(kernels::optimizer_name(p.param)); });

TEST(Runtime, DeviationUnusedAndFrozenParamsMatchReference) {
  TempDir dir;
  // Layer 3 is skipped on odd steps (dynamic control flow), layer 5's bias is frozen.
  auto skip = [](int s) { return s % 2 == 1 ? std::size_t{3} : ~std::size_t{0}; };
  Trained one = train(resident(kernels::Optimizer::kAdamW), 6, 5, skip);
  Trained three = train(tiered(kernels::Optimizer::kAdamW, dir.path), 6, 5, skip);
  EXPECT_TRUE(one.state == three.state);
  EXPECT_EQ(one.losses, three.losses);
  bool deviated = false;
  for (const StepStats& s : three.stats) deviated = deviated || (!s.followed_plan && s.step > 1);
  EXPECT_TRUE(deviated) << "skipping a layer should depart from the trace";
}

TEST(Runtime, GradientAccumulationMatchesReference) {
  TempDir dir;
  auto run = [](RuntimeOptions o) {
    auto device = sim_device();
    auto rt = Runtime::create(*device, std::move(o));
    EXPECT_TRUE(rt.ok()) << rt.status();
    Runtime& r = **rt;
    const TensorId t = *r.register_tensor({"w", {4096}});
    const TensorId u = *r.register_tensor({"u", {30000}});
    std::vector<float> init(4096, 0.5f), init_u(30000, -0.25f);
    EXPECT_TRUE(r.init_tensor(t, init).ok());
    EXPECT_TRUE(r.init_tensor(u, init_u).ok());
    for (int step = 0; step < 3; ++step) {
      for (int micro = 0; micro < 3; ++micro) {
        EXPECT_TRUE(r.begin_micro_batch(micro == 2).ok());
        for (TensorId id : {t, u}) {
          auto p = r.acquire(id, StateKind::kParam, Access::kRead);
          EXPECT_TRUE(p.ok()) << p.status();
        }
        for (TensorId id : {u, t}) {
          auto g = r.acquire(id, StateKind::kGrad, micro == 0 ? Access::kWrite : Access::kAccumulate);
          EXPECT_TRUE(g.ok()) << g.status();
          if (!g.ok()) continue;
          float* gp = g->as<float>();
          const std::size_t n = g->numel();
          EXPECT_TRUE(r.launch([gp, n, micro] {
                         for (std::size_t i = 0; i < n; ++i) {
                           gp[i] = (micro == 0 ? 0.0f : gp[i]) + 0.001f * static_cast<float>((i % 7) + micro);
                         }
                       }).ok());
        }
      }
      auto stats = r.step();
      EXPECT_TRUE(stats.ok()) << stats.status();
    }
    std::vector<float> out(30000);
    EXPECT_TRUE(r.read_tensor(u, StateKind::kMaster, out).ok());
    return out;
  };
  RuntimeOptions small = base_options(kernels::Optimizer::kAdamW);
  small.layout.chunk_elems = 32768;
  RuntimeOptions big = small;
  big.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
  // Three slots of 128 KiB: the two gradients and one param; accumulation must
  // write gradients back to host between micro-batches.
  small.budgets = {.gpu_bytes = 3 * 32768 * 4, .host_bytes = 64 * kMiB};
  small.plan.prefetch = false;
  EXPECT_EQ(run(big), run(small));
}

TEST(Runtime, BadInputIsRefusedWithClearErrors) {
  auto device = sim_device();
  RuntimeOptions o = resident(kernels::Optimizer::kAdamW);
  {
    RuntimeOptions bad = o;
    bad.budgets.gpu_bytes = 0;
    auto rt = Runtime::create(*device, bad);
    ASSERT_FALSE(rt.ok());
    EXPECT_NE(rt.status().message().find("budgets.gpu"), std::string::npos) << rt.status();
  }
  {
    RuntimeOptions bad = o;
    bad.nvme_dirs = {"/tmp"};
    auto rt = Runtime::create(*device, bad);
    ASSERT_FALSE(rt.ok());
    EXPECT_NE(rt.status().message().find("budgets.nvme"), std::string::npos);
  }
  {
    RuntimeOptions bad = o;
    bad.hyper.lr = std::nanf("");
    EXPECT_FALSE(Runtime::create(*device, bad).ok());
  }
  auto rt = Runtime::create(*device, o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  Runtime& r = **rt;
  EXPECT_EQ(r.register_tensor({"empty", {0, 4}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.register_tensor({"half", {4}, DType::kBF16}).status().code(), StatusCode::kInvalidArgument);
  const TensorId t = *r.register_tensor({"t", {1000}});
  EXPECT_EQ(r.register_tensor({"t", {10}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.acquire(99, StateKind::kParam, Access::kRead).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(r.begin_micro_batch(false).ok());
  {
    auto g1 = r.acquire(t, StateKind::kGrad, Access::kWrite);
    ASSERT_TRUE(g1.ok()) << g1.status();
    auto g2 = r.acquire(t, StateKind::kGrad, Access::kWrite);
    EXPECT_EQ(g2.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_EQ(r.step().status().code(), StatusCode::kFailedPrecondition);  // lease still held
    g1->release();
    g1->release();  // a second release of the same lease is a no-op
  }
  EXPECT_EQ(r.register_tensor({"late", {10}}).status().code(), StatusCode::kFailedPrecondition);
  // Handed over once per micro-batch (Note [Gradient completion]).
  EXPECT_EQ(r.acquire(t, StateKind::kGrad, Access::kAccumulate).status().code(),
            StatusCode::kFailedPrecondition);
  ASSERT_TRUE(r.begin_micro_batch(true).ok());
  EXPECT_EQ(r.acquire(t, StateKind::kGrad, Access::kAccumulate).status().code(), StatusCode::kOk);
  EXPECT_TRUE(r.step().ok());
  EXPECT_EQ(r.acquire(t, StateKind::kGrad, Access::kAccumulate).status().code(),
            StatusCode::kFailedPrecondition);
}

// A host budget under the RAM whose pinned region (a quarter more and 8 MiB) is over it:
// refused in the user's terms (budgets.host, not the pool's pinned.budget), with a limit
// that the next try accepts.
TEST(Runtime, HostBudgetWhoseRegionExceedsRamNamesTheLargestThatFits) {
  const std::uint64_t ram = memory::physical_memory_bytes();
  if (ram == 0) GTEST_SKIP() << "this machine's RAM is unknown";
  auto device = sim_device();
  const std::uint64_t over = ram / 10 * 9;  // under the RAM, its region over it
  ASSERT_GT(host_store_region_bytes(over), ram);
  auto refused = make_host_store(over, device.get());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  const std::uint64_t limit = largest_host_budget(ram);
  const std::string msg = refused.status().message();
  EXPECT_NE(msg.find("budgets.host = " + format_bytes(over)), std::string::npos) << msg;
  EXPECT_NE(msg.find("set budgets.host to at most " + format_bytes(limit)), std::string::npos) << msg;
  EXPECT_EQ(msg.find("pinned.budget"), std::string::npos) << msg;
  EXPECT_LE(host_store_region_bytes(limit), ram);
  EXPECT_GT(host_store_region_bytes(limit + kMiB), ram);  // the largest, to a MiB
}

TEST(Runtime, BudgetTooSmallSaysWhatIsNeeded) {
  auto device = sim_device();
  RuntimeOptions o = base_options(kernels::Optimizer::kAdamW);
  // A fixed chunk size and room for two slots: refused at create (it was once
  // refused only at the first lease), naming the budget and what it must hold.
  o.budgets = {.gpu_bytes = 2 * kChunkElems * 4, .host_bytes = 64 * kMiB};
  auto rt = Runtime::create(*device, o);
  ASSERT_FALSE(rt.ok());
  EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rt.status().message().find("budgets.gpu"), std::string::npos) << rt.status();
  EXPECT_NE(rt.status().message().find("3 chunk slots"), std::string::npos) << rt.status();
  // With the chunk size searched, only the first lease can tell.
  o.layout.chunk_elems = 0;
  o.layout.chunk_elems_min = o.layout.chunk_elems_max = 32768;
  auto searched = Runtime::create(*device, o);
  ASSERT_TRUE(searched.ok()) << searched.status();
  ASSERT_TRUE((*searched)->register_tensor({"w", {16000}}).ok());
  ASSERT_TRUE((*searched)->register_tensor({"v", {16000}}).ok());
  ASSERT_TRUE((*searched)->register_tensor({"x", {16000}}).ok());
  auto lease = (*searched)->acquire(0, StateKind::kParam, Access::kRead);
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(lease.status().message().find("gpu_budget"), std::string::npos) << lease.status();
}

using testing::MlpRun;

void start(MlpRun& run, RuntimeOptions options) {
  testing::start_mlp(run, std::move(options), kLayers, kWidth);
}

std::unique_ptr<NvmeStore> posix_store(const fs::path& dir) {
  auto store = make_nvme_store({.dirs = {dir.string()},
                                .slot_bytes = kChunkElems * 4 * 2,
                                .capacity_bytes = 32 * kMiB,
                                .engine = "posix"});
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? std::move(store).value() : nullptr;
}

Snapshot train_tiered_clean(const fs::path& dir, int steps) {
  Mlp mlp;  // outlives the device: queued kernels use it
  auto device = sim_device();
  auto rt = Runtime::create(*device, tiered(kernels::Optimizer::kAdamW, dir));
  EXPECT_TRUE(rt.ok());
  mlp.layers = kLayers;
  mlp.width = kWidth;
  EXPECT_TRUE(mlp.build(**rt).ok());
  for (int s = 0; s < steps; ++s) {
    EXPECT_TRUE(mlp.train_step(**rt).ok());
    EXPECT_TRUE((*rt)->step().ok());
  }
  return snapshot(**rt, mlp);
}

void fault_run(bool eio) {
  TempDir dir;
  auto faulty = std::make_shared<FaultyNvme>(posix_store(dir.path));
  RuntimeOptions o = tiered(kernels::Optimizer::kAdamW, dir.path);
  o.nvme_store = faulty;
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(start(run, o));
  Mlp& mlp = run.mlp;
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(mlp.train_step(*run.rt).ok());
    ASSERT_TRUE(run.rt->step().ok());
  }
  Snapshot before = snapshot(*run.rt, mlp);
  (eio ? faulty->fail_writes_ : faulty->full_) = true;
  // The failure surfaces from the first call after it: an acquire in backward
  // (optimizer steps overlap it), step(), or — for a write-back that ends after
  // step() returned (Note [Write-back after step]) — flush().
  Status during = mlp.train_step(*run.rt);
  Status failed = during;
  if (failed.ok()) failed = run.rt->step().status();
  if (failed.ok()) failed = run.rt->flush();
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), eio ? StatusCode::kIoError : StatusCode::kNoSpace) << failed;
  EXPECT_NE(failed.message().find("family"), std::string::npos) << failed;
  if (eio) {
    EXPECT_NE(failed.message().find("kept in host memory"), std::string::npos) << failed;
  }
  // The failed step is discarded (Note [Failed steps]): by step() when it met
  // the error, else here; nothing goes on silently with half a step.
  EXPECT_TRUE(run.rt->abort_step().ok());
  (eio ? faulty->fail_writes_ : faulty->full_) = false;
  Snapshot after = snapshot(*run.rt, mlp);
  // Every tensor holds either the last completed step's state or the next
  // step's (as a clean run computes it), never a mix.
  TempDir clean_dir;
  Snapshot next = train_tiered_clean(clean_dir.path, 4);
  for (std::size_t j = 0; j < after.master.size(); ++j) {
    const bool is_before =
        after.master[j] == before.master[j] && after.s0[j] == before.s0[j] && after.s1[j] == before.s1[j];
    const bool is_next =
        after.master[j] == next.master[j] && after.s0[j] == next.s0[j] && after.s1[j] == next.s1[j];
    EXPECT_TRUE(is_before || is_next) << "tensor " << j << " holds neither step's state; " << failed;
  }
  const std::string message = failed.message();
  const auto at = message.find("family ");
  ASSERT_NE(at, std::string::npos);
  const std::size_t family = std::stoul(message.substr(at + 7));
  ASSERT_LT(family, kLayers);
  // A full disk is found before anything is committed: the family keeps its
  // state. A failed write comes after the update: the family holds the new state
  // (in host memory), nothing lost.
  const Snapshot& expected = eio ? next : before;
  for (std::size_t j : {2 * family, 2 * family + 1}) {
    EXPECT_EQ(after.master[j], expected.master[j]) << "family " << family << " tensor " << j;
    EXPECT_EQ(after.s0[j], expected.s0[j]) << "family " << family << " tensor " << j;
    EXPECT_EQ(after.s1[j], expected.s1[j]) << "family " << family << " tensor " << j;
  }
  // The cause gone, the runtime trains on (Note [Failed steps]).
  ASSERT_TRUE(mlp.train_step(*run.rt).ok());
  EXPECT_TRUE(run.rt->step().ok());
  EXPECT_TRUE(run.rt->flush().ok());
}

TEST(RuntimeFaults, EioMidStepSurfacesAndKeepsLastState) {
  fault_run(true);
}
TEST(RuntimeFaults, FullNvmeMidRunSurfacesAndKeepsLastState) {
  fault_run(false);
}

TEST(Runtime, NvmeWriteBacksOutliveStepAndStayExact) {
  TempDir dir;
  auto slow = std::make_shared<SlowWritesNvme>(posix_store(dir.path), std::chrono::milliseconds(30));
  RuntimeOptions o = tiered(kernels::Optimizer::kAdamW, dir.path);
  o.nvme_store = slow;
  Snapshot state;
  int returned_with_writes_pending = 0;
  {
    MlpRun run;
    ASSERT_NO_FATAL_FAILURE(start(run, o));
    for (int s = 0; s < 6; ++s) {
      ASSERT_TRUE(run.mlp.train_step(*run.rt).ok());
      auto stats = run.rt->step();
      ASSERT_TRUE(stats.ok()) << stats.status();
      returned_with_writes_pending += slow->pending_ > 0;
      // The store's slots (twice a chunk) are what the plan counts: write-backs in
      // flight included, the NVMe bytes stay within it.
      EXPECT_LE(stats->nvme_bytes, run.rt->plan().nvme_bytes) << "step " << s;
    }
    EXPECT_TRUE(run.rt->flush().ok());
    EXPECT_EQ(slow->pending_, 0);
    state = snapshot(*run.rt, run.mlp);
  }
  // step() did not wait for the write-backs, and the next forward still read
  // the updated params: the result is the one-tier run's, bit for bit.
  EXPECT_GT(returned_with_writes_pending, 0);
  Trained one = train(resident(kernels::Optimizer::kAdamW), 6);
  EXPECT_TRUE(one.state == state) << "write-backs after step() changed the result";
}

TEST(Runtime, ChromeTraceShowsTracks) {
  TempDir dir;
  Mlp mlp;  // outlives the device: queued kernels use it
  auto device = sim_device();
  auto rt = Runtime::create(*device, tiered(kernels::Optimizer::kAdamW, dir.path));
  ASSERT_TRUE(rt.ok());
  mlp.layers = kLayers;
  mlp.width = kWidth;
  ASSERT_TRUE(mlp.build(**rt).ok());
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(mlp.train_step(**rt).ok());
    ASSERT_TRUE((*rt)->step().ok());
  }
  const fs::path file = dir.path / "trace.json";
  ASSERT_TRUE((*rt)->write_chrome_trace(file.string()).ok());
  std::ifstream in(file);
  nlohmann::json doc = nlohmann::json::parse(in);
  std::set<int> tids;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "X") tids.insert(e["tid"].get<int>());
  }
  for (Track t : {Track::kCompute, Track::kH2D, Track::kD2H, Track::kCpuOptimizer, Track::kDiskRead,
                  Track::kDiskWrite}) {
    EXPECT_TRUE(tids.contains(static_cast<int>(t))) << track_name(t);
  }
}

}  // namespace
}  // namespace strata::runtime
