#pragma once
// NvmeTier: the runtime's side of the NVMe store. It owns the store (created on
// first use, or the embedder's: RuntimeOptions::nvme_store), the slots an
// asynchronous checkpoint still reads (Note [Pinned NVMe slots]) and the records
// of NVMe pieces in flight (Note [Completion records]). Under Core::mu (Note [Lock
// discipline]) except where a comment says otherwise.

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "core/record_pool.hpp"
#include "strata/common/status.hpp"
#include "strata/runtime/stores.hpp"
#include "strata/runtime/tensor.hpp"

namespace strata::runtime {

class NvmeTier;

//! One slot's worth of a chunk's NVMe transfer: the slot and the host bytes.
struct NvmePiece {
  std::uint32_t slot = 0;
  std::span<std::byte> data;
};

//! Which NvmeStore call an NVMe piece goes through.
enum class NvmeIo : std::uint8_t { kRead, kReadAhead, kWrite };

//! Called once per NVMe piece with its outcome, on an I/O thread (or the
//! submitting one when the store refused the piece); `owner` as given to
//! NvmeTier::submit_pieces.
using NvmePieceDone = void (*)(void* owner, FamilyId f, Status status, double enqueued_us,
                               std::uint64_t bytes);

//! One NVMe piece in flight (Note [Completion records]): what its completion
//! needs, so the store's callback captures one pointer.
struct NvmeIoRecord {
  NvmeTier* tier = nullptr;
  NvmePieceDone done = nullptr;
  void* owner = nullptr;
  FamilyId family = 0;
  double enqueued_us = 0.0;
  std::uint64_t bytes = 0;
};

class NvmeTier {
 public:
  //! `supplied`: the embedder's store, or null (the store is made by open()).
  explicit NvmeTier(std::shared_ptr<NvmeStore> supplied) : store_(std::move(supplied)) {}

  //! The store exists (supplied, or a plan put states on NVMe).
  bool is_open() const { return store_ != nullptr; }
  //! Makes the store with `options` unless it exists (Note [Growing swap files]).
  Status open(const NvmeStoreOptions& options);
  //! The store; only once is_open().
  NvmeStore& store() const { return *store_; }
  //! The store shared (null before it exists): for readers outside the lock.
  std::shared_ptr<NvmeStore> shared() const { return store_; }
  //! Bytes the store's slots in use hold (0 before it exists).
  std::uint64_t used_bytes() const { return store_ != nullptr ? store_->used_bytes() : 0; }

  // Note [Pinned NVMe slots]: a slot an asynchronous checkpoint (checkpoint/capture.cpp)
  // still has to read. free_slot of a pinned slot defers the release to unpin_slot,
  // so the copy-on-write write-back never hands it out while the save reads it. Every
  // release of a chunk's slots goes through free_slot.
  void pin_slot(std::uint32_t slot) { pins_.emplace(slot, false); }
  void unpin_slot(std::uint32_t slot);
  void free_slot(std::uint32_t slot);
  bool any_pinned() const { return !pins_.empty(); }

  //! Synchronous transfer of a whole chunk (unlocks `lock` while waiting); the
  //! store must be open. A write goes to fresh slots that replace `slots_io` only
  //! when every piece succeeded.
  Status transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                  std::vector<std::uint32_t>& slots_io);
  //! Hands `pieces` of family `f` to the store one by one (reads, reads ahead or
  //! writes); each piece's outcome reaches done(owner, f, ...) exactly once. Call
  //! without Core::mu (a store may call back on this thread). Reads each piece
  //! before submitting it and none after the last: the caller's piece list may be
  //! reused as soon as the last completion ran. Allocates nothing once the pieces
  //! in flight stay below their high water.
  void submit_pieces(NvmeIo io, std::span<const NvmePiece> pieces, NvmePieceDone done, void* owner,
                     FamilyId f, double enqueued_us);
  //! Records the piece pool has made (HotPathCounters).
  std::size_t records_created() const { return io_records_.created(); }

 private:
  static void piece_done(NvmeIoRecord* r, Status status);

  std::shared_ptr<NvmeStore> store_;
  std::unordered_map<std::uint32_t, bool> pins_;  //!< pinned slot -> freed while pinned
  RecordPool<NvmeIoRecord> io_records_;
};

}  // namespace strata::runtime
