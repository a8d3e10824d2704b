#pragma once
// SwapStore: fixed-size chunk slots on preallocated swap files, one file per
// directory (one directory per NVMe device), every slot striped across all of
// them (Note [Slot striping] in swap_store.cpp), each stripe checked by CRC32C.
//
// Guarantees: a slot that was never written, whose last write failed, or whose
// bytes changed on disk never reads back as valid data — the read fails with
// FailedPrecondition or Corrupt (naming chunk, slot, file and offset). The swap
// files are unlinked as soon as they are created, so no exit or death of the
// process leaves them behind (Note [Unlinked swap files] in swap_file.cpp);
// named swap files a run of an older strata left are reported and removed at
// start. The files start at `initial_slots` and grow (fallocate) as higher
// slots are allocated, up to `slots` (Note [Growing swap files]).

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "strata/common/status.hpp"
#include "strata/offload/io_engine.hpp"

namespace strata::offload {

//! Index of a slot in a SwapStore.
using SlotId = std::uint32_t;
//! The caller's name for the chunk a slot holds (for checks and messages).
using ChunkId = std::uint64_t;

//! Offsets, lengths and buffer addresses of swap I/O are multiples of this.
inline constexpr std::uint64_t kSwapAlignmentBytes = 4096;
//! Directories (stripes) at most.
inline constexpr std::size_t kSwapDirsMax = 16;

struct SwapStoreOptions {
  //! One or more existing, writable directories; one swap file each.
  std::vector<std::filesystem::path> dirs;
  //! Bytes per slot (a chunk); a positive multiple of 4096.
  std::uint64_t slot_bytes = 0;
  //! The most slots the store holds (the NVMe budget: a cap, not a size).
  std::uint32_t slots = 0;
  //! Slots preallocated at creation, whose bytes the up-front free-space check
  //! asks for (what a plan uses); the files grow past them on demand, up to
  //! `slots`. Unset: all `slots`.
  std::optional<std::uint32_t> initial_slots;
  //! Open the files with O_DIRECT; where the filesystem refuses it (tmpfs on
  //! older kernels) the store uses buffered I/O and logs a warning.
  bool direct_io = true;
  //! Test hook: behave as if every directory refused O_DIRECT.
  bool simulate_direct_io_refused = false;
  //! Test hook: keep the files named until destruction, as a run killed between
  //! creating and unlinking them (or an older strata) leaves them.
  bool keep_file_names = false;
};

//! Where one stripe of a slot lives (for tests and messages).
struct SlotStripe {
  std::filesystem::path file;
  std::uint64_t offset_bytes = 0;
  std::uint64_t length_bytes = 0;
};

//! Named counters of the store's hot path (for tests: they stop growing once
//! the I/O in flight reaches its high water).
struct SwapStoreCounters {
  //! Slot operation records created: the most slot reads and writes in flight
  //! at once. A slot read or write allocates nothing when it reuses one (Note
  //! [Completion records] in strata/common/record_pool.hpp).
  std::uint64_t slot_op_records = 0;
};

//! Thread-safe: slots may be allocated, written and read from any thread;
//! reads and writes of different slots proceed in parallel, and several reads
//! of one written slot may overlap. Writing a slot while it is being read or
//! written is refused (FailedPrecondition). The engine must outlive the store,
//! and no I/O of the store may be in flight at destruction (checked).
class SwapStore {
 public:
  //! Validates the directories (NotFound, PermissionDenied, InvalidArgument),
  //! reclaims stale swap files (logged), checks free space for `initial_slots`
  //! up front (NoSpace with the needed and available sizes), creates (unlinked),
  //! preallocates (fallocate) and registers one file per directory. Blocks on
  //! file system calls. Nothing is left in the directories on an error.
  static Result<std::unique_ptr<SwapStore>> create(IoEngine& engine, SwapStoreOptions options);

