#pragma once
// checkpoint::Source: the family-snapshot interface. What the checkpoint library
// (runtime/checkpoint/, README.md there) needs of the state it saves and loads,
// and all it may touch of it: a description of the registered tensors and their
// chunk families, one family's chunks captured (a host copy, or the NVMe slots
// that hold it, pinned), any chunk read or overwritten through a host copy, the
// data-parallel agreements, and a load's NVMe shadows committed. The runtime
// implements it (runtime/src/checkpoint_source.cpp); the library's own test
// implements it over plain memory (tests/checkpoint/test_checkpoint_source.cpp), so
// the library links without strata_runtime.
//
// Note [Snapshot lock]
// The source's state is guarded by one lock, the source's (the runtime's Core::mu,
// Note [Lock discipline]), and waiters wait on its condition variable (changed()).
// Every member below expects that lock held unless its comment says "no lock"; a
// member handed the `std::unique_lock&` may unlock it while it waits. The library
// takes the lock itself on its save thread, and notifies changed() whenever what a
// waiter of the source waits for (a capture, room) may have changed.

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/runtime/state_kind.hpp"
#include "strata/runtime/stores.hpp"
#include "strata/runtime/tensor.hpp"

namespace strata::checkpoint {

using runtime::DType;
using runtime::FamilyId;
using runtime::HostStore;
using runtime::kStateKindCount;
using runtime::NvmeStore;
using runtime::StateKind;
using runtime::TensorId;

//! The part of a tensor in this rank's shard of its family's masters and optimizer
//! states: tensor elements [first, first + count), at element `at` of the family's
//! optimizer chunks (count 0: none of it). One rank: the whole tensor at its offset.
struct ShardPart {
  std::uint64_t first = 0, count = 0, at = 0;
};

//! One registered tensor as a checkpoint sees it.
struct TensorEntry {
  std::string name;
  std::vector<std::int64_t> shape;
  bool frozen = false;
  std::uint64_t numel = 0;
  FamilyId family = 0;
  std::uint64_t offset_elems = 0;  //!< where its elements start in its family's chunks
  ShardPart shard;                 //!< this rank's part of its masters and states
  std::int64_t steps = 0;          //!< optimizer steps applied (its bias correction)
  std::uint32_t group = 0;         //!< its parameter group
};

//! One chunk family: its tensors and the bytes of each kind's chunk here.
struct FamilyEntry {
  std::vector<TensorId> tensors;                    //!< in the family's layout order
  std::uint64_t chunk_bytes[kStateKindCount] = {};  //!< 0: no chunk of that kind
  std::uint64_t shard_elems = 0;                    //!< elements of this rank's shard of its optimizer chunks
  bool owned = true;           //!< this rank writes its file (family f mod ranks == rank)
  bool optim_on_nvme = false;  //!< its masters and optimizer states live on NVMe
};

//! A parameter group's overrides (only groups that have them are described).
struct GroupEntry {
  std::uint32_t group = 0;
  float lr = 0.0f;
  float weight_decay = 0.0f;
};

//! What a checkpoint records besides the chunks' bytes, as of one moment (taken with
//! the lock held; the library reads it without the lock afterwards).
struct Description {
  std::vector<TensorEntry> tensors;   //!< by TensorId
  std::vector<FamilyEntry> families;  //!< by FamilyId
  std::vector<GroupEntry> groups;
  DType kind_dtype[kStateKindCount] = {};  //!< the dtype each kind's chunks hold
  bool separate_master = false;            //!< the fp32 master is a chunk of its own
  DType compute_dtype = DType::kF32;
  DType state_dtype = DType::kF32;
  std::uint32_t state_count = 0;  //!< optimizer states per element
  std::string optimizer;          //!< the optimizer's name
  std::int64_t step_index = 0;
  std::uint64_t host_budget_bytes = 0;   //!< an overlapped save's room is a share of it
  std::uint64_t planned_host_bytes = 0;  //!< the plan's host bytes: a load's shadow buffers stay within
};

//! Where a chunk's value is now.
struct ChunkPlace {
  enum class Where : std::uint8_t {
    kNvme,  //!< only in `slots` of the NVMe store
    kHost,  //!< at `host` (host memory the source owns)
    kOther  //!< elsewhere (the device, not yet written): copy_value copies it
  };
  Where where = Where::kOther;
  std::byte* host = nullptr;
  std::vector<std::uint32_t> slots;
};

//! The family-snapshot interface (Note [Snapshot lock] on locking).
class Source {
 public:
  virtual ~Source() = default;

  // --- The lock (Note [Snapshot lock]) ---
  virtual std::mutex& mutex() = 0;
  virtual std::condition_variable& changed() = 0;

