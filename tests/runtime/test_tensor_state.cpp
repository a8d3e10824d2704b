// Runtime: state between steps — write_tensor / read_tensor of every kind, step
// counters, parameter groups (Note [Parameter groups]) and Runtime::wait on a lease.
#include <gtest/gtest.h>

#include <filesystem>

#include "mlp.hpp"
#include "sim_device.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

using testing::Mlp;
using testing::sim_device;

constexpr std::size_t kLayers = 6;
constexpr std::size_t kWidth = 128;
constexpr std::uint64_t kChunkElems = 20480;  // one family per layer (W + b = 16512)
constexpr std::uint64_t kModelStateBytes = kLayers * 4 * kChunkElems * 4;

RuntimeOptions options(kernels::Optimizer optimizer, const std::filesystem::path* nvme_dir) {
  RuntimeOptions o;
  o.hyper.optimizer = optimizer;
  o.hyper.lr = 1e-2f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = kChunkElems;
  o.threads = 2;
  o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
  if (nvme_dir != nullptr) {
    // GPU <= 1/4 and host <= 1/2 of the model state: every tier holds states.
    o.budgets = {
        .gpu_bytes = kModelStateBytes / 4, .host_bytes = kModelStateBytes / 2, .nvme_bytes = 64 * kMiB};
    // Note [Host room]: host copies of one gradient per GPU slot, one NVMe chunk's copy (two states).
    o.budgets.host_bytes += o.budgets.gpu_bytes + 8 * kChunkElems;
    o.nvme_dirs = {nvme_dir->string()};
    o.plan.nvme_families_in_flight = 1;
    o.plan.grad_staging_slots = 1;
  }
  return o;
}

//! Every tensor's master, states and step counter.
struct State {
  std::vector<std::vector<float>> values;
  std::vector<std::int64_t> steps;
  bool operator==(const State&) const = default;
};

constexpr StateKind kKinds[] = {StateKind::kMaster, StateKind::kState0, StateKind::kState1};

State read_state(Runtime& rt) {
  State s;
  for (TensorId t = 0; t < rt.tensor_count(); ++t) {
    for (StateKind k : kKinds) {
      std::vector<float> v(rt.layout().slots[t].numel);
      EXPECT_TRUE(rt.read_tensor(t, k, v).ok());
      s.values.push_back(std::move(v));
    }
    s.steps.push_back(*rt.tensor_steps(t));
  }
  return s;
}

Status write_state(Runtime& rt, const State& s) {
  std::size_t i = 0;
  for (TensorId t = 0; t < rt.tensor_count(); ++t) {
    for (StateKind k : kKinds) STRATA_RETURN_IF_ERROR(rt.write_tensor(t, k, s.values[i++]));
    STRATA_RETURN_IF_ERROR(rt.set_tensor_steps(t, s.steps[t]));
  }
  return Status::Ok();
}

void train(Runtime& rt, Mlp& mlp, int steps) {
  for (int s = 0; s < steps; ++s) {
    ASSERT_TRUE(mlp.train_step(rt).ok());
    auto st = rt.step();
    ASSERT_TRUE(st.ok()) << st.status();
  }
}

//! An MLP on its own sim device and AdamW runtime (states on NVMe when nvme_dir is set).
struct Trainer {
  Mlp mlp;  // outlives the device: queued kernels use it
  std::unique_ptr<memory::Device> device = sim_device();
  std::unique_ptr<Runtime> rt;
  explicit Trainer(const std::filesystem::path* nvme_dir) {
    auto made = Runtime::create(*device, options(kernels::Optimizer::kAdamW, nvme_dir));
    EXPECT_TRUE(made.ok()) << made.status();
    rt = std::move(made).value();
    mlp.layers = kLayers;
    mlp.width = kWidth;
    EXPECT_TRUE(mlp.build(*rt).ok());
  }
  ~Trainer() { rt.reset(); }
};

