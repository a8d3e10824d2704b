// Per-shard checkpoints of data-parallel ranks on the local backend (labels unit +
// dp, part of test_data_parallel): saved at W = 2 they load at 1, 2 and 4 ranks and
// resume bit-exact; a rank whose file fails fails every rank's save and keeps the
// previous checkpoint; another model's checkpoint and an overlapped save are
// refused on every rank (Note [Sharded checkpoint]).

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <thread>

#include "dp_harness.hpp"
#include "strata/checkpoint/test_hooks.hpp"
#include "strata/comm/local.hpp"
#include "strata/common/scratch_dir.hpp"

namespace strata::runtime {
namespace {

using testing::DpResult;

// #13/#14: per-shard checkpoints (Note [Sharded checkpoint] in runtime/checkpoint/format.cpp).

constexpr int kStepsBeforeSave = 2;
constexpr int kStepsAfterLoad = 2;

//! A checkpoint directory, removed with its files.
struct CheckpointDir {
  std::filesystem::path path =
      std::filesystem::temp_directory_path() / fmt::format("strata-dp-ckpt-{}-{}", ::getpid(), next());
  CheckpointDir() { std::filesystem::remove_all(path); }
  ~CheckpointDir() { std::filesystem::remove_all(path); }
  static int next() {
    static std::atomic<int> n{0};
    return n++;
  }
};

//! What a rank does with its built runtime and model; `rank` < 0: one rank alone.
using RankBody = std::function<Status(Runtime&, bench::DpModel&, int rank, int ranks)>;

//! Runs `body` then collects, as rank `rank` of `ranks` (rank < 0: no communicator).
DpResult run_rank(RuntimeOptions o, int rank, int ranks, const RankBody& body,
                  const std::function<void(bench::DpModel&)>& change_model = {}) {
  DpResult out;
  bench::DpModel model = testing::dp_model();
  if (change_model) change_model(model);
  const std::uint32_t state_count = kernels::optimizer_state_count(o.hyper);
  auto device = testing::dp_device();
  auto made = testing::create_runtime(*device, std::move(o));
  if (!made.ok()) {
    out.status = made.status();
    return out;
  }
  Runtime& rt = **made;
  out.status = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(model.build(rt));
    STRATA_RETURN_IF_ERROR(body(rt, model, rank, ranks));
    STRATA_ASSIGN_OR_RETURN(bench::DpModel::Outcome got, model.collect(rt, state_count));
    testing::take_outcome(out, std::move(got));
    return Status::Ok();
  }();
  made->reset();
  return out;
}

//! `body` on every rank of a local group of `w` (w = 1: one rank, no communicator).
std::vector<DpResult> on_ranks(Tier tier, int w, const RankBody& body,
                               const std::function<void(bench::DpModel&)>& change_model = {}) {
  std::vector<ScratchDir> dirs;
  for (int r = 0; r < w; ++r) dirs.push_back(testing::dp_scratch(fmt::format("ck{}", r)));
  if (w == 1)
    return {run_rank(testing::dp_options(tier, dirs[0].path().string()), -1, 1, body, change_model)};
  auto group = comm::make_local_group(w, comm::CommOptions{});
  EXPECT_TRUE(group.ok()) << group.status();
  std::vector<DpResult> results(static_cast<std::size_t>(w));
  std::vector<std::thread> threads;
  for (int r = 0; r < w; ++r) {
    RuntimeOptions o = testing::dp_options(tier, dirs[static_cast<std::size_t>(r)].path().string(), w);
    o.comm = std::move((*group)[static_cast<std::size_t>(r)]);
    threads.emplace_back([&, o = std::move(o), r]() mutable {
      results[static_cast<std::size_t>(r)] = run_rank(std::move(o), r, w, body, change_model);
    });
  }
  for (auto& t : threads) t.join();
  return results;
}

//! `steps` steps as rank `rank` of `ranks`, or (rank < 0) alone with the batch in `parts` micro-batches.
Status train(Runtime& rt, const bench::DpModel& model, int rank, int ranks, int parts, int steps) {
  for (int s = 0; s < steps; ++s) {
    STRATA_RETURN_IF_ERROR(
        model.train_step(rt, rank, static_cast<std::size_t>(rank < 0 ? parts : ranks)).status());
  }
  return Status::Ok();
}

class DataParallelCheckpoint : public ::testing::TestWithParam<Tier> {};

TEST_P(DataParallelCheckpoint, SavedAtTwoRanksLoadsAtOneTwoAndFourAndResumesBitExact) {
  const Tier tier = GetParam();
  CheckpointDir ckpt;
  const std::string dir = ckpt.path.string();
  // Two ranks train kStepsBeforeSave steps and save, every rank into the same directory.
  for (const DpResult& r : on_ranks(tier, 2, [&](Runtime&rt, bench::DpModel&m, int rank, int ranks) {
         STRATA_RETURN_IF_ERROR(train(rt, m, rank, ranks, 2, kStepsBeforeSave));
         return rt.save_checkpoint(dir);
       })) {
    ASSERT_TRUE(r.status.ok()) << r.status;
  }
  {
    std::ifstream in(ckpt.path / "manifest.json");
    const nlohmann::json manifest = nlohmann::json::parse(in);
    EXPECT_EQ(manifest.at("ranks"), 2);
    EXPECT_EQ(manifest.at("files").size(), 8u);  // one per family of the layout, from both ranks
  }
  for (int w : {1, 2, 4}) {
    SCOPED_TRACE(fmt::format("loaded at W = {}", w));
    const int parts = std::max(w, 2);
    // The reference: one rank, kStepsBeforeSave steps with the batch in 2 parts (as
    // the 2 ranks had it), then kStepsAfterLoad in `parts` (as the w ranks have it).
    const DpResult single = on_ranks(tier, 1, [&](Runtime& rt, bench::DpModel& m, int, int) {
      STRATA_RETURN_IF_ERROR(train(rt, m, -1, 1, 2, kStepsBeforeSave));
      return train(rt, m, -1, 1, parts, kStepsAfterLoad);
    })[0];
    testing::expect_trained(single);
    const std::vector<DpResult> loaded =
        on_ranks(tier, w, [&](Runtime& rt, bench::DpModel& m, int rank, int ranks) {
          STRATA_RETURN_IF_ERROR(rt.load_checkpoint(dir));
          return train(rt, m, rank, ranks, parts, kStepsAfterLoad);
        });
    for (int r = 0; r < w; ++r) {
      if (w == 1) {
        // One rank holds every state: compare them all.
        ASSERT_TRUE(loaded[0].status.ok()) << loaded[0].status;
        EXPECT_EQ(single.params, loaded[0].params);
        EXPECT_EQ(single.state0, loaded[0].state0);
        EXPECT_EQ(single.state1, loaded[0].state1);
        continue;
      }
      testing::expect_bit_identical(single, loaded[static_cast<std::size_t>(r)], r);
    }
  }
}

std::string tier_case_name(const ::testing::TestParamInfo<Tier>& param) {
  return std::string(tier_name(param.param));
}

INSTANTIATE_TEST_SUITE_P(Tiers, DataParallelCheckpoint, ::testing::Values(Tier::kGpu, Tier::kNvme),
                         tier_case_name);

TEST(DataParallelCheckpointFaults, ARankWhoseFileFailsFailsEveryRanksSaveAndKeepsThePreviousCheckpoint) {
  CheckpointDir ckpt;
  const std::string dir = ckpt.path.string();
  // Family 3 is rank 1's (3 mod 2); its file of the second save fails to be created.
  checkpoint::test_hooks::before_create = [](const std::string& tmp) -> Status {
    if (tmp.find("family-3.g2.bin.tmp") == std::string::npos) return Status::Ok();
    return make_status(StatusCode::kNoSpace, "creating {}: injected failure", tmp);
  };
  struct Reset {
    ~Reset() { checkpoint::test_hooks::before_create = nullptr; }
  } reset;
  std::vector<Status> second(2);
  std::vector<std::vector<std::vector<float>>> saved(2);
  const std::vector<DpResult> results =
      on_ranks(Tier::kGpu, 2, [&](Runtime& rt, bench::DpModel& m, int rank, int ranks) {
        STRATA_RETURN_IF_ERROR(train(rt, m, rank, ranks, 2, kStepsBeforeSave));
        STRATA_RETURN_IF_ERROR(rt.save_checkpoint(dir));
        for (std::size_t t = 0; t < m.ids.size(); ++t) {
          std::vector<float> p(m.numels[t]);
          STRATA_RETURN_IF_ERROR(rt.read_tensor(m.ids[t], StateKind::kParam, p));
          saved[static_cast<std::size_t>(rank)].push_back(std::move(p));
        }
        STRATA_RETURN_IF_ERROR(train(rt, m, rank, ranks, 2, 1));
        second[static_cast<std::size_t>(rank)] = rt.save_checkpoint(dir);
        // The first checkpoint is still the published one, and loads on every rank.
        return rt.load_checkpoint(dir);
      });
  for (int r = 0; r < 2; ++r) {
    const auto ri = static_cast<std::size_t>(r);
    ASSERT_TRUE(results[ri].status.ok()) << "rank " << r << ": " << results[ri].status;
    EXPECT_FALSE(second[ri].ok()) << "rank " << r << "'s save succeeded though rank 1's file failed";
    // Every rank's error names the failed rank and its file.
    EXPECT_NE(second[ri].message().find("rank 1"), std::string::npos) << second[ri];
    EXPECT_NE(second[ri].message().find("family-3.g2.bin.tmp"), std::string::npos) << second[ri];
    EXPECT_EQ(saved[ri], results[ri].params) << "rank " << r << " did not get the first checkpoint back";
  }
  std::ifstream in(ckpt.path / "manifest.json");
  EXPECT_EQ(nlohmann::json::parse(in).at("generation"), 1);
}

TEST(DataParallelCheckpointFaults, AnotherModelsCheckpointIsRefusedOnEveryRank) {
  CheckpointDir ckpt;
  const std::string dir = ckpt.path.string();
  for (const DpResult& r : on_ranks(Tier::kGpu, 2, [&](Runtime&rt, bench::DpModel&m, int rank, int ranks) {
         STRATA_RETURN_IF_ERROR(train(rt, m, rank, ranks, 2, 1));
         return rt.save_checkpoint(dir);
       })) {
    ASSERT_TRUE(r.status.ok()) << r.status;
  }
  std::vector<Status> loads(2);
  on_ranks(
      Tier::kGpu, 2,
      [&](Runtime& rt, bench::DpModel&, int rank, int) {
        loads[static_cast<std::size_t>(rank)] = rt.load_checkpoint(dir);
        return Status::Ok();
      },
      [](bench::DpModel& m) { m.numels[2] = 5001; });
  for (int r = 0; r < 2; ++r) {
    const Status& st = loads[static_cast<std::size_t>(r)];
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << "rank " << r << ": " << st;
    EXPECT_NE(st.message().find("tensor \"t2\" has shape [5000] there, [5001] here"), std::string::npos)
        << st;
  }
}

TEST(DataParallelCheckpointFaults, AnOverlappedSaveIsRefusedOnADataParallelRank) {
  CheckpointDir ckpt;
  std::vector<Status> begun(2);
  for (const DpResult& r : on_ranks(Tier::kGpu, 2, [&](Runtime&rt, bench::DpModel&m, int rank, int ranks) {
         STRATA_RETURN_IF_ERROR(train(rt, m, rank, ranks, 2, 1));
         begun[static_cast<std::size_t>(rank)] = rt.begin_checkpoint(ckpt.path.string());
         return Status::Ok();
       })) {
    ASSERT_TRUE(r.status.ok()) << r.status;
  }
  for (const Status& st : begun) {
    EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("call save_checkpoint on every rank"), std::string::npos) << st;
  }
  EXPECT_FALSE(std::filesystem::exists(ckpt.path));
}

