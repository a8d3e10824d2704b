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

//! NVMe slots in memory: 8 KiB each, so a chunk spans several; every transfer completes
//! at once, on the calling thread.
class MemoryNvme final : public NvmeStore {
 public:
  std::uint64_t slot_bytes() const override { return 8192; }
  Result<std::uint32_t> allocate_slot() override {
    std::lock_guard lock(mu_);
    slots_[next_];
    return next_++;
  }
  void free_slot(std::uint32_t slot) override {
    std::lock_guard lock(mu_);
    slots_.erase(slot);
  }
  Status write(std::uint32_t slot, std::span<const std::byte> data, runtime::IoDone done) override {
    {
      std::lock_guard lock(mu_);
      slots_[slot].assign(data.begin(), data.end());
    }
    done(Status::Ok());
    return Status::Ok();
  }
  Status read(std::uint32_t slot, std::span<std::byte> data, runtime::IoDone done) override {
    Status st = Status::Ok();
    {
      std::lock_guard lock(mu_);
      auto it = slots_.find(slot);
      if (it == slots_.end() || it->second.size() < data.size()) {
        st = internal_error("slot {} read before it was written", slot);
      } else {
        std::memcpy(data.data(), it->second.data(), data.size());
      }
    }
    done(st);
    return Status::Ok();
  }
  std::uint64_t used_bytes() const override { return 0; }
  std::string describe() const override { return "memory"; }
  std::size_t slots_in_use() {
    std::lock_guard lock(mu_);
    return slots_.size();
  }

 private:
  std::mutex mu_;
  std::map<std::uint32_t, std::vector<std::byte>> slots_;
  std::uint32_t next_ = 0;
};

//! A model's tensors packed into families of `per_family` tensors each, every chunk
//! (param, state0, state1: fp32, AdamW's) in host memory; with `nvme`, the optimizer
//! states of every other family live only in NVMe slots (MemoryNvme).
class MemorySource final : public Source {
 public:
  MemorySource(const std::vector<std::uint64_t>& numels, std::size_t per_family, bool nvme = false) {
    if (nvme) nvme_ = std::make_shared<MemoryNvme>();
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
    for (FamilyId f = 0; f < families_.size(); ++f) store_on_nvme(f);
  }