TEST(TensorState, SaveAndLoadThroughWriteTensorResumesBitExact) {
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "states on host and NVMe" : "all resident");
    auto made_a = ScratchDir::create(std::filesystem::temp_directory_path(), "strata-ts-a");
    auto made_b = ScratchDir::create(std::filesystem::temp_directory_path(), "strata-ts-b");
    ASSERT_TRUE(made_a.ok() && made_b.ok());
    const ScratchDir& dir_a = *made_a;
    const ScratchDir& dir_b = *made_b;
    // Straight run of 5 steps.
    Trainer a(nvme ? &dir_a.path() : nullptr);
    train(*a.rt, a.mlp, 2);
    const State at2 = read_state(*a.rt);
    train(*a.rt, a.mlp, 3);
    const State straight = read_state(*a.rt);

    // Resumed run: a fresh runtime loaded with the step-2 state, then 3 steps.
    Trainer b(nvme ? &dir_b.path() : nullptr);
    ASSERT_TRUE(write_state(*b.rt, at2).ok());
    EXPECT_EQ(read_state(*b.rt), at2);
    train(*b.rt, b.mlp, 3);
    const State resumed = read_state(*b.rt);
    EXPECT_EQ(resumed.steps, straight.steps);
    EXPECT_TRUE(resumed == straight) << "a resumed run differs from the straight run";
    EXPECT_EQ(straight.steps.front(), 5);
  }
}

TEST(TensorState, WriteTensorRefusesWhatItCannotStore) {
  auto dev = sim_device();
  auto rt = Runtime::create(*dev, options(kernels::Optimizer::kSgd, nullptr));  // no momentum: no states
  ASSERT_TRUE(rt.ok());
  const TensorId t = *(*rt)->register_tensor({"w", {16}});
  std::vector<float> v(16, 1.0f), short_v(3, 1.0f);
  EXPECT_EQ((*rt)->write_tensor(t, StateKind::kState0, v).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*rt)->write_tensor(t, StateKind::kGrad, v).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ((*rt)->write_tensor(t, StateKind::kMaster, short_v).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*rt)->write_tensor(7, StateKind::kMaster, v).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*rt)->set_tensor_steps(t, -1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*rt)->set_group_hyper(0, -1.0f, 0.0f).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*rt)->set_group_hyper(1u << 20, 1.0f, 0.0f).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*rt)->set_tensor_group(t, 1u << 20).code(), StatusCode::kInvalidArgument);
  // fp32 compute: the master is the param.
  EXPECT_TRUE((*rt)->write_tensor(t, StateKind::kMaster, v).ok());
  std::vector<float> p(16);
  EXPECT_TRUE((*rt)->read_tensor(t, StateKind::kParam, p).ok());
  EXPECT_EQ(p, v);
}

TEST(TensorState, GroupsCarryTheirOwnLrAndWeightDecay) {
  // Weights in group 0, biases in group 1, each with its own lr.
  auto run = [](bool groups, float weight_lr, float bias_lr) {
    Mlp mlp;
    auto dev = sim_device();
    auto rt = Runtime::create(*dev, options(kernels::Optimizer::kAdamW, nullptr));
    EXPECT_TRUE(rt.ok());
    mlp.layers = kLayers;
    mlp.width = kWidth;
    EXPECT_TRUE(mlp.build(**rt).ok());
    if (groups) {
      for (TensorId b : mlp.b) EXPECT_TRUE((*rt)->set_tensor_group(b, 1).ok());
      EXPECT_TRUE((*rt)->set_group_hyper(0, weight_lr, 0.01f).ok());
      EXPECT_TRUE((*rt)->set_group_hyper(1, bias_lr, 0.01f).ok());
    }
    train(**rt, mlp, 3);
    return read_state(**rt);
  };
  const State plain = run(false, 0.0f, 0.0f);
  EXPECT_TRUE(run(true, 1e-2f, 1e-2f) == plain) << "groups with the runtime's own lr must change nothing";
  const State frozen_biases = run(true, 1e-2f, 0.0f);
  const State slow_weights = run(true, 5e-3f, 1e-2f);
  for (std::size_t l = 0; l < kLayers; ++l) {
    const std::size_t w = (2 * l) * 3, b = (2 * l + 1) * 3;  // master of layer l's weight / bias
    EXPECT_EQ(frozen_biases.values[b], std::vector<float>(kWidth, 0.01f)) << "layer " << l << ": lr 0 moved";
    EXPECT_NE(plain.values[b], std::vector<float>(kWidth, 0.01f)) << "layer " << l;
    EXPECT_NE(slow_weights.values[w], plain.values[w]) << "layer " << l << ": group 0's lr was not used";
  }
}

