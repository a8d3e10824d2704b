#pragma once
// Data parallelism checks shared by test_data_parallel (local backend, threads)
// and dp_mpi_check (mpi backend, under mpiexec): train bench::DpModel on one rank
// of W with 1/W of the batch, and on one rank with the whole batch, and compare
// params (every tensor) and states (the rank's own families) bit for bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench/dp_model.hpp"
#include "strata/comm/local.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime::testing {

constexpr std::uint64_t kDpChunkElems = 4096;
constexpr int kDpSteps = 3;

//! Ten tensors in (with kDpChunkElems) nine families, one oversized, one frozen.
//! A scratch directory under the temp dir for this process's test `name`, removed with it.
inline ScratchDir dp_scratch(const std::string& name) {
  auto d = ScratchDir::create(std::filesystem::temp_directory_path(),
                              fmt::format("strata-dp-{}-{}", ::getpid(), name));
  EXPECT_TRUE(d.ok()) << d.status();
  return std::move(d).value();
}

inline bench::DpModel dp_model() {
  bench::DpModel m;
  m.numels = {3000, 1000, 5000, 9000, 2000, 2500, 700, 4096, 1500, 3500};
  m.frozen = 6;
  m.samples = 8;
  return m;
}

//! Options that put the optimizer states on `tier` (GPU: everything fits; host:
//! a GPU budget of a few slots; NVMe: host too small for every state).
//! `ranks` > 1: the budgets of one of that many ranks, which hold 1/W of the
//! states, so the NVMe case gives them less host memory to keep states on NVMe.
inline RuntimeOptions dp_options(Tier tier, const std::string& nvme_dir, int ranks = 1) {
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-2f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = kDpChunkElems;
  o.threads = 2;
  o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = 64 * kMiB};
  if (tier != Tier::kGpu) o.budgets.gpu_bytes = 8 * 3 * kDpChunkElems * 4;  // 8 slots of the oversized chunk
  if (tier == Tier::kNvme) {
    // The plan counts every gradient's host copy itself (micro-batches, data
    // parallelism: Note [Host room] in runtime/plan/planner.cpp); no reserve is needed.
    o.budgets.host_bytes = (ranks > 1 ? 40 : 60) * kDpChunkElems * 4;
    o.budgets.nvme_bytes = 64 * kMiB;
    o.nvme_dirs = {nvme_dir};
    o.plan.nvme_families_in_flight = 1;
    o.plan.grad_staging_slots = 1;
  }
  return o;
}

//! Runtime::create one at a time: ranks as threads create their runtimes at
//! once, and TSan reports a race inside the private jemalloc when two pinned
//! host pools are created concurrently (memory/src/pinned_host_pool.cpp; not
//! data parallelism's: reported with issue #14).
inline Result<std::unique_ptr<Runtime>> create_runtime(memory::Device& device, RuntimeOptions options) {
  static std::mutex mu;
  std::lock_guard lock(mu);
  return Runtime::create(device, std::move(options));
}