// #14: a rank whose own part of the save-time shard assembly fails (here: an
// injected failure before it copies family 2's shards) aborts the group, so the
// other rank's save fails at once with the cause instead of waiting out the
// comm timeout (CommOptions' default, 30 s) in the all-gather.
TEST(DataParallelCheckpointFaults, ARankThatFailsToAssembleItsShardsFailsTheOthersAtOnce) {
  CheckpointDir ckpt;
  const std::string dir = ckpt.path.string();
  checkpoint::test_hooks::before_assemble = [](int rank, FamilyId f) -> Status {
    if (rank != 1 || f != 2) return Status::Ok();
    return make_status(StatusCode::kOutOfBudget, "injected: no memory for family {}'s shards", f);
  };
  struct Reset {
    ~Reset() { checkpoint::test_hooks::before_assemble = nullptr; }
  } reset;
  std::vector<Status> saved(2);
  std::vector<double> seconds(2, 0.0);
  std::atomic<bool> rank0_done{false};
  on_ranks(Tier::kHost, 2, [&](Runtime& rt, bench::DpModel& m, int rank, int ranks) {
    STRATA_RETURN_IF_ERROR(train(rt, m, rank, ranks, 2, kStepsBeforeSave));
    const auto t0 = std::chrono::steady_clock::now();
    saved[static_cast<std::size_t>(rank)] = rt.save_checkpoint(dir);
    seconds[static_cast<std::size_t>(rank)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) rank0_done = true;
    // The failed rank lives on (a real job would carry on or report): rank 0
    // must not learn of the failure from its runtime going away.
    while (rank == 1 && !rank0_done && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return Status::Ok();
  });
  for (int r = 0; r < 2; ++r) {
    const auto ri = static_cast<std::size_t>(r);
    EXPECT_FALSE(saved[ri].ok()) << "rank " << r << "'s save succeeded";
    // Both name the failed rank, its family and the cause.
    EXPECT_NE(saved[ri].message().find("rank 1 assembling family 2"), std::string::npos) << saved[ri];
    EXPECT_NE(saved[ri].message().find("injected"), std::string::npos) << saved[ri];
    EXPECT_LT(seconds[ri], 10.0) << "rank " << r << " waited for the comm timeout";
  }
  EXPECT_FALSE(std::filesystem::exists(ckpt.path / "manifest.json"));
}

}  // namespace
}  // namespace strata::runtime