TEST(TensorState, WaitMakesTheLeaseReadableOnTheHostThread) {
  auto dev = sim_device();
  RuntimeOptions o = options(kernels::Optimizer::kSgd, nullptr);
  o.budgets.gpu_bytes = 3 * kChunkElems * 4;  // three slots: every acquire moves a chunk
  o.plan.prefetch = false;
  auto rt = Runtime::create(*dev, o);
  ASSERT_TRUE(rt.ok());
  std::vector<TensorId> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(*(*rt)->register_tensor({fmt::format("t{}", i), {kChunkElems}}));
  for (int i = 0; i < 5; ++i) {
    std::vector<float> v(kChunkElems, static_cast<float>(i + 1));
    ASSERT_TRUE((*rt)->init_tensor(ids[i], v).ok());
  }
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 5; ++i) {
      auto lease = (*rt)->acquire(ids[i], StateKind::kParam, Access::kRead);
      ASSERT_TRUE(lease.ok()) << lease.status();
      ASSERT_TRUE((*rt)->wait(*lease).ok());
      const float* p = lease->as<float>();
      EXPECT_EQ(p[0], static_cast<float>(i + 1));
      EXPECT_EQ(p[kChunkElems - 1], static_cast<float>(i + 1));
    }
  }
  Lease empty;
  EXPECT_EQ((*rt)->wait(empty).code(), StatusCode::kInvalidArgument);
}

// Note [Working sets]: three layers' weights declared as leased together span three
// families; the plan then needs four GPU slots, and three are refused when the layout is
// fixed (the first init), naming the size, never in a backward.
TEST(TensorState, AWorkingSetOfThreeFamiliesIsRefusedThreeSlotsAndTrainsWithFour) {
  const std::uint64_t slot = kChunkElems * 4;
  for (const std::uint64_t slots : {3u, 4u}) {
    SCOPED_TRACE(slots);
    auto dev = sim_device();
    RuntimeOptions o = options(kernels::Optimizer::kSgd, nullptr);
    o.budgets.gpu_bytes = slots * slot;
    auto rt = Runtime::create(*dev, o);
    ASSERT_TRUE(rt.ok()) << rt.status();
    for (std::size_t l = 0; l < kLayers; ++l) {
      constexpr auto kW = static_cast<std::int64_t>(kWidth);
      auto w = (*rt)->register_tensor({fmt::format("l{}.w", l), {kW, kW}});
      ASSERT_TRUE(w.ok()) << w.status();
      if (l < 3) ASSERT_TRUE((*rt)->add_to_working_set(*w, 7).ok());
    }
    EXPECT_EQ((*rt)->add_to_working_set(99, 7).code(), StatusCode::kInvalidArgument);
    const Status init = (*rt)->init_tensor(0, std::vector<float>(kWidth * kWidth, 0.5f));
    if (slots == 3) {
      EXPECT_EQ(init.code(), StatusCode::kOutOfBudget) << init;
      EXPECT_NE(init.message().find("4 chunk slots"), std::string::npos) << init;
      EXPECT_NE(init.message().find("span 3 families"), std::string::npos) << init;
    } else {
      ASSERT_TRUE(init.ok()) << init;
      EXPECT_EQ((*rt)->plan().gpu_cache_slots, 4u) << (*rt)->plan().summary();
    }
  }
}

}  // namespace
}  // namespace strata::runtime

namespace strata::runtime {
namespace {

TEST(TensorState, AllGpuPlanCountsAHostCopyOfEveryChunk) {
  // Everything fits on the device. Note [All-GPU host copies]: the runtime may keep a
  // host copy of any chunk (param homes, init's master, zero states, read_tensor), so
  // the all-GPU plan is taken only when the host budget holds them all; a host budget
  // that holds the params but not the optimizer states streams instead, and trains.
  for (const bool roomy : {true, false}) {
    SCOPED_TRACE(roomy ? "host holds every chunk" : "host holds the params only");
    Mlp mlp;
    auto dev = sim_device();
    RuntimeOptions o = options(kernels::Optimizer::kAdamW, nullptr);
    o.budgets = {.gpu_bytes = 64 * kMiB,
                 .host_bytes = roomy ? 2 * kModelStateBytes : kModelStateBytes / 4 + 200 * 1024};
    auto rt = Runtime::create(*dev, o);
    ASSERT_TRUE(rt.ok()) << rt.status();
    mlp.layers = kLayers;
    mlp.width = kWidth;
    const Status built = mlp.build(**rt);
    if (!roomy && !built.ok()) {
      // Refused up front, naming the host budget: never accepted and then failing.
      EXPECT_EQ(built.code(), StatusCode::kOutOfBudget) << built;
      EXPECT_NE(built.message().find("host_budget"), std::string::npos) << built;
      continue;
    }
    ASSERT_TRUE(built.ok()) << built;
    train(**rt, mlp, 3);
    EXPECT_EQ((*rt)->plan().all_gpu, roomy) << (*rt)->plan().summary();
    EXPECT_EQ(*(*rt)->tensor_steps(mlp.w[0]), 3);
  }
}

}  // namespace
}  // namespace strata::runtime
