// The checkpoint library over its family-snapshot interface alone (checkpoint::Source),
// with no runtime: a source over plain memory (MemorySource) is saved, loaded into
// another with other chunk families, and a save begun before its "updates" holds
// the values as of the call. This binary links strata_checkpoint and not
// strata_runtime, so its link fails if the library comes to need the runtime.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "offload/test_util.hpp"
#include "strata/checkpoint/checkpointer.hpp"
#include "strata/checkpoint/source.hpp"

namespace strata::checkpoint {
namespace {

namespace fs = std::filesystem;

//! Host memory under no budget: the load's shadow buffers would come from it (this
//! source puts nothing on NVMe, so none do).
class MallocHostStore final : public HostStore {
 public:
  Result<std::byte*> allocate(std::uint64_t bytes) override {
    used_ += bytes;
    return static_cast<std::byte*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  }
  void free(std::byte* data, std::uint64_t bytes) override {
    used_ -= bytes;
    std::free(data);
  }
  std::uint64_t used_bytes() const override { return used_; }
  std::uint64_t high_water_bytes() const override { return used_; }
  std::uint64_t budget_bytes() const override { return std::uint64_t{1} << 30; }
  std::vector<std::span<std::byte>> regions() const override { return {}; }
  std::string describe() const override { return "malloc"; }

 private:
  std::uint64_t used_ = 0;
};

//! A model's tensors packed into families of `per_family` tensors each, every chunk
//! (param, state0, state1: fp32, AdamW's) in host memory.
class MemorySource final : public Source {
 public:
  MemorySource(const std::vector<std::uint64_t>& numels, std::size_t per_family) {
    for (std::size_t t = 0; t < numels.size(); ++t) {
      if (t % per_family == 0) families_.emplace_back();
      Family& fam = families_.back();
      std::string name = std::to_string(t);
      name.insert(name.begin(), 't');  // (not "t" + ...: GCC 12's -Wrestrict misfires on it)
      tensors_.push_back({.name = std::move(name),
                          .shape = {static_cast<std::int64_t>(numels[t])},
                          .numel = numels[t],
                          .family = static_cast<FamilyId>(families_.size() - 1),
                          .offset_elems = fam.elems});
      tensors_.back().shard = {.first = 0, .count = numels[t], .at = fam.elems};
      fam.tensors.push_back(static_cast<TensorId>(t));
      fam.elems += numels[t];
    }
    for (Family& fam : families_) {
      for (StateKind k : kKinds) chunk(fam, k).assign(fam.elems, 0.0f);
    }
  }

  //! Tensor t's values of kind k.
  std::vector<float> values(TensorId t, StateKind k) {
    const TensorEntry& e = tensors_[t];
    const std::vector<float>& c = chunk(families_[e.family], k);
    return {c.begin() + static_cast<std::ptrdiff_t>(e.offset_elems),
            c.begin() + static_cast<std::ptrdiff_t>(e.offset_elems + e.numel)};
  }
  //! Fills every chunk of family f with values drawn from `seed`, and its tensors'
  //! step counters: what an update does.
  void update(FamilyId f, unsigned seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal;
    for (StateKind k : kKinds) {
      for (float& x : chunk(families_[f], k)) x = normal(gen);
    }
    for (TensorId t : families_[f].tensors) ++tensors_[t].steps;
  }
  std::size_t family_count() const { return families_.size(); }
  std::vector<FamilyId> launched;  //!< updates the save held back and then launched
  bool pending = false;            //!< updates_pending's answer
  std::vector<GroupEntry> groups;

