#pragma once
// Residency: which chunk copy is where. It owns the device slots (and the device
// memory they are carved from), moves chunks between host and device (loads,
// write-backs), picks eviction victims and prefetches params along the adopted
// trace (Note [Chunk state machine] in chunk.hpp). It may call Core (stores,
// streams, timeline) and reads StepTracker's position, the optimizer pipeline's
// per-family progress through PipelineProgress (pipeline_progress.hpp: a gradient
// the pipeline has claimed is not evicted, a family being updated is not
// prefetched) and DataParallel's chunk flags (core/chunk_flags.hpp: a slot a collective holds is not reused,
// a gradient awaiting its reduction is evicted last, a param awaiting its gather is not prefetched). NVMe
// copies of optimizer states are the pipeline's and Runtime::Impl's business; this part reads NVMe-homed
// params into its staging buffers (Note [NVMe-homed params]). Every function expects Core::mu held (Note
// [Lock discipline]).
//
// Note [NVMe-homed params]
// A param whose plan puts its home on NVMe (Note [Placement policy] 4) has its
// value in NVMe slots (or is absent: zeros until init_tensor). To reach the
// device it is read into one of a bounded pool of host staging buffers
// (Plan::param_staging_buffers, counted in the host budget by the planner), which
// then serves as a clean host copy (`Chunk::host` while the value stays kNvme or
// kAbsent) for the h2d load. Following the adopted trace, prefetch() reads the
// params of the next uses ahead, in traced order, as buffers free up, and loads
// them to the device once read; a use on demand waits for its read. A buffer is
// taken back oldest first, never from a param whose use is within the window or
// whose h2d load still reads it, and never while its read is in flight. The
// optimizer pipeline reads the param into its own staging beside the family's
// states, updates it there, and writes it back copy-on-write with them (Note
// [Copy-on-write NVMe slots]); until those writes end the updated param is an
// ordinary host copy (kHost) that loads read, so the next forward does not wait
// for the disk. When the param is still staged for its backward use as the
// pipeline reads the states (the usual case: a family's states are read as its
// gradients complete), the pipeline copies the staging buffer (lend_staged)
// instead of reading the param from the disk a third time in the step: the step
// reads an NVMe-homed param twice, for forward and for backward, as the cost
// model counts (StepStats::bytes_disk_read_param_updates says when it could not).
// Keeping the forward copy for backward instead of the second read costs a buffer
// of host room per family kept, and saves that family's param bytes of reads; the
// planner gives host room to param homes first (Note [NVMe param staging] in
// planner.cpp), which save three or four times their bytes, so a forward copy
// is kept only as the staging pool happens to hold it.

#include <cstdint>
#include <mutex>
#include <vector>

#include "core/chunk_flags.hpp"
#include "core/core.hpp"
#include "residency/pipeline_progress.hpp"

namespace strata::runtime {

class StepTracker;

class Residency {
 public:
  Residency(Core& core, const StepTracker& tracker) : core_(core), tracker_(tracker) {}
  //! The optimizer pipeline's progress, which eviction and prefetch respect (set
  //! once, by Runtime::Impl's constructor, before any use).
  void read_progress(const PipelineProgress& pipeline) { pipeline_ = &pipeline; }
  //! Data parallelism's chunk flags, which eviction and prefetch respect (set once,
  //! by Runtime::Impl's constructor, before any use).
  void read_dp_flags(const DpChunkFlags& flags) { dp_flags_ = &flags; }

  //! Creates the events and settings it needs; once, at Runtime::create.
  Status init();
  //! Rebuilds the device slots for `p` (all device copies must be clean). Blocks.
  Status build_slots(const Plan& p);
  //! Drops the device slots and their memory (the runtime's destructor).
  void clear();