inline std::unique_ptr<memory::Device> dp_device() {
  memory::DeviceOptions o;
  o.kind = memory::DeviceChoice::kSim;
  o.budget_bytes = 256 * kMiB;
  auto d = memory::make_device(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return std::move(d).value();
}

//! What a run leaves: every tensor's param, and states where this rank has them.
struct DpResult {
  Status status;
  std::vector<std::vector<float>> params;
  std::vector<std::vector<float>> state0, state1;  //!< full length; this rank's part is state_first/count
  std::vector<std::uint64_t> state_first, state_count;  //!< per tensor (Runtime::state_range)
  std::uint64_t state_bytes = 0;
  std::vector<Tier> homes;  //!< optimizer home of each trainable family (this rank's shard of it)
  std::uint64_t bytes_comm = 0;
  std::uint64_t bytes_d2h = 0;  //!< device -> host bytes over the steps after the first
  //! Param chunk bytes of the trainable families whose states are off the GPU
  //! (this rank's plan), per step: what a device-buffer all-gather brings down.
  std::uint64_t offgpu_param_bytes = 0;
};

//! Moves a collected outcome's params and states into `out`.
inline void take_outcome(DpResult& out, bench::DpModel::Outcome&& got) {
  out.params = std::move(got.params);
  out.state0 = std::move(got.state0);
  out.state1 = std::move(got.state1);
  out.state_first = std::move(got.state_first);
  out.state_count = std::move(got.state_count);
}

//! Trains kDpSteps steps: with `rank` < 0 on one rank with the whole batch as
//! `ranks` micro-batches; otherwise as rank `rank` of `ranks` (options.comm set).
//! `prepare` (optional) edits the options once the device exists (a communicator
//! that issues on a stream of it).
inline DpResult dp_train(RuntimeOptions options, int rank, int ranks, bench::DpModel model = dp_model(),
                         const std::function<void(memory::Device&, RuntimeOptions&)>& prepare = {}) {
  DpResult out;
  const std::uint32_t state_count = kernels::optimizer_state_count(options.hyper);
  auto device = dp_device();
  if (prepare) prepare(*device, options);
  auto made = create_runtime(*device, std::move(options));
  if (!made.ok()) {
    out.status = made.status();
    return out;
  }
  Runtime& rt = **made;
  auto run = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(model.build(rt));
    for (int s = 0; s < kDpSteps; ++s) {
      STRATA_ASSIGN_OR_RETURN(StepStats st, model.train_step(rt, rank, static_cast<std::size_t>(ranks)));
      out.bytes_comm += st.bytes_comm;
      if (s > 0) out.bytes_d2h += st.bytes_d2h;  // the first step traces, then plans
    }
    STRATA_ASSIGN_OR_RETURN(bench::DpModel::Outcome got, model.collect(rt, state_count));
    take_outcome(out, std::move(got));
    for (FamilyId f = 0; f < rt.layout().families.size(); ++f) {
      bool trainable = false;
      for (TensorId t : rt.layout().families[f].tensors)
        trainable = trainable || model.frozen >= model.ids.size() || t != model.ids[model.frozen];
      if (trainable) out.homes.push_back(rt.plan().families[f].optim_home);
      if (trainable && rt.plan().families[f].optim_home != Tier::kGpu)
        out.offgpu_param_bytes += rt.layout().families[f].capacity_elems * 4;
    }
    out.state_bytes = got.state_bytes;
    return Status::Ok();
  };
  out.status = run();
  made->reset();
  return out;
}

//! Makes rank r's communicator from the local group's (`inner`), once its
//! device exists (a communicator that issues on a stream of that device).
using WrapComm = std::function<std::shared_ptr<comm::Communicator>(std::unique_ptr<comm::Communicator> inner,
                                                                   memory::Device&)>;

