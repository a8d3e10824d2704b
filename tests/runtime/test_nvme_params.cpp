// NVMe-homed params (Note [NVMe-homed params] in runtime/src/residency/residency.hpp): the
// planner puts params on NVMe when the host budget cannot hold them; training is
// bit-identical to an all-on-host run on both I/O engines with writes that outlive
// step(); EIO on read and write, a full disk and a corrupted slot end in a clear
// error, the step is not applied to bad bytes and the last good state stays readable.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>

#include "mlp.hpp"
#include "nvme_mlp.hpp"
#include "runtime_fixtures.hpp"
#include "strata/common/bytes.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

namespace fs = std::filesystem;
using testing::FaultyNvme;
using testing::IoFaults;
using testing::Mlp;
using testing::SlowWritesNvme;
using testing::TempDir;

using namespace testing::nvme_mlp;  // the MLP's sizes and options

struct State {
  std::vector<std::vector<float>> param, s0, s1;
  bool operator==(const State&) const = default;
};

// Reads every tensor's param (the fp32 master) and Adam states; a tensor whose
// read fails is left empty and counted in *unreadable.
State read_state(Runtime& rt, const Mlp& mlp, int* unreadable = nullptr, Status* first_error = nullptr) {
  State s;
  for (std::size_t l = 0; l < mlp.layers; ++l) {
    for (TensorId t : {mlp.w[l], mlp.b[l]}) {
      const std::size_t n = t == mlp.w[l] ? mlp.width * mlp.width : mlp.width;
      std::vector<float> p(n), a(n), v(n);
      Status st = rt.read_tensor(t, StateKind::kParam, p);
      if (st.ok()) st = rt.read_tensor(t, StateKind::kState0, a);
      if (st.ok()) st = rt.read_tensor(t, StateKind::kState1, v);
      if (!st.ok()) {
        if (unreadable != nullptr) ++*unreadable;
        if (first_error != nullptr && first_error->ok()) *first_error = st;
        p.clear(), a.clear(), v.clear();
      }
      s.param.push_back(p);
      s.s0.push_back(a);
      s.s1.push_back(v);
    }
  }
  return s;
}

using testing::MlpRun;

void start(MlpRun& run, RuntimeOptions options) {
  testing::start_mlp(run, std::move(options), kLayers, kWidth);
}

struct Trained {
  State state;
  std::vector<float> losses;
  std::vector<StepStats> stats;
  Plan plan;
};

Trained train(RuntimeOptions options, int steps, const std::function<void()>& after_step = nullptr) {
  Trained out;
  MlpRun run;
  start(run, std::move(options));
  if (run.rt == nullptr) return out;
  for (int s = 0; s < steps; ++s) {
    Status st = run.mlp.train_step(*run.rt);
    EXPECT_TRUE(st.ok()) << st;
    auto stats = run.rt->step();
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (!st.ok() || !stats.ok()) break;
    if (after_step) after_step();
    out.losses.push_back(run.mlp.loss);
    out.stats.push_back(*stats);
  }
  EXPECT_TRUE(run.rt->flush().ok());
  out.state = read_state(*run.rt, run.mlp);
  out.plan = run.rt->plan();
  return out;
}

// --- exactness ---

struct ExactCase {
  std::string engine;
  std::uint64_t host_params;  // params that fit on host beside the staging
};

class NvmeParamsExact : public ::testing::TestWithParam<ExactCase> {};