  //! Puts `c` in a device slot, loading its content when `load`; waits (unlocking)
  //! for a slot while all are busy with background work, and for host room before
  //! it writes a gradient back (Note [Backpressure] in residency.cpp). OutOfBudget
  //! when every slot is leased, or the gradients' host room is full, and nothing in
  //! the background will free one.
  Status ensure_on_device(std::unique_lock<std::mutex>& lock, Chunk& c, bool load);
  //! Copies a dirty chunk's device value to its host copy (blocking), which becomes the value.
  Status write_back(Chunk& c, DeviceSlot& slot);
  //! Makes the host copy of `c` valid (write-back from the device, zeros when
  //! absent). Blocks on the d2h copy. NVMe copies are not read here.
  Status ensure_on_host(Chunk& c);
  //! Enqueues the copy host -> slot on the h2d stream after the slot's previous users.
  Status load_to_slot(Chunk& c, DeviceSlot& slot);
  //! Waits until no queued copy still reads c's host copy (before it is written or freed).
  Status wait_host_reads(Chunk& c);
  //! Forgets c's device copy (it is stale or consumed): a streaming slot is freed
  //! at once (its next writer waits on its fence), a dedicated one stays c's.
  void drop_device_copy(Chunk& c);
  //! Frees the stale host copy of a gradient that landed in staging once no queued
  //! copy reads it; never blocks: one still read stays until consumed (Note [Host room]).
  void drop_stale_host_copy(Chunk& c);
  //! Frees every stale host copy of a landed gradient (value staged) that drop_stale_host_copy
  //! left because a queued load still read it, waiting for those loads; true if any was freed.
  bool drop_stale_host_copies();
  //! Loads the params of the next uses of the adopted trace into free or clean
  //! slots. Returns the first error after recording it: a failed read ahead
  //! (NVMe into staging) with ErrorState::prefetch_failed (counted, the next call's
  //! error once, the runtime goes on), a failed slot move with ErrorState::fail
  //! (sticky). Never silently dropped (Note [Prefetch errors] in eviction.cpp).
  Status prefetch();

  // --- NVMe-homed params (Note [NVMe-homed params]) ---
  //! `c` is a param whose home is NVMe and whose value is there (or absent):
  //! it reaches the device only through a staging buffer.
  bool needs_staging(const Chunk& c) const;
  //! The param's staging copy is read and may be loaded from.
  bool staged(const Chunk& c) const;
  //! Waits (unlocking) until `c` is staged, reading it first (waiting for a
  //! free buffer). Fails with the read's error (naming family, file, offset).
  Status wait_staged(std::unique_lock<std::mutex>& lock, Chunk& c);
  //! Gives up `c`'s staging copy (its NVMe value is about to change): waits
  //! (unlocking) for its read and for loads still reading it.
  Status drop_staging(std::unique_lock<std::mutex>& lock, Chunk& c);
  //! Waits (unlocking) until no staging read is in flight.
  void wait_staging_reads(std::unique_lock<std::mutex>& lock);
  //! f's staging copy of its NVMe-homed param, when it holds the NVMe value (read,
  //! not absent), lent to the caller (the optimizer pipeline, which copies it rather
  //! than read the disk again: Note [NVMe-homed params]); nullptr when it has none.
  //! The buffer is not taken back, nor dropped, until give_back_staged(f).
  const std::byte* lend_staged(FamilyId f);
  //! Ends a lend_staged(f); the caller notifies Core::cv (drop_staging may wait).
  void give_back_staged(FamilyId f);
  //! Takes the plan's staging pool size (its buffers are taken from the host
  //! store on first use and kept: no churn in the pinned arena).
  void adopt(const Plan& p);
  //! Returns the staging buffers to the host store (the runtime's destructor).
  void release_staging();

  DeviceSlot& slot_of(const Chunk& c) { return device_slots_[static_cast<std::size_t>(c.device_slot)]; }
  const std::vector<DeviceSlot>& device_slots() const { return device_slots_; }
  //! The peak of device bytes holding valid chunk copies.
  std::uint64_t gpu_high_water() const { return gpu_high_water_; }
  //! Checks the device slots against the chunks (Note [Chunk state machine]); aborts on a violation.
  void check_invariants() const;
  //! The staging pool's bounds and counts (Note [NVMe-homed params]).
  void check_staging_invariants() const;

  //! Runtime::incomplete_gradients_max(): the incomplete gradients the host room holds.
  std::size_t incomplete_gradients_max() const;

