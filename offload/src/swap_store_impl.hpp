#pragma once
// SwapStore's private state, shared by swap_store.cpp (creation, slots, growth) and
// swap_slot_io.cpp (a slot's striped reads and writes and their completions).

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>
#include <vector>

#include "strata/common/record_pool.hpp"
#include "strata/offload/swap_store.hpp"
#include "swap_file.hpp"

namespace strata::offload {
namespace detail {

enum class SlotState : std::uint8_t { kFree, kEmpty, kWriting, kWritten };

struct SlotMeta {
  SlotState state = SlotState::kFree;
  std::uint32_t readers = 0;
  ChunkId chunk = 0;
  std::uint64_t length_bytes = 0;
  std::string last_failure;  // why the slot is kEmpty after a failed write
};

// One slot read or write in flight: the stripes' outcomes meet here. Taken from
// Impl::ops when the I/O starts and given back when its last stripe completes,
// before the caller's callback runs (Note [Completion records] in
// strata/common/record_pool.hpp): a stripe's callback captures the record and
// the stripe's index, two words that std::function keeps in place, so a steady
// stream of slot I/O allocates nothing once the records in flight reach their
// high water (SwapStore::counters().slot_op_records).
struct SlotOp {
  SwapStore::Impl* impl = nullptr;
  SlotId slot = 0;
  ChunkId chunk = 0;
  IoOp op = IoOp::kRead;
  std::uint64_t length_bytes = 0;
  std::array<std::uint32_t, kSwapDirsMax> crcs{};
  std::array<std::span<std::byte>, kSwapDirsMax> stripes{};  //!< a read's stripes (to check their CRC)
  std::atomic<std::uint32_t> remaining{0};
  std::mutex mutex;
  Status failure;
  IoCallback done;

  void start(SwapStore::Impl* impl_in, SlotId slot_in, ChunkId chunk_in, IoOp op_in, std::uint64_t length_in,
             IoCallback done_in) {
    impl = impl_in;
    slot = slot_in;
    chunk = chunk_in;
    op = op_in;
    length_bytes = length_in;
    done = std::move(done_in);
  }
};

//! Stripe `i` of the first `length_bytes` of `slot` (Note [Slot striping] in
//! swap_store.cpp): its file offset and length (0: the slot's data ends before this stripe).
struct StripeSpan {
  std::uint64_t offset_bytes = 0;
  std::uint64_t length_bytes = 0;
};
inline StripeSpan stripe_span(std::uint64_t stripe_bytes, std::size_t i, SlotId slot,
                              std::uint64_t length_bytes) {
  const std::uint64_t begin = i * stripe_bytes;
  if (begin >= length_bytes) return {};
  return {kSwapHeaderBytes + std::uint64_t{slot} * stripe_bytes,
          std::min(stripe_bytes, length_bytes - begin)};
}

}  // namespace detail

struct SwapStore::Impl {
  std::vector<detail::SwapFile> files;
  std::vector<FileId> file_ids;
  std::uint64_t stripe_bytes = 0;
  RecordPool<detail::SlotOp> ops;  // slot operations in flight (own lock)
  mutable std::mutex mutex;        // guards everything below
  // Slot tables cover the slots handed out so far, not the cap (which may be
  // far more than this machine's memory could describe): they grow with `high`.
  std::vector<detail::SlotMeta> slots;
  std::vector<std::uint32_t> crcs;  // slots x files, of the stripes as written
  std::vector<SlotId> free_slots;   // freed slots below `high`, a min-heap (Note [Growing swap files])
  std::uint32_t high = 0;           // slots [0, high) were handed out at least once
  std::uint32_t slots_on_disk = 0;  // slots the files hold bytes for
  std::uint32_t ops_in_flight = 0;
};

}  // namespace strata::offload