TEST_P(NvmeParamsExact, BitIdenticalToAllOnHostWithWritesOutlivingStep) {
  const ExactCase c = GetParam();
  TempDir dir;
  std::string why;
  std::unique_ptr<NvmeStore> inner =
      testing::store_with_engine(dir.path, c.engine, kChunkBytes, nullptr, &why);
  if (inner == nullptr) GTEST_SKIP() << "the " << c.engine << " engine is not available here: " << why;
  auto slow = std::make_shared<SlowWritesNvme>(std::move(inner), std::chrono::milliseconds(20));
  RuntimeOptions o = nvme_params(dir.path, c.host_params);
  o.nvme_store = slow;
  int returned_with_writes_pending = 0;
  constexpr int kSteps = 6;
  Trained nvme = train(o, kSteps, [&] {
    // (The last family's writes are submitted just after its kernel ends: give
    // them a moment to start; each takes 20 ms.)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    returned_with_writes_pending += slow->pending_ > 0;
  });
  Trained host = train(on_host(), kSteps);
  ASSERT_EQ(nvme.losses.size(), static_cast<std::size_t>(kSteps));

  // The planner put params on NVMe by itself, each with its optimizer states.
  std::size_t nvme_homed = 0;
  for (const FamilyPlan& f : nvme.plan.families) {
    nvme_homed += f.param_home == Tier::kNvme;
    if (f.param_home == Tier::kNvme) {
      EXPECT_EQ(f.optim_home, Tier::kNvme);
    }
  }
  EXPECT_EQ(nvme_homed, kLayers - c.host_params);
  EXPECT_EQ(nvme.plan.param_staging_buffers, 4u);
  for (const FamilyPlan& f : host.plan.families) EXPECT_EQ(f.param_home, Tier::kHost);

  // Budgets held at every step, staging included; params really came from disk.
  std::uint64_t disk_read = 0;
  for (const StepStats& s : nvme.stats) {
    EXPECT_LE(s.host_high_water_bytes, o.budgets.host_bytes);
    EXPECT_LE(s.gpu_high_water_bytes, o.budgets.gpu_bytes);
    disk_read += s.bytes_disk_read;
  }
  EXPECT_GT(disk_read, 0u);
  EXPECT_GT(returned_with_writes_pending, 0) << "no write-back outlived step()";

  EXPECT_EQ(nvme.losses, host.losses);
  EXPECT_TRUE(nvme.state == host.state) << "params or optimizer states differ from the all-on-host run";
  EXPECT_LT(host.losses.back(), host.losses.front());
}

// Note [NVMe-homed params]: a steady step reads an NVMe-homed param for its forward
// and backward uses at most, and the optimizer copies the backward's copy (staging
// or device) rather than read it a third time where it still can; the counters
// split the reads so a user can tell.
TEST(NvmeParams, TheOptimizerCopiesAParamsBackwardCopyRatherThanReadItAgain) {
  TempDir dir;
  RuntimeOptions o = nvme_params(dir.path, 0);
  constexpr int kSteps = 6;
  Trained nvme = train(o, kSteps);
  Trained host = train(on_host(), kSteps);
  ASSERT_EQ(nvme.stats.size(), static_cast<std::size_t>(kSteps));
  std::uint64_t param_bytes = 0;  // every param's chunk is on NVMe (host_params 0)
  for (std::size_t f = 0; f < nvme.plan.families.size(); ++f) {
    ASSERT_EQ(nvme.plan.families[f].param_home, Tier::kNvme);
    param_bytes += kChunkBytes;
  }
  std::uint64_t update_reads = 0;
  for (int s = 2; s < kSteps; ++s) {  // steady steps, past the warm-up's and the plan's first
    const StepStats& st = nvme.stats[static_cast<std::size_t>(s)];
    SCOPED_TRACE(fmt::format("step {}: uses {} updates {} all {}", st.step, st.bytes_disk_read_param_uses,
                             st.bytes_disk_read_param_updates, st.bytes_disk_read));
    EXPECT_GT(st.bytes_disk_read_param_uses, 0u);
    EXPECT_LE(st.bytes_disk_read_param_uses, 2 * param_bytes);
    EXPECT_LE(st.bytes_disk_read_param_updates, param_bytes);
    update_reads += st.bytes_disk_read_param_updates;
    // The rest of the reads are the two Adam states, once each.
    EXPECT_EQ(st.bytes_disk_read - st.bytes_disk_read_param_uses - st.bytes_disk_read_param_updates,
              2 * param_bytes);
  }
  // Here 6 of the 8 families a step: copied from staging or from the device.
  // Timing decides which (a use on demand may take a buffer back), so the test
  // asks for fewer reads than one a family on average.
  EXPECT_LT(update_reads, (kSteps - 2) * param_bytes);
  EXPECT_EQ(nvme.losses, host.losses);
  EXPECT_TRUE(nvme.state == host.state) << "params or optimizer states differ from the all-on-host run";
}

INSTANTIATE_TEST_SUITE_P(Engines, NvmeParamsExact,
                         ::testing::Values(ExactCase{"posix", 0}, ExactCase{"uring", 0},
                                           ExactCase{"posix", 3}, ExactCase{"uring", 3}),
                         [](const auto& p) {
                           return p.param.engine + (p.param.host_params == 0 ? "_AllParams" : "_SomeParams");
                         });

// --- bad input ---