 private:
  //! Frees slot `s` (writing back a dirty occupant).
  Status evict_slot(std::size_t s);
  //! Chooses a slot for a new occupant; -1 when none can be freed now. With
  //! farther_than > 0 (prefetch), only a free slot or a clean occupant whose next
  //! use is more than that many uses ahead (Note [Idle victims first]). A dirty
  //! gradient is a victim only when its write-back fits the gradients' host room
  //! (Note [Backpressure]); *room_full (unless null) says one was passed over for that.
  std::int64_t pick_slot(FamilyId for_family, std::uint64_t farther_than = 0, bool* room_full = nullptr);
  //! The error of ensure_on_device when no slot can be had and nothing in the
  //! background frees one: names the slots leased and held, or the full host room.
  Status no_slot_error(bool room_full) const;
  //! Writing `c` back to host fits Plan::grad_host_bytes (Note [Backpressure]);
  //! *in_use gets the gradients' host bytes.
  bool write_back_fits(const Chunk& c, std::uint64_t* in_use) const;
  //! The slot is free, or its occupant may be evicted now (not leased, not a
  //! gradient claimed by the optimizer pipeline).
  bool movable(const DeviceSlot& slot) const;
  //! Puts `c` into the free or freed slot `s`.
  void occupy(Chunk& c, std::size_t s);
  void note_gpu_use();
  //! Starts reading `c` into a free staging buffer, taking back the oldest one
  //! not used within `window` uses; *started says whether it did or had (false:
  //! no buffer free now). `ahead`: a prefetch, whose failed read is not fatal
  //! (Note [Prefetch errors]). Fails when the host store refuses the buffer.
  Status start_staging(Chunk& c, std::size_t window, bool ahead, bool* started);
  //! A staging buffer whose family is not used in the next `window` uses and
  //! whose loads are done; -1 when none.
  std::int64_t staging_victim(std::size_t window) const;
  void free_staging(FamilyId f);
  //! Staging buffers lent to the pipeline now.
  int lent_buffers() const;
  void staging_read_done(FamilyId f, Status status, double enqueued_us, std::uint64_t bytes);  // takes mu
  //! NvmePieceDone trampoline to staging_read_done.
  static void nvme_staging_done(void* self, FamilyId f, Status status, double enqueued_us,
                                std::uint64_t bytes);
  //! Reads NVMe-homed params of the next traced uses into staging buffers.
  Status read_params_ahead();

  enum class Staging : std::uint8_t { kNone, kReading, kReady };
  struct ParamStaging {
    Staging state = Staging::kNone;
    int io_pending = 0;
    bool ahead = false;  //!< started by read_params_ahead (a prefetch), not by a use
    int lent = 0;        //!< lend_staged()s not yet given back: the buffer stays
    Status status;
    std::vector<NvmePiece> pieces;  //!< the NVMe reads (in flight while io_pending)

    //! Back to kNone; `pieces` keeps its capacity.
    void reset() {
      std::vector<NvmePiece> p = std::move(pieces);
      *this = ParamStaging{};
      p.clear();
      pieces = std::move(p);
    }
  };

  Core& core_;
  const StepTracker& tracker_;
  const PipelineProgress* pipeline_ = nullptr;  //!< the optimizer pipeline's progress: read only
  //! Data parallelism's chunk flags (core/chunk_flags.hpp): read, never written here.
  const DpChunkFlags* dp_flags_ = nullptr;
  std::vector<memory::DeviceAllocation> device_memory_;
  std::vector<DeviceSlot> device_slots_;
  std::size_t cache_slots_ = 0;  //!< device slots [0, cache_slots_) stream; the rest are dedicated
  memory::Event demand_;         //!< without prefetch, loads wait for the compute before them
  std::uint64_t tick_ = 0;
  std::uint64_t gpu_high_water_ = 0;
  std::vector<ParamStaging> staging_;  //!< per family (Note [NVMe-homed params])
  std::vector<FamilyId> staged_;       //!< families holding a staging buffer, oldest first
  std::uint32_t staging_max_ = 0;
  std::uint64_t staging_buffer_bytes_ = 0;   //!< the largest param chunk
  std::vector<std::byte*> staging_buffers_;  //!< every buffer taken, at most staging_max_
  std::vector<std::byte*> staging_free_;
  int staging_reads_ = 0;  //!< families with a staging read in flight
};

}  // namespace strata::runtime