  std::mutex& mutex() override { return mu_; }
  std::condition_variable& changed() override { return cv_; }
  int ranks() const override { return 1; }
  int rank() const override { return 0; }
  const std::vector<std::string>& nvme_dirs() const override { return nvme_dirs_; }
  bool leased() const override { return false; }
  Status finalize(std::unique_lock<std::mutex>&) override { return Status::Ok(); }
  Status wait_updates(std::unique_lock<std::mutex>&) override { return Status::Ok(); }
  Status background_error() override { return Status::Ok(); }
  Description describe() const override {
    Description d;
    d.tensors = tensors_;
    for (const Family& fam : families_) {
      FamilyEntry e{.tensors = fam.tensors, .shard_elems = fam.elems};
      for (StateKind k : kKinds) e.chunk_bytes[static_cast<std::size_t>(k)] = fam.elems * 4;
      d.families.push_back(std::move(e));
    }
    d.groups = groups;
    for (DType& t : d.kind_dtype) t = DType::kF32;
    d.state_count = 2;
    d.optimizer = "adamw";
    d.host_budget_bytes = std::uint64_t{1} << 30;
    d.planned_host_bytes = d.host_budget_bytes;
    return d;
  }
  bool writing_back(FamilyId) const override { return false; }
  bool updates_pending(FamilyId) const override { return pending; }
  ChunkPlace place(FamilyId f, StateKind k) const override {
    const std::vector<float>& c = chunk(families_[f], k);
    return {.where = ChunkPlace::Where::kHost,
            .host = reinterpret_cast<std::byte*>(const_cast<float*>(c.data()))};
  }
  Status copy_value(FamilyId f, StateKind k, std::byte* dst) override {
    const std::vector<float>& c = chunk(families_[f], k);
    std::memcpy(dst, c.data(), c.size() * 4);
    return Status::Ok();
  }
  void pin_slot(std::uint32_t) override {}
  void unpin_slot(std::uint32_t) override {}
  std::shared_ptr<NvmeStore> nvme_store() const override { return nullptr; }
  void launch_update(FamilyId f) override { launched.push_back(f); }
  Status read_chunk(std::unique_lock<std::mutex>&, FamilyId f, StateKind k,
                    const std::function<void(const std::byte*)>& fn) override {
    fn(reinterpret_cast<const std::byte*>(chunk(families_[f], k).data()));
    return Status::Ok();
  }
  Status overwrite_chunk(std::unique_lock<std::mutex>&, FamilyId f, StateKind k,
                         const std::function<void(std::byte*)>& fn) override {
    std::vector<float> fresh(families_[f].elems, 0.0f);
    fn(reinterpret_cast<std::byte*>(fresh.data()));
    chunk(families_[f], k) = std::move(fresh);
    return Status::Ok();
  }
  Status all_ok(std::unique_lock<std::mutex>&, Status mine, std::string_view) override { return mine; }
  Result<std::int64_t> max(std::unique_lock<std::mutex>&, std::int64_t value) override { return value; }
  Result<std::vector<std::string>> exchange_text(std::unique_lock<std::mutex>&,
                                                 const std::string& text) override {
    return std::vector<std::string>{text};
  }
  Status broadcast_initial(std::unique_lock<std::mutex>&) override { return Status::Ok(); }
  Status finish_gathers(std::unique_lock<std::mutex>&) override { return Status::Ok(); }
  Status all_gather(std::unique_lock<std::mutex>&, std::byte*, std::uint64_t) override {
    return Status::Ok();
  }
  void abort_ranks(const std::string&) override {}
  Status open_nvme_store() override { return Status::Ok(); }
  HostStore& host_store() override { return host_; }
  void replace_slots(FamilyId, StateKind, std::vector<std::uint32_t>) override {
    ADD_FAILURE() << "no NVMe here";
  }
  void set_counters(TensorId t, std::int64_t steps, std::uint32_t group) override {
    tensors_[t].steps = steps;
    tensors_[t].group = group;
  }
  void set_group(const GroupEntry& g) override { groups.push_back(g); }
  std::int64_t steps(TensorId t) const { return tensors_[t].steps; }

