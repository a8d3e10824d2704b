// SwapStore's slot I/O: a slot's read or write as one request per stripe (Note
// [Slot striping] in swap_store.cpp), each stripe's CRC32C, and the completion that
// updates the slot and runs the caller's callback.
#include <algorithm>

#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"
#include "strata/offload/crc32c.hpp"
#include "strata/offload/swap_store.hpp"
#include "swap_store_impl.hpp"

namespace strata::offload {

using detail::SlotMeta;
using detail::SlotOp;
using detail::SlotState;
using detail::stripe_span;
using detail::StripeSpan;

namespace {

//! Submits one request per stripe of `op` (make(i, stripe) builds stripe i's),
//! built on the stack: at most kSwapDirsMax.
template <typename MakeRequest>
Status submit_stripes(IoEngine& engine, SlotOp& op, std::size_t files, std::uint64_t stripe_bytes,
                      MakeRequest make) {
  std::array<IoRequest, kSwapDirsMax> batch;
  std::size_t count = 0;
  for (; count < files; ++count) {
    const StripeSpan at = stripe_span(stripe_bytes, count, op.slot, op.length_bytes);
    if (at.length_bytes == 0) break;
    batch[count] = make(count, at);
  }
  op.remaining.store(static_cast<std::uint32_t>(count), std::memory_order_relaxed);
  return engine.submit(std::span<IoRequest>(batch.data(), count));
}

void record_failure(SlotOp& op, Status status) {
  std::lock_guard lock(op.mutex);
  if (op.failure.ok()) op.failure = std::move(status);
}

// The last stripe of `op` completed: updates the slot, gives the record back
// and runs the caller's callback.
void finish(SlotOp* op) {
  Status status;
  {
    std::lock_guard lock(op->mutex);
    status = std::move(op->failure);
  }
  SwapStore::Impl* impl = op->impl;
  IoCallback done = std::move(op->done);
  const SlotId slot = op->slot;
  const ChunkId chunk = op->chunk;
  const IoOp kind = op->op;
  const std::uint64_t length = op->length_bytes;
  const std::size_t n = impl->files.size();
  {
    std::lock_guard lock(impl->mutex);
    SlotMeta& meta = impl->slots[slot];
    if (kind == IoOp::kWrite) {
      STRATA_ASSERT(meta.state == SlotState::kWriting);
      if (status.ok()) {
        meta.state = SlotState::kWritten;
        meta.chunk = chunk;
        meta.length_bytes = length;
        std::copy_n(op->crcs.begin(), n, impl->crcs.begin() + slot * n);
      } else {
        meta.state = SlotState::kEmpty;
        meta.last_failure = status.to_string();
      }
    } else {
      STRATA_ASSERT(meta.readers > 0);
      --meta.readers;
    }
    // Back before ops_in_flight falls: the store (and its pool) may go once it is 0.
    impl->ops.give_back(op);
    --impl->ops_in_flight;
  }
  if (done) done(std::move(status));
}

// A stripe of a write completed.
void write_stripe_done(SlotOp* op, Status status) {
  if (!status.ok()) record_failure(*op, std::move(status));
  if (op->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(op);
}

// Stripe `i` of a read completed: its CRC32C is checked here, on the engine
// thread; the message (naming file and range) is formatted only on a mismatch.
void read_stripe_done(SlotOp* op, std::size_t i, Status status) {
  if (status.ok()) {
    const std::uint32_t actual = crc32c(op->stripes[i]);
    if (actual != op->crcs[i]) {
      const StripeSpan at = stripe_span(op->impl->stripe_bytes, i, op->slot, op->length_bytes);
      status = corrupt(
          "chunk {} slot {}: CRC32C mismatch in {} at offsets [{}, {}) (written {:08x}, "
          "read {:08x}): the swap file was changed behind strata's back or the device "
          "returned wrong data",
          op->chunk, op->slot, op->impl->files[i].path.string(), at.offset_bytes,
          at.offset_bytes + at.length_bytes, op->crcs[i], actual);
    }
  }
  if (!status.ok()) record_failure(*op, std::move(status));
  if (op->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(op);
}

Status check_span(SlotId slot, ChunkId chunk, const std::byte* data, std::uint64_t length,
                  std::uint64_t slot_bytes) {
  // Note [Misaligned requests] in request_tracker.cpp: assert in checked builds, Status otherwise.
  STRATA_ASSERT(reinterpret_cast<std::uintptr_t>(data) % kSwapAlignmentBytes == 0);
  STRATA_ASSERT(length % kSwapAlignmentBytes == 0);
  if (reinterpret_cast<std::uintptr_t>(data) % kSwapAlignmentBytes != 0 ||
      length % kSwapAlignmentBytes != 0 || length == 0) {
    return invalid_argument(
        "chunk {} slot {}: buffer {} of {} bytes: address and length must be positive multiples "
        "of {}",
        chunk, slot, static_cast<const void*>(data), length, kSwapAlignmentBytes);
  }
  if (length > slot_bytes) {
    return invalid_argument("chunk {} slot {}: {} bytes do not fit a slot of {} bytes", chunk, slot, length,
                            slot_bytes);
  }
  return Status::Ok();
}

}  // namespace

Status SwapStore::write_async(SlotId slot, ChunkId chunk, std::span<const std::byte> data, IoCallback done) {
  STRATA_RETURN_IF_ERROR(check_span(slot, chunk, data.data(), data.size(), slot_bytes_));
  const std::size_t n = impl_->files.size();
  {
    std::lock_guard lock(impl_->mutex);
    if (slot >= impl_->slots.size()) {
      return invalid_argument("slot {} does not exist (the store has {} of at most {})", slot,
                              impl_->slots.size(), slots_);
    }
    SlotMeta& meta = impl_->slots[slot];
    if (meta.state == SlotState::kFree)
      return failed_precondition("chunk {}: slot {} is not allocated", chunk, slot);
    if (meta.state == SlotState::kWriting || meta.readers > 0) {
      return failed_precondition("chunk {}: slot {} is being read or written; wait for that first", chunk,
                                 slot);
    }
    meta.state = SlotState::kWriting;
    ++impl_->ops_in_flight;
  }
  SlotOp* op = impl_->ops.take();
  op->start(impl_.get(), slot, chunk, IoOp::kWrite, data.size(), std::move(done));
  Status submitted = submit_stripes(engine_, *op, n, stripe_bytes_, [&](std::size_t i, const StripeSpan& at) {
    // The engine only reads a write's buffer; IoRequest is not const-typed for both directions' sake.
    std::span<std::byte> bytes(const_cast<std::byte*>(data.data()) + i * stripe_bytes_, at.length_bytes);
    op->crcs[i] = crc32c(bytes);
    return IoRequest{IoOp::kWrite, impl_->file_ids[i], at.offset_bytes, bytes,
                     [op](Status status) { write_stripe_done(op, std::move(status)); }};
  });
  if (!submitted.ok()) {
    // No callback runs (Note [Completion contract]): the record goes back here.
    impl_->ops.give_back(op);
    std::lock_guard lock(impl_->mutex);
    impl_->slots[slot].state = SlotState::kEmpty;
    impl_->slots[slot].last_failure = submitted.to_string();
    --impl_->ops_in_flight;
  }
  return submitted;
}

Status SwapStore::read_async(SlotId slot, ChunkId chunk, std::span<std::byte> out, IoCallback done) {
  STRATA_RETURN_IF_ERROR(check_span(slot, chunk, out.data(), out.size(), slot_bytes_));
  const std::size_t n = impl_->files.size();
  SlotOp* op = nullptr;
  {
    std::lock_guard lock(impl_->mutex);
    if (slot >= impl_->slots.size()) {
      return invalid_argument("slot {} does not exist (the store has {} of at most {})", slot,
                              impl_->slots.size(), slots_);
    }
    SlotMeta& meta = impl_->slots[slot];
    if (meta.state != SlotState::kWritten) {
      return failed_precondition("chunk {}: slot {} holds no data ({}); refusing to return its bytes", chunk,
                                 slot,
                                 meta.state == SlotState::kFree      ? "it is not allocated"
                                 : meta.state == SlotState::kWriting ? "a write to it is in progress"
                                 : meta.last_failure.empty()         ? "it was never written"
                                                             : "its last write failed: " + meta.last_failure);
    }
    if (meta.chunk != chunk) {
      return failed_precondition("slot {} holds chunk {}, not chunk {}", slot, meta.chunk, chunk);
    }
    if (meta.length_bytes != out.size()) {
      return invalid_argument("chunk {} slot {}: written with {} bytes, read asks for {}", chunk, slot,
                              meta.length_bytes, out.size());
    }
    op = impl_->ops.take();
    std::copy_n(impl_->crcs.begin() + slot * n, n, op->crcs.begin());
    ++meta.readers;
    ++impl_->ops_in_flight;
  }
  op->start(impl_.get(), slot, chunk, IoOp::kRead, out.size(), std::move(done));
  Status submitted = submit_stripes(engine_, *op, n, stripe_bytes_, [&](std::size_t i, const StripeSpan& at) {
    op->stripes[i] = out.subspan(i * stripe_bytes_, at.length_bytes);
    return IoRequest{IoOp::kRead, impl_->file_ids[i], at.offset_bytes, op->stripes[i],
                     [op, i](Status status) { read_stripe_done(op, i, std::move(status)); }};
  });
  if (!submitted.ok()) {
    impl_->ops.give_back(op);  // no callback runs (Note [Completion contract])
    std::lock_guard lock(impl_->mutex);
    --impl_->slots[slot].readers;
    --impl_->ops_in_flight;
  }
  return submitted;
}

Status SwapStore::write(SlotId slot, ChunkId chunk, std::span<const std::byte> data) {
  return start_and_wait([&](IoCallback done) { return write_async(slot, chunk, data, std::move(done)); });
}

Status SwapStore::read(SlotId slot, ChunkId chunk, std::span<std::byte> out) {
  return start_and_wait([&](IoCallback done) { return read_async(slot, chunk, out, std::move(done)); });
}
}  // namespace strata::offload
