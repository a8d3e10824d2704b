#pragma once
// CheckpointSource: the runtime as the checkpoint library's family-snapshot
// interface (checkpoint::Source, runtime/checkpoint/include/strata/checkpoint/source.hpp).
// It answers from Core's tables and chunks, and calls the pipeline (write-backs,
// launches), residency (a device chunk's slot), data parallelism (agreements,
// gathers) and with_host_copy. Its lock is Core::mu (Note [Snapshot lock] is Note
// [Lock discipline] seen from the library). Runtime::Impl owns one, and the
// Checkpointer over it (runtime_impl.hpp).

#include "strata/checkpoint/source.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {

class CheckpointSource final : public checkpoint::Source {
 public:
  explicit CheckpointSource(Runtime::Impl& m) : m_(m) {}

  std::mutex& mutex() override;
  std::condition_variable& changed() override;
  int ranks() const override;
  int rank() const override;
  const std::vector<std::string>& nvme_dirs() const override;

  bool leased() const override;
  Status finalize(std::unique_lock<std::mutex>& lock) override;
  Status wait_updates(std::unique_lock<std::mutex>& lock) override;
  Status background_error() override;
  checkpoint::Description describe() const override;

  bool writing_back(FamilyId f) const override;
  bool updates_pending(FamilyId f) const override;
  checkpoint::ChunkPlace place(FamilyId f, StateKind k) const override;
  Status copy_value(FamilyId f, StateKind k, std::byte* dst) override;
  void pin_slot(std::uint32_t slot) override;
  void unpin_slot(std::uint32_t slot) override;
  std::shared_ptr<NvmeStore> nvme_store() const override;
  void launch_update(FamilyId f) override;

  Status read_chunk(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k,
                    const std::function<void(const std::byte*)>& fn) override;
  Status overwrite_chunk(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k,
                         const std::function<void(std::byte*)>& fn) override;

  Status all_ok(std::unique_lock<std::mutex>& lock, Status mine, std::string_view what) override;
  Result<std::int64_t> max(std::unique_lock<std::mutex>& lock, std::int64_t value) override;
  Result<std::vector<std::string>> exchange_text(std::unique_lock<std::mutex>& lock,
                                                 const std::string& text) override;
  Status broadcast_initial(std::unique_lock<std::mutex>& lock) override;
  Status finish_gathers(std::unique_lock<std::mutex>& lock) override;
  Status all_gather(std::unique_lock<std::mutex>& lock, std::byte* whole, std::uint64_t shard_bytes) override;
  void abort_ranks(const std::string& why) override;

  Status open_nvme_store() override;
  HostStore& host_store() override;
  void replace_slots(FamilyId f, StateKind k, std::vector<std::uint32_t> slots) override;
  void set_counters(TensorId t, std::int64_t steps, std::uint32_t group) override;
  void set_group(const checkpoint::GroupEntry& g) override;

 private:
  Runtime::Impl& m_;
};

}  // namespace strata::runtime