 private:
  static constexpr StateKind kKinds[] = {StateKind::kParam, StateKind::kState0, StateKind::kState1};
  struct Family {
    std::vector<TensorId> tensors;
    std::uint64_t elems = 0;
    std::vector<float> chunks[kStateKindCount];
  };
  static std::vector<float>& chunk(Family& fam, StateKind k) {
    return fam.chunks[static_cast<std::size_t>(k)];
  }
  static const std::vector<float>& chunk(const Family& fam, StateKind k) {
    return fam.chunks[static_cast<std::size_t>(k)];
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<TensorEntry> tensors_;
  std::vector<Family> families_;
  std::vector<std::string> nvme_dirs_;
  MallocHostStore host_;
};

const std::vector<std::uint64_t> kNumels = {1000, 37, 4096, 5, 777, 2048};

//! A fresh directory, removed with what is in it; the checkpoints here are a few hundred KiB.
class TempDir : public offload::testing::TempDir {
 public:
  TempDir() {
    EXPECT_GE(fs::space(path()).available, std::uint64_t{64} << 20)
        << "the checkpoint test needs 64 MiB free";
  }
  std::string str() const { return path().string(); }
};

void expect_same_values(MemorySource& a, MemorySource& b) {
  for (TensorId t = 0; t < kNumels.size(); ++t) {
    for (StateKind k : {StateKind::kParam, StateKind::kState0, StateKind::kState1}) {
      EXPECT_EQ(a.values(t, k), b.values(t, k)) << "tensor " << t << " " << runtime::state_kind_name(k);
    }
    EXPECT_EQ(a.steps(t), b.steps(t)) << "tensor " << t;
  }
}

TEST(CheckpointSource, LoadsBitForBitIntoSourcesWithOtherFamilies) {
  TempDir dir;
  MemorySource a(kNumels, 2);
  for (FamilyId f = 0; f < a.family_count(); ++f) a.update(f, 100 + f);
  a.groups = {{.group = 1, .lr = 0.5f, .weight_decay = 0.25f}};
  Checkpointer saver(a);
  {
    std::unique_lock lock(a.mutex());
    ASSERT_TRUE(saver.save(lock, dir.str()).ok());
  }
  // The layout is per tensor: one tensor a family, and all in one family, load it too.
  for (std::size_t per_family : {std::size_t{1}, kNumels.size()}) {
    MemorySource b(kNumels, per_family);
    Checkpointer loader(b);
    std::unique_lock lock(b.mutex());
    Status st = loader.load(lock, dir.str());
    ASSERT_TRUE(st.ok()) << st.to_string();
    lock.unlock();
    expect_same_values(a, b);
    ASSERT_EQ(b.groups.size(), 1u);
    EXPECT_EQ(b.groups[0].lr, 0.5f);
    EXPECT_EQ(b.groups[0].weight_decay, 0.25f);
  }
}

TEST(CheckpointSource, AnOverlappedSaveHoldsTheValuesAsOfItsBegin) {
  TempDir dir;
  MemorySource a(kNumels, 2);
  for (FamilyId f = 0; f < a.family_count(); ++f) a.update(f, 100 + f);
  MemorySource before(kNumels, 2);
  for (FamilyId f = 0; f < before.family_count(); ++f) before.update(f, 100 + f);
  Checkpointer saver(a);
  std::unique_lock lock(a.mutex());
  ASSERT_TRUE(saver.begin(lock, dir.str()).ok());
  // Every family is updated while the save runs, as a training step would: each only
  // once the save allows it (captured, or captured here first).
  a.pending = true;
  for (FamilyId f = 0; f < a.family_count(); ++f) {
    ASSERT_TRUE(saver.capture_for_update(lock, f).ok());
    ASSERT_TRUE(saver.allows_update(f));
    a.update(f, 900 + f);
  }
  Status finished = saver.finish(lock);
  ASSERT_TRUE(finished.ok()) << finished.to_string();
  lock.unlock();
  MemorySource b(kNumels, 3);
  Checkpointer loader(b);
  std::unique_lock lb(b.mutex());
  ASSERT_TRUE(loader.load(lb, dir.str()).ok());
  lb.unlock();
  expect_same_values(before, b);
}

TEST(CheckpointSource, RefusesAFlippedByteAndLoadsNothing) {
  TempDir dir;
  MemorySource a(kNumels, 2);
  for (FamilyId f = 0; f < a.family_count(); ++f) a.update(f, 100 + f);
  Checkpointer saver(a);
  {
    std::unique_lock lock(a.mutex());
    ASSERT_TRUE(saver.save(lock, dir.str()).ok());
  }
  saver.wait_stale_removed();
  fs::path data;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    if (e.path().filename().string().starts_with("family-1.")) data = e.path();
  }
  ASSERT_FALSE(data.empty());
  offload::testing::flip_byte(data, 100);
  MemorySource b(kNumels, 2);
  Checkpointer loader(b);
  std::unique_lock lock(b.mutex());
  Status st = loader.load(lock, dir.str());
  EXPECT_EQ(st.code(), StatusCode::kCorrupt) << st.to_string();
  EXPECT_NE(st.message().find(data.filename().string()), std::string::npos) << st.to_string();
  for (TensorId t = 0; t < kNumels.size(); ++t) {
    EXPECT_EQ(b.values(t, StateKind::kParam), std::vector<float>(kNumels[t], 0.0f));
  }
}

TEST(CheckpointSource, RefusesAnotherModelNamingTheTensor) {
  TempDir dir;
  MemorySource a(kNumels, 2);
  Checkpointer saver(a);
  {
    std::unique_lock lock(a.mutex());
    ASSERT_TRUE(saver.save(lock, dir.str()).ok());
  }
  std::vector<std::uint64_t> other = kNumels;
  other[2] += 1;
  MemorySource b(other, 2);
  Checkpointer loader(b);
  std::unique_lock lock(b.mutex());
  Status st = loader.load(lock, dir.str());
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  EXPECT_NE(st.message().find("\"t2\" has shape [4096] there, [4097] here"), std::string::npos)
      << st.to_string();
}

}  // namespace
}  // namespace strata::checkpoint