// Builds the MLP under `o`: the first call that plans (init_tensor) must fail
// with a one-line OutOfBudget naming each of `wanted`, and leave no file in `dir`.
void expect_refused(const RuntimeOptions& o, const fs::path& dir, const std::vector<std::string>& wanted) {
  {
    MlpRun run;
    auto rt = Runtime::create(*run.device, o);
    ASSERT_TRUE(rt.ok()) << rt.status();
    run.mlp.layers = kLayers;
    run.mlp.width = kWidth;
    Status st = run.mlp.build(**rt);
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.code(), StatusCode::kOutOfBudget) << st;
    EXPECT_EQ(st.message().find('\n'), std::string::npos) << st;
    for (const std::string& w : wanted) EXPECT_NE(st.message().find(w), std::string::npos) << w << ": " << st;
  }
  EXPECT_TRUE(fs::is_empty(dir)) << "files left behind in " << dir;
}

TEST(NvmeParams, HostBudgetBelowTheStagingIsOneLineAndLeavesNoFiles) {
  TempDir dir;
  RuntimeOptions o = nvme_params(dir.path, 0);
  o.budgets.host_bytes = kStagingBytes - kChunkBytes;
  expect_refused(o, dir.path,
                 {"is smaller than the staging NVMe-homed params need", format_bytes(o.budgets.host_bytes)});
}

TEST(NvmeParams, NvmeBudgetBelowParamsStatesAndCopyOnWriteRoomIsOneLineAndLeavesNoFiles) {
  TempDir dir;
  RuntimeOptions o = nvme_params(dir.path, 0);
  // Params and states fit, the copy-on-write room for one family does not.
  o.budgets.nvme_bytes = kLayers * 3 * kChunkBytes + kChunkBytes;
  expect_refused(o, dir.path, {"nvme_budget", "copy-on-write", format_bytes(o.budgets.nvme_bytes)});
}

TEST(NvmeParams, HostLeaseOfAnNvmeHomedParamIsRefusedByName) {
  TempDir dir;
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(start(run, nvme_params(dir.path, 0)));
  auto lease = run.rt->acquire(run.mlp.w[0], StateKind::kParam, Access::kRead, Where::kHost);
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(lease.status().message().find("lives on NVMe"), std::string::npos) << lease.status();
}

// Runtime::init_tensors (deferred init): a family handed whole is written without
// reading it first; a part of one is read, changed and written, keeping the rest.
TEST(NvmeParams, InitTensorsWritesAWholeFamilyWithoutReadingItAndKeepsTheRestOfAPart) {
  TempDir dir;
  IoFaults faults;
  std::string why;
  auto inner = testing::store_with_engine(dir.path, "posix", kChunkBytes, &faults, &why);
  ASSERT_NE(inner, nullptr) << why;
  RuntimeOptions o = nvme_params(dir.path, 0);
  o.nvme_store = std::make_shared<FaultyNvme>(std::move(inner));
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(start(run, o));
  ASSERT_TRUE(run.rt->flush().ok());
  const State before = read_state(*run.rt, run.mlp);
  ASSERT_FALSE(before.param[0].empty());
  std::vector<float> w(kWidth * kWidth, 0.25f), b(kWidth, -0.5f);
  const std::vector<TensorId> family0 = {run.mlp.b[0], run.mlp.w[0]};  // layer 0's family, in any order
  const std::vector<std::span<const float>> values0 = {b, w};
  faults.eio_reads = true;  // every NVMe read fails from here on
  Status whole = run.rt->init_tensors(family0, values0);
  ASSERT_TRUE(whole.ok()) << "a whole family was read before it was written: " << whole;
  // Only the weight of layer 1: its bias must be read first, and that read fails.
  const TensorId w1 = run.mlp.w[1];
  const std::span<const float> w_values(w);
  Status part = run.rt->init_tensors(std::span<const TensorId>(&w1, 1),
                                     std::span<const std::span<const float>>(&w_values, 1));
  EXPECT_EQ(part.code(), StatusCode::kIoError) << part;
  faults.eio_reads = false;
  ASSERT_TRUE(run.rt
                  ->init_tensors(std::span<const TensorId>(&w1, 1),
                                 std::span<const std::span<const float>>(&w_values, 1))
                  .ok());
  const State after = read_state(*run.rt, run.mlp);
  EXPECT_EQ(after.param[0], w);  // param[2l] is layer l's weight, param[2l + 1] its bias
  EXPECT_EQ(after.param[1], b);
  EXPECT_EQ(after.param[2], w);
  EXPECT_EQ(after.param[3], before.param[3]) << "layer 1's bias changed with its weight";
  EXPECT_EQ(after.param[4], before.param[4]);
  const std::vector<TensorId> short_list = {run.mlp.w[0]};
  EXPECT_EQ(run.rt->init_tensors(short_list, values0).code(), StatusCode::kInvalidArgument);
}