  // --- Facts fixed at creation (no lock) ---
  //! Data-parallel ranks (1 alone) and this one's index.
  virtual int ranks() const = 0;
  virtual int rank() const = 0;
  //! The NVMe tier's directories: a checkpoint may not be inside one.
  virtual const std::vector<std::string>& nvme_dirs() const = 0;

  // --- Before a save or a load ---
  //! A lease (a pointer the caller holds into a chunk) is out.
  virtual bool leased() const = 0;
  //! Fixes the layout (and adopts the first plan) if not yet done.
  virtual Status finalize(std::unique_lock<std::mutex>& lock) = 0;
  //! Waits until no optimizer update or NVMe write-back runs.
  virtual Status wait_updates(std::unique_lock<std::mutex>& lock) = 0;
  //! A background error that makes the state unsafe to save.
  virtual Status background_error() = 0;
  //! The tensors, families and metadata now (after finalize).
  virtual Description describe() const = 0;

  // --- Capturing a family (Note [Overlapped save] in capture.cpp) ---
  //! Family f's last update is still being written to NVMe: its slots hold the
  //! states before it.
  virtual bool writing_back(FamilyId f) const = 0;
  //! Family f has a trainable tensor with a gradient to apply: its next update changes it.
  virtual bool updates_pending(FamilyId f) const = 0;
  //! Where chunk (f, k) holds its value now.
  virtual ChunkPlace place(FamilyId f, StateKind k) const = 0;
  //! Copies chunk (f, k)'s value (chunk_bytes) into `dst` without moving the chunk:
  //! host memory copied, the device's copied down (waits), zeros for a chunk never
  //! written. Not for a chunk at kNvme.
  virtual Status copy_value(FamilyId f, StateKind k, std::byte* dst) = 0;
  //! A pinned slot is not reused until unpinned, even if its chunk moves on.
  virtual void pin_slot(std::uint32_t slot) = 0;
  virtual void unpin_slot(std::uint32_t slot) = 0;
  //! The NVMe store (null when none is open); its reads may run without the lock.
  virtual std::shared_ptr<NvmeStore> nvme_store() const = 0;
  //! Starts family f's update that the save held back (Checkpointer::allows_update).
  virtual void launch_update(FamilyId f) = 0;

  // --- Any chunk through a host copy (blocks; may unlock) ---
  //! Runs fn on a host copy of chunk (f, k) (read from NVMe when it lives there).
  virtual Status read_chunk(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k,
                            const std::function<void(const std::byte*)>& fn) = 0;
  //! Runs fn on a zeroed host buffer of chunk (f, k), then makes it the chunk's value.
  virtual Status overwrite_chunk(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k,
                                 const std::function<void(std::byte*)>& fn) = 0;

  // --- Data-parallel ranks (Note [Sharded checkpoint] in format.cpp); only with ranks() > 1 ---
  //! Every rank's `mine` reaches every rank: Ok only when all are.
  virtual Status all_ok(std::unique_lock<std::mutex>& lock, Status mine, std::string_view what) = 0;
  virtual Result<std::int64_t> max(std::unique_lock<std::mutex>& lock, std::int64_t value) = 0;
  //! Every rank's text, by rank.
  virtual Result<std::vector<std::string>> exchange_text(std::unique_lock<std::mutex>& lock,
                                                         const std::string& text) = 0;
  //! Rank 0's initial params on every rank, if no step has run yet.
  virtual Status broadcast_initial(std::unique_lock<std::mutex>& lock) = 0;
  //! Ends every param gather in flight, in the same order on every rank.
  virtual Status finish_gathers(std::unique_lock<std::mutex>& lock) = 0;
  //! All-gathers `whole` (ranks() x shard_bytes, this rank's part at rank() x shard_bytes, fp32 words).
  virtual Status all_gather(std::unique_lock<std::mutex>& lock, std::byte* whole,
                            std::uint64_t shard_bytes) = 0;
  //! Fails every rank's collectives now, with `why` (no lock).
  virtual void abort_ranks(const std::string& why) = 0;

  // --- A load's NVMe shadows (Note [Load in one read] in load.cpp) ---
  //! Opens the NVMe store if the plan put states there and it is not open yet.
  virtual Status open_nvme_store() = 0;
  //! The host store a load's shadow buffers come from (thread-safe).
  virtual HostStore& host_store() = 0;
  //! Chunk (f, k) lives in `slots` (written by the load) from now on; its old slots are freed.
  virtual void replace_slots(FamilyId f, StateKind k, std::vector<std::uint32_t> slots) = 0;
  //! A loaded tensor's step counter and group.
  virtual void set_counters(TensorId t, std::int64_t steps, std::uint32_t group) = 0;
  //! A loaded group's overrides.
  virtual void set_group(const GroupEntry& g) = 0;
};

}  // namespace strata::checkpoint