//! Runs rank r's part on its own thread for every rank of a local group.
//! `edit` (optional) changes every rank's options alike; `wrap` (optional)
//! wraps each rank's communicator.
inline std::vector<DpResult> run_ranks(Tier tier, int w,
                                       const std::function<void(RuntimeOptions&)>& edit = {},
                                       const bench::DpModel& model = dp_model(), const WrapComm& wrap = {}) {
  auto group = comm::make_local_group(w, {});
  EXPECT_TRUE(group.ok()) << group.status();
  std::vector<DpResult> results(static_cast<std::size_t>(w));
  std::vector<ScratchDir> dirs;
  for (int r = 0; r < w; ++r) dirs.push_back(dp_scratch(fmt::format("r{}", r)));
  std::vector<std::thread> threads;
  for (int r = 0; r < w; ++r) {
    RuntimeOptions o = dp_options(tier, dirs[static_cast<std::size_t>(r)].path().string(), w);
    if (edit) edit(o);
    std::unique_ptr<comm::Communicator> c = std::move((*group)[static_cast<std::size_t>(r)]);
    if (!wrap) o.comm = std::move(c);
    threads.emplace_back([&results, &model, &wrap, o = std::move(o), c = std::move(c), r, w]() mutable {
      auto prepare = [&](memory::Device& device, RuntimeOptions& opts) {
        opts.comm = wrap(std::move(c), device);
      };
      results[static_cast<std::size_t>(r)] =
          dp_train(std::move(o), r, w, model,
                   wrap ? std::function<void(memory::Device&, RuntimeOptions&)>(prepare)
                        : std::function<void(memory::Device&, RuntimeOptions&)>());
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

//! Rank `rank`'s result equals the single rank's: every param, and the part of
//! each tensor's states it holds. `covered` (optional) gets, per tensor, how many
//! state elements this rank compared (the ranks' parts must add up to the tensor).
inline void expect_bit_identical(const DpResult& single, const DpResult& ranked, int rank,
                                 std::vector<std::uint64_t>* covered = nullptr) {
  ASSERT_TRUE(single.status.ok()) << single.status;
  ASSERT_TRUE(ranked.status.ok()) << "rank " << rank << ": " << ranked.status;
  ASSERT_EQ(single.params.size(), ranked.params.size());
  if (covered != nullptr) covered->resize(single.params.size(), 0);
  std::size_t states_compared = 0;
  for (std::size_t t = 0; t < single.params.size(); ++t) {
    EXPECT_EQ(0, std::memcmp(single.params[t].data(), ranked.params[t].data(), single.params[t].size() * 4))
        << "rank " << rank << " tensor t" << t << " param differs from one rank's";
    const std::uint64_t first = ranked.state_first[t], count = ranked.state_count[t];
    if (count == 0) continue;
    ASSERT_LE(first + count, single.state0[t].size());
    ASSERT_EQ(single.state0[t].size(), ranked.state0[t].size()) << "tensor t" << t;
    ++states_compared;
    if (covered != nullptr) (*covered)[t] += count;
    EXPECT_EQ(0, std::memcmp(single.state0[t].data() + first, ranked.state0[t].data() + first, count * 4))
        << "rank " << rank << " tensor t" << t << " exp_avg differs in [" << first << ", " << first + count
        << ")";
    ASSERT_EQ(single.state1[t].size(), ranked.state1[t].size()) << "tensor t" << t;
    if (single.state1[t].empty()) continue;  // a one-state optimizer
    EXPECT_EQ(0, std::memcmp(single.state1[t].data() + first, ranked.state1[t].data() + first, count * 4))
        << "rank " << rank << " tensor t" << t << " exp_avg_sq differs in [" << first << ", " << first + count
        << ")";
  }
  EXPECT_GT(states_compared, 0u) << "rank " << rank << " holds no states to compare";
}

//! LAMB or LARS in options `o` (made by dp_options), with a learning rate that
//! moves the params well above their rounding.
inline void use_trust_optimizer(RuntimeOptions& o, kernels::Optimizer optimizer) {
  o.hyper.optimizer = optimizer;
  if (optimizer == kernels::Optimizer::kLars) {
    o.hyper.momentum = 0.9f;
    o.hyper.lr = 1.0f;  // LARS scales the step by eta ||p|| / ||g||
  }
}

//! The largest difference between a and b in units of the last place of the
//! largest magnitude in b (the tensor's scale; 0: bit-identical). An element
//! near zero has tiny ulps of its own, so it is measured against its tensor.
inline double max_ulps(const float* a, const float* b, std::size_t n) {
  float scale = 0.0f;
  for (std::size_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(b[i]));
  const double ulp = std::nextafter(scale, INFINITY) - scale;
  double worst = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], 4) == 0) continue;
    worst = std::max(worst, std::fabs(static_cast<double>(a[i]) - b[i]) / ulp);
  }
  return worst;
}

//! max_ulps of rank `ranked`'s every param and its part of each tensor's
//! states against the single rank's (LAMB/LARS with W > 1, Note [Sharded step]).
inline double max_ulps_from_one_rank(const DpResult& single, const DpResult& ranked) {
  EXPECT_TRUE(single.status.ok()) << single.status;
  EXPECT_TRUE(ranked.status.ok()) << ranked.status;
  EXPECT_EQ(single.params.size(), ranked.params.size());
  if (!single.status.ok() || !ranked.status.ok() || single.params.size() != ranked.params.size())
    return INFINITY;
  double worst = 0.0;
  for (std::size_t t = 0; t < single.params.size(); ++t) {
    EXPECT_EQ(single.params[t].size(), ranked.params[t].size()) << "tensor t" << t;
    if (single.params[t].size() != ranked.params[t].size()) return INFINITY;
    worst =
        std::max(worst, max_ulps(single.params[t].data(), ranked.params[t].data(), ranked.params[t].size()));
    const std::uint64_t first = ranked.state_first[t], count = ranked.state_count[t];
    if (count == 0) continue;
    worst =
        std::max(worst, max_ulps(single.state0[t].data() + first, ranked.state0[t].data() + first, count));
    if (!single.state1[t].empty()) {
      worst =
          std::max(worst, max_ulps(single.state1[t].data() + first, ranked.state1[t].data() + first, count));
    }
  }
  return worst;
}

//! The params actually changed (the comparison above is not of two untouched copies).
inline void expect_trained(const DpResult& single) {
  bench::DpModel m = dp_model();
  std::size_t changed = 0;
  for (std::size_t t = 0; t < single.params.size(); ++t) {
    if (single.params[t].empty()) continue;
    changed += single.params[t][0] != bench::DpModel::hash01(t, 999, 0) - 0.5f ? 1 : 0;
  }
  EXPECT_EQ(m.numels.size() - 1, changed);  // all but the frozen tensor
}

}  // namespace strata::runtime::testing