// --- faults ---

enum class Fault { kEioRead, kEioWrite, kFullDisk, kCorruptSlot };

// Trains 3 clean steps, injects `fault`, and checks the step that meets it:
// a clear error (family, param or states, file and offset where there is I/O),
// no further step, nothing applied to bad bytes, the last good state readable.
void fault_run(Fault fault) {
  TempDir dir;
  IoFaults faults;
  std::string why;
  auto inner = testing::store_with_engine(dir.path, "posix", kChunkBytes, &faults, &why);
  ASSERT_NE(inner, nullptr) << why;
  auto faulty = std::make_shared<FaultyNvme>(std::move(inner));
  faulty->swap_dir_ = dir.path;
  RuntimeOptions o = nvme_params(dir.path, 0);
  o.nvme_store = faulty;
  // Without read-ahead the next step's first NVMe read is family 0's param, on demand.
  o.plan.prefetch = false;
  MlpRun run;
  ASSERT_NO_FATAL_FAILURE(start(run, o));
  for (int s = 0; s < 3; ++s) {
    ASSERT_TRUE(run.mlp.train_step(*run.rt).ok());
    ASSERT_TRUE(run.rt->step().ok());
  }
  ASSERT_TRUE(run.rt->flush().ok());
  const State before = read_state(*run.rt, run.mlp);
  switch (fault) {
    case Fault::kEioRead:
      faults.eio_reads = true;
      break;
    case Fault::kEioWrite:
      faults.eio_writes = true;
      break;
    case Fault::kFullDisk:
      faulty->full_ = true;
      break;
    case Fault::kCorruptSlot:
      faulty->corrupt_next_read_ = true;
      break;
  }
  Status failed = run.mlp.train_step(*run.rt);
  if (failed.ok()) failed = run.rt->step().status();
  if (failed.ok()) failed = run.rt->flush();
  ASSERT_FALSE(failed.ok()) << "the injected fault went unnoticed";
  const std::string msg = failed.message();
  EXPECT_NE(msg.find("family"), std::string::npos) << failed;
  switch (fault) {
    case Fault::kEioRead:
      EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed;
      EXPECT_NE(msg.find("s param into a staging buffer"), std::string::npos) << failed;
      EXPECT_NE(msg.find(dir.path.string()), std::string::npos) << "names no file: " << failed;
      EXPECT_NE(msg.find("offset"), std::string::npos) << failed;
      break;
    case Fault::kEioWrite:
      EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed;
      EXPECT_NE(msg.find("param"), std::string::npos) << failed;
      EXPECT_NE(msg.find("kept in host memory"), std::string::npos) << failed;
      EXPECT_NE(msg.find(dir.path.string()), std::string::npos) << "names no file: " << failed;
      EXPECT_NE(msg.find("offset"), std::string::npos) << failed;
      break;
    case Fault::kFullDisk:
      EXPECT_EQ(failed.code(), StatusCode::kNoSpace) << failed;
      break;
    case Fault::kCorruptSlot:
      EXPECT_EQ(failed.code(), StatusCode::kCorrupt) << failed;
      EXPECT_NE(msg.find("s param into a staging buffer"), std::string::npos) << failed;
      EXPECT_NE(msg.find("CRC32C mismatch"), std::string::npos) << failed;
      EXPECT_NE(msg.find(dir.path.string()), std::string::npos) << "names no file: " << failed;
      EXPECT_NE(msg.find(std::to_string(faulty->corrupted_offset_ - 100)), std::string::npos)
          << "names no offset: " << failed;
      break;
  }
  // The failed step is discarded (Note [Failed steps]): by step() when it met
  // the error, else here; nothing goes on silently with half a step.
  EXPECT_TRUE(run.rt->abort_step().ok());
  faults.eio_reads = faults.eio_writes = false;
  faulty->full_ = false;

  int unreadable = 0;
  Status read_error;
  const State after = read_state(*run.rt, run.mlp, &unreadable, &read_error);
  const State next = train(on_host(), 4).state;  // what the failed step computes where it ran
  if (fault == Fault::kCorruptSlot) {
    // The corrupted param's tensors cannot be read back (their bytes are bad: the
    // read says so); every other tensor holds the last good state.
    EXPECT_EQ(unreadable, 2) << read_error;
    EXPECT_EQ(read_error.code(), StatusCode::kCorrupt) << read_error;
  } else {
    EXPECT_EQ(unreadable, 0) << read_error;
  }
  for (std::size_t j = 0; j < after.param.size(); ++j) {
    if (after.param[j].empty()) continue;
    const bool is_before =
        after.param[j] == before.param[j] && after.s0[j] == before.s0[j] && after.s1[j] == before.s1[j];
    const bool is_next =
        after.param[j] == next.param[j] && after.s0[j] == next.s0[j] && after.s1[j] == next.s1[j];
    if (fault == Fault::kEioRead || fault == Fault::kCorruptSlot) {
      // The read failed in forward: no optimizer ran, nothing was applied to bad bytes.
      EXPECT_TRUE(is_before) << "tensor " << j << " changed in a step whose param read failed; " << failed;
    } else {
      EXPECT_TRUE(is_before || is_next) << "tensor " << j << " holds neither step's state; " << failed;
    }
  }
  if (fault == Fault::kEioWrite || fault == Fault::kFullDisk) {
    // The family named: a full disk is found before anything is committed (it
    // keeps its last state); a failed write comes after the update (the new
    // state stays in host memory, nothing lost).
    const auto at = msg.find("family ");
    ASSERT_NE(at, std::string::npos);
    const std::size_t family = std::stoul(msg.substr(at + 7));
    ASSERT_LT(family, kLayers);
    const State& expected = fault == Fault::kEioWrite ? next : before;
    for (std::size_t j : {2 * family, 2 * family + 1}) {
      EXPECT_EQ(after.param[j], expected.param[j]) << "family " << family << " tensor " << j;
      EXPECT_EQ(after.s0[j], expected.s0[j]) << "family " << family << " tensor " << j;
    }
  }
  // Once the cause is gone the runtime trains on; a corrupted slot stays bad,
  // so its family's next read fails again, by name (Note [Failed steps]).
  Status again = run.mlp.train_step(*run.rt);
  if (again.ok()) again = run.rt->step().status();
  if (again.ok()) again = run.rt->flush();
  if (fault == Fault::kCorruptSlot) {
    EXPECT_EQ(again.code(), StatusCode::kCorrupt) << again;
    EXPECT_TRUE(run.rt->abort_step().ok());
    return;
  }
  ASSERT_TRUE(again.ok()) << again;
  // Nothing of the failed read's step was applied: the next step is the clean run's 4th.
  if (fault == Fault::kEioRead) {
    EXPECT_EQ(read_state(*run.rt, run.mlp), next);
  }
}