  //! Tensor t's values of kind k (from its NVMe slots where it lives there).
  std::vector<float> values(TensorId t, StateKind k) {
    const TensorEntry& e = tensors_[t];
    if (on_nvme(e.family, k)) load_from_nvme(e.family, k);
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
    store_on_nvme(f);
  }
  //! Pins taken and not released (the library must release every one).
  int pins = 0;
  //! NVMe slots holding a value (the library must free the ones it wrote and dropped).
  std::size_t nvme_slots_in_use() { return nvme_ != nullptr ? nvme_->slots_in_use() : 0; }
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
      FamilyEntry e{.tensors = fam.tensors,
                    .shard_elems = fam.elems,
                    .optim_on_nvme = on_nvme(static_cast<FamilyId>(d.families.size()), StateKind::kState0)};
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
    if (on_nvme(f, k)) return {.where = ChunkPlace::Where::kNvme, .slots = families_[f].slots[index(k)]};
    const std::vector<float>& c = chunk(families_[f], k);
    return {.where = ChunkPlace::Where::kHost,
            .host = reinterpret_cast<std::byte*>(const_cast<float*>(c.data()))};
  }
  Status copy_value(FamilyId f, StateKind k, std::byte* dst) override {
    EXPECT_FALSE(on_nvme(f, k)) << "copy_value of a chunk on NVMe";
    const std::vector<float>& c = chunk(families_[f], k);
    std::memcpy(dst, c.data(), c.size() * 4);
    return Status::Ok();
  }
  void pin_slot(std::uint32_t) override { ++pins; }
  void unpin_slot(std::uint32_t) override { --pins; }
  std::shared_ptr<NvmeStore> nvme_store() const override { return nvme_; }
  void launch_update(FamilyId f) override { launched.push_back(f); }
  Status read_chunk(std::unique_lock<std::mutex>&, FamilyId f, StateKind k,
                    const std::function<void(const std::byte*)>& fn) override {
    fn(reinterpret_cast<const std::byte*>(chunk(families_[f], k).data()));
    return Status::Ok();
  }
  Status overwrite_chunk(std::unique_lock<std::mutex>&, FamilyId f, StateKind k,
                         const std::function<void(std::byte*)>& fn) override {
    EXPECT_FALSE(on_nvme(f, k)) << "a load overwrites an NVMe chunk through its shadow";
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
  void replace_slots(FamilyId f, StateKind k, std::vector<std::uint32_t> slots) override {
    EXPECT_TRUE(on_nvme(f, k));
    for (std::uint32_t old : families_[f].slots[index(k)]) nvme_->free_slot(old);
    families_[f].slots[index(k)] = std::move(slots);
  }
  void set_counters(TensorId t, std::int64_t steps, std::uint32_t group) override {
    tensors_[t].steps = steps;
    tensors_[t].group = group;
  }
  void set_group(const GroupEntry& g) override { groups.push_back(g); }
  std::int64_t steps(TensorId t) const { return tensors_[t].steps; }

 private:
  static constexpr StateKind kKinds[] = {StateKind::kParam, StateKind::kState0, StateKind::kState1};
  static std::size_t index(StateKind k) { return static_cast<std::size_t>(k); }
  //! Family f's `k` chunk lives on NVMe: every other family's optimizer states.
  bool on_nvme(FamilyId f, StateKind k) const {
    return nvme_ != nullptr && f % 2 == 1 && runtime::is_optim_kind(k);
  }
  //! Writes family f's NVMe-held chunks from their host image to fresh slots.
  void store_on_nvme(FamilyId f) {
    for (StateKind k : kKinds) {
      if (!on_nvme(f, k)) continue;
      std::vector<std::uint32_t>& slots = families_[f].slots[index(k)];
      for (std::uint32_t old : slots) nvme_->free_slot(old);
      slots.clear();
      const auto* bytes = reinterpret_cast<const std::byte*>(chunk(families_[f], k).data());
      const std::uint64_t n = families_[f].elems * 4;
      for (std::uint64_t at = 0; at < n; at += nvme_->slot_bytes()) {
        slots.push_back(nvme_->allocate_slot().value());
        const std::span<const std::byte> part(bytes + at,
                                              std::min<std::uint64_t>(nvme_->slot_bytes(), n - at));
        EXPECT_TRUE(nvme_->write(slots.back(), part, [](Status st) { EXPECT_TRUE(st.ok()); }).ok());
      }
    }
  }
  //! Reads family f's `k` chunk back from its slots into its host image.
  void load_from_nvme(FamilyId f, StateKind k) {
    auto* bytes = reinterpret_cast<std::byte*>(chunk(families_[f], k).data());
    const std::uint64_t n = families_[f].elems * 4;
    const std::vector<std::uint32_t>& slots = families_[f].slots[index(k)];
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const std::uint64_t at = i * nvme_->slot_bytes();
      const std::span<std::byte> part(bytes + at, std::min<std::uint64_t>(nvme_->slot_bytes(), n - at));
      EXPECT_TRUE(nvme_->read(slots[i], part, [](Status st) { EXPECT_TRUE(st.ok()); }).ok());
    }
  }

  struct Family {
    std::vector<std::uint32_t> slots[kStateKindCount];  //!< where an NVMe-held chunk lives
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
  std::shared_ptr<MemoryNvme> nvme_;
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

// Optimizer states that live only in NVMe slots: the save reads them from their pinned
// slots, the load writes them to fresh slots (shadows) and commits them; every pin is
// released and no slot is left behind.
TEST(CheckpointSource, NvmeHeldStatesSaveFromPinnedSlotsAndLoadThroughShadows) {
  TempDir dir;
  MemorySource a(kNumels, 2, /*nvme=*/true);
  for (FamilyId f = 0; f < a.family_count(); ++f) a.update(f, 100 + f);
  const std::size_t a_slots = a.nvme_slots_in_use();
  ASSERT_GT(a_slots, 0u);
  Checkpointer saver(a);
  for (bool overlapped : {false, true}) {
    std::unique_lock lock(a.mutex());
    ASSERT_TRUE((overlapped ? saver.begin(lock, dir.str()) : saver.save(lock, dir.str())).ok());
    Status finished = saver.finish(lock);
    ASSERT_TRUE(finished.ok()) << finished.to_string();
    EXPECT_EQ(a.pins, 0);
  }
  EXPECT_EQ(a.nvme_slots_in_use(), a_slots);
  MemorySource b(kNumels, 2, /*nvme=*/true);
  const std::size_t b_slots = b.nvme_slots_in_use();
  Checkpointer loader(b);
  {
    std::unique_lock lock(b.mutex());
    Status st = loader.load(lock, dir.str());
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  expect_same_values(a, b);
  EXPECT_EQ(b.nvme_slots_in_use(), b_slots);  // the old slots freed as the shadows replaced them
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