  //! Unregisters, closes and removes the swap files.
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  //! The lowest free slot (never written: reading it fails until it is
  //! written), or OutOfBudget when all `slots` are in use. Grows the files
  //! (fallocate, blocking) when the slot lies past their preallocated end;
  //! NoSpace naming the file, the bytes and the free space when the file
  //! system is full (the slot stays free, no data is touched).
  Result<SlotId> allocate();
  //! Returns a slot to the free list; its contents are forgotten. No I/O on it may be in flight.
  void release(SlotId slot);

  //! Writes `data` (length a multiple of 4096, at most slot_bytes; address
  //! 4096-aligned) as chunk `chunk` into `slot`. The CRC32C of each stripe is
  //! computed first, on the calling thread. Returns an error with no callback
  //! for a bad slot or misaligned data (an assertion in checked builds); else
  //! `done` runs once, on an engine thread (Note [Completion contract]).
  //! `data` must stay valid and unchanged until then. Allocates nothing when
  //! a slot operation record is free and `done` is empty or small enough for
  //! std::function to keep in place (two words; counters()).
  Status write_async(SlotId slot, ChunkId chunk, std::span<const std::byte> data, IoCallback done);

  //! Reads chunk `chunk` from `slot` into `out` (the length it was written with)
  //! and verifies each stripe's CRC32C on the engine thread that completes it.
  //! Errors as write_async; `done` gets Corrupt on a checksum mismatch.
  Status read_async(SlotId slot, ChunkId chunk, std::span<std::byte> out, IoCallback done);

  //! Blocking forms of the two above.
  Status write(SlotId slot, ChunkId chunk, std::span<const std::byte> data);
  Status read(SlotId slot, ChunkId chunk, std::span<std::byte> out);

  //! Where the first `length_bytes` of `slot` live, stripe by stripe (for
  //! tests and tools; allocates: reads and writes do not call it).
  std::vector<SlotStripe> locate(SlotId slot, std::uint64_t length_bytes) const;
  //! Thread-safe snapshot.
  SwapStoreCounters counters() const;

  std::uint64_t slot_bytes() const { return slot_bytes_; }
  std::uint64_t stripe_bytes() const { return stripe_bytes_; }
  std::uint32_t slots() const { return slots_; }
  std::uint32_t slots_free() const;
  //! The swap files' names (as messages give them; unlinked, Note [Unlinked
  //! swap files]), one per directory, in directory order.
  std::vector<std::filesystem::path> files() const;
  //! Paths that open the (unlinked) swap files again: /proc/self/fd/<fd>, in
  //! directory order (for tests that change bytes behind the store's back).
  std::vector<std::filesystem::path> reopen_paths() const;
  //! Slots whose bytes the files hold now (preallocated or grown to).
  std::uint32_t slots_allocated_on_disk() const;
  //! True when every file uses O_DIRECT.
  bool direct_io() const;
  //! Random id written in every file header of this run.
  std::uint64_t run_id() const { return run_id_; }

  //! The store's private state (files, slot table), defined in swap_store_impl.hpp.
  struct Impl;

 private:
  SwapStore(IoEngine& engine, std::uint64_t slot_bytes, std::uint64_t stripe_bytes, std::uint32_t slots);
  //! Grows the files (and slot tables) to hold `slot` (Note [Growing swap files]). Under the lock.
  Status grow_to_hold(SlotId slot);

  IoEngine& engine_;
  std::uint64_t slot_bytes_;
  std::uint64_t stripe_bytes_;
  std::uint32_t slots_;
  std::uint64_t run_id_ = 0;
  std::unique_ptr<Impl> impl_;
};

//! Reports (a warning naming the file, its run and pid) and removes the swap
//! files a run that is gone left in `dir` (their lock is free; their contents
//! are never read); a file a live store holds is kept. What SwapStore::create
//! does first, for tools that must leave `dir` clean even when they create no
//! store (Note [Swap file header]). Fails with the errno Status naming the file.
Status reclaim_stale_swap_files(const std::filesystem::path& dir);

}  // namespace strata::offload