TEST(NvmeParamsFaults, EioOnReadNamesFamilyFileOffsetAndAppliesNothing) {
  fault_run(Fault::kEioRead);
}
TEST(NvmeParamsFaults, EioOnWriteKeepsTheUpdatedParamInHostMemory) {
  fault_run(Fault::kEioWrite);
}
TEST(NvmeParamsFaults, FullDiskKeepsTheLastState) {
  fault_run(Fault::kFullDisk);
}
TEST(NvmeParamsFaults, CorruptedSlotIsCaughtByItsChecksumAndNamed) {
  fault_run(Fault::kCorruptSlot);
}

// --- prefetch faults (Note [Prefetch errors] in runtime/src/residency/eviction.cpp) ---

struct PrefetchFaultRun {
  State state;
  std::vector<StepStats> stats;
  std::vector<Status> reported;  // failed prefetches the calls returned (each made again)
  Status fatal;                  // the first error that was not a failed prefetch
  int read_aheads_before = 0;    // reads ahead of use in the 3 clean steps
  int injected = 0;
  std::string dir;  // the swap directory the errors must name
};

// Trains 6 steps with read-ahead on; before step 4 the next read ahead of use
// fails with EIO, once (`persistent` false) or on every later read of its slot.
// A call that returns a failed prefetch is made again (Mlp::call).
PrefetchFaultRun prefetch_fault_run(bool persistent) {
  PrefetchFaultRun out;
  TempDir dir;
  out.dir = dir.path.string();
  IoFaults faults;
  std::string why;
  auto inner = testing::store_with_engine(dir.path, "posix", kChunkBytes, &faults, &why);
  EXPECT_NE(inner, nullptr) << why;
  if (inner == nullptr) return out;
  auto faulty = std::make_shared<FaultyNvme>(std::move(inner));
  faulty->faults_ = &faults;
  faulty->persistent_ = persistent;
  RuntimeOptions o = nvme_params(dir.path, 0);
  o.nvme_store = faulty;
  MlpRun run;
  start(run, o);
  if (run.rt == nullptr) return out;
  run.mlp.prefetch_errors = &out.reported;
  for (int s = 0; s < 6 && out.fatal.ok(); ++s) {
    if (s == 3) {
      out.read_aheads_before = faulty->read_aheads_;
      faulty->fail_read_aheads_ = 1;
    }
    out.fatal = run.mlp.train_step(*run.rt);
    if (!out.fatal.ok()) break;
    auto stats = run.mlp.call([&] { return run.rt->step(); });
    if (!stats.ok()) {
      out.fatal = stats.status();
      break;
    }
    out.stats.push_back(*stats);
  }
  if (out.fatal.ok()) out.fatal = run.rt->flush();
  faults.clear_bad_reads();
  out.injected = faults.injected;
  if (out.fatal.ok()) out.state = read_state(*run.rt, run.mlp);
  if (!out.fatal.ok()) {
    // Whatever met the error, its step is discarded and the runtime ready for the next (Note [Failed steps]).
    EXPECT_TRUE(run.rt->abort_step().ok());
  }
  return out;
}

void expect_names_the_read(const Status& s, const std::string& dir) {
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s;
  EXPECT_NE(s.message().find("NVMe read of family "), std::string::npos) << s;
  EXPECT_NE(s.message().find("s param into a staging buffer"), std::string::npos) << s;
  EXPECT_NE(s.message().find(dir), std::string::npos) << "names no file: " << s;
  EXPECT_NE(s.message().find("offset"), std::string::npos) << s;
}

TEST(NvmeParamsFaults, FailedPrefetchIsTheNextCallsErrorOnceCountedAndChangesNothing) {
  const PrefetchFaultRun run = prefetch_fault_run(/*persistent=*/false);
  const std::string& dir = run.dir;
  ASSERT_TRUE(run.fatal.ok()) << "a failed read ahead of use stopped training: " << run.fatal;
  ASSERT_GT(run.read_aheads_before, 0) << "no read ahead of use in the clean steps: nothing was tested";
  ASSERT_EQ(run.injected, 1);
  // Returned once, by one call, saying what failed.
  ASSERT_EQ(run.reported.size(), 1u);
  const Status& r = run.reported[0];
  EXPECT_NE(r.message().find("prefetch (a read ahead of use): "), std::string::npos) << r;
  expect_names_the_read(r, dir);
  // Counted in the stats of the step it happened in (the 4th), with its message.
  ASSERT_EQ(run.stats.size(), 6u);
  std::uint64_t counted = 0;
  for (std::size_t s = 0; s < run.stats.size(); ++s) {
    counted += run.stats[s].prefetch_errors;
    EXPECT_EQ(run.stats[s].first_prefetch_error.empty(), run.stats[s].prefetch_errors == 0) << "step " << s;
  }
  EXPECT_EQ(counted, 1u);
  EXPECT_EQ(run.stats[3].prefetch_errors, 1u);
  EXPECT_EQ(run.stats[3].first_prefetch_error, r.to_string());
  // The use read the param itself: the run is bit-identical to one without the fault.
  TempDir clean;
  const Trained expected = train(nvme_params(clean.path, 0), 6);
  EXPECT_TRUE(run.state == expected.state) << "a failed prefetch changed the training";
}

TEST(NvmeParamsFaults, PersistentFaultAfterAFailedPrefetchFailsTheUseClearly) {
  const PrefetchFaultRun run = prefetch_fault_run(/*persistent=*/true);
  const std::string& dir = run.dir;
  ASSERT_GT(run.read_aheads_before, 0) << "no read ahead of use in the clean steps: nothing was tested";
  ASSERT_FALSE(run.fatal.ok()) << "a slot that fails every read went unnoticed";
  // The bad slot was read twice: ahead of use (not fatal; a call returns it only
  // if one comes before the use) and by the use itself, whose failure stops the
  // runtime and names the read.
  EXPECT_GE(run.injected, 2) << "the use did not read the param again after its prefetch failed";
  for (const Status& r : run.reported) {
    EXPECT_NE(r.message().find("prefetch (a read ahead of use): "), std::string::npos) << r;
    expect_names_the_read(r, dir);
  }
  EXPECT_EQ(run.fatal.message().find("prefetch"), std::string::npos) << run.fatal;
  expect_names_the_read(run.fatal, dir);
}

}  // namespace
}  // namespace strata::runtime
