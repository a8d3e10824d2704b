#include "strata/offload/swap_store.hpp"

#include <array>
#include <atomic>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <string>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/common/record_pool.hpp"
#include "strata/offload/crc32c.hpp"
#include "swap_file.hpp"

namespace strata::offload {

// Note [Slot striping]
// Every slot is split into one stripe per directory: stripe_bytes =
// align_up(ceil(slot_bytes / n), 4096), stripe i of slot k at offset
// header + k * stripe_bytes of directory i's file. One chunk's read or write
// thus uses every device at once, so a single chunk moves at the sum of the
// devices' bandwidth (the alternative, slot k wholly on device k % n, needs n
// chunks in flight to do that, and the runtime's pipeline often has fewer).
// Each stripe is one engine request (split further into request_bytes pieces)
// and carries its own CRC32C, so a mismatch names the exact file and range.

// Note [Growing swap files]
// The NVMe budget is a cap, not a size: a user may give "1TiB" on a disk with
// far less free, and the run must work as long as what the plan puts there
// fits. So the files are preallocated for `initial_slots` (the plan's NVMe
// bytes; only those are checked against free space at creation) and grow by
// fallocate when allocate() hands out a slot past their end: by at least
// kGrowBytes per file (a few calls over a run, not one per slot), at most to
// `slots`. allocate() always returns the lowest free slot (freed slots in a
// min-heap, then the next never used one), so the files grow only when every
// slot below is in use, and never past the most slots in use at once (rounded
// up to the step). The slot tables grow with them: a cap of a petabyte costs
// no memory until it is used. Growth runs under the store's
// lock, on the thread that allocates; it never touches written slots, so a
// full disk fails that one allocation with NoSpace (file, bytes, free space)
// and loses nothing. The files do not shrink while the store lives.

namespace {

enum class SlotState : std::uint8_t { kFree, kEmpty, kWriting, kWritten };

struct SlotMeta {
  SlotState state = SlotState::kFree;
  std::uint32_t readers = 0;
  ChunkId chunk = 0;
  std::uint64_t length_bytes = 0;
  std::string last_failure;  // why the slot is kEmpty after a failed write
};

}  // namespace

// One slot read or write in flight: the stripes' outcomes meet here. Taken from
// Impl::ops when the I/O starts and given back when its last stripe completes,
// before the caller's callback runs (Note [Completion records] in
// strata/common/record_pool.hpp): a stripe's callback captures the record and
// the stripe's index, two words that std::function keeps in place, so a steady
// stream of slot I/O allocates nothing once the records in flight reach their
// high water (SwapStore::counters().slot_op_records).
namespace {
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
}  // namespace

struct SwapStore::Impl {
  std::vector<detail::SwapFile> files;
  std::vector<FileId> file_ids;
  std::uint64_t stripe_bytes = 0;
  RecordPool<SlotOp> ops;    // slot operations in flight (own lock)
  mutable std::mutex mutex;  // guards everything below
  // Slot tables cover the slots handed out so far, not the cap (which may be
  // far more than this machine's memory could describe): they grow with `high`.
  std::vector<SlotMeta> slots;
  std::vector<std::uint32_t> crcs;  // slots x files, of the stripes as written
  std::vector<SlotId> free_slots;   // freed slots below `high`, a min-heap (Note [Growing swap files])
  std::uint32_t high = 0;           // slots [0, high) were handed out at least once
  std::uint32_t slots_on_disk = 0;  // slots the files hold bytes for
  std::uint32_t ops_in_flight = 0;
};

namespace {

//! Stripe `i` of the first `length_bytes` of `slot` (Note [Slot striping]): its
//! file offset and length (0: the slot's data ends before this stripe).
struct StripeSpan {
  std::uint64_t offset_bytes = 0;
  std::uint64_t length_bytes = 0;
};
StripeSpan stripe_span(std::uint64_t stripe_bytes, std::size_t i, SlotId slot, std::uint64_t length_bytes) {
  const std::uint64_t begin = i * stripe_bytes;
  if (begin >= length_bytes) return {};
  return {detail::kSwapHeaderBytes + std::uint64_t{slot} * stripe_bytes,
          std::min(stripe_bytes, length_bytes - begin)};
}

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

}  // namespace

SwapStore::SwapStore(IoEngine& engine, std::uint64_t slot_bytes, std::uint64_t stripe_bytes,
                     std::uint32_t slots)
    : engine_(engine),
      slot_bytes_(slot_bytes),
      stripe_bytes_(stripe_bytes),
      slots_(slots),
      impl_(std::make_unique<Impl>()) {}

namespace {

Status check_store_options(IoEngine& engine, const SwapStoreOptions& options) {
  const std::size_t n = options.dirs.size();
  if (n == 0 || n > kSwapDirsMax) {
    return invalid_argument("swap dirs: {} directories given; give between 1 and {}", n, kSwapDirsMax);
  }
  if (options.slot_bytes == 0 || options.slot_bytes % kSwapAlignmentBytes != 0) {
    return invalid_argument("swap slot_bytes={}: must be a positive multiple of {}", options.slot_bytes,
                            kSwapAlignmentBytes);
  }
  if (options.slots == 0) return invalid_argument("swap slots=0: need at least one slot");
  if (kSwapAlignmentBytes % engine.options().alignment_bytes != 0) {
    return invalid_argument("swap needs an io engine with alignment_bytes dividing {}, got {}",
                            kSwapAlignmentBytes, engine.options().alignment_bytes);
  }
  std::set<std::filesystem::path> seen;
  for (const auto& dir : options.dirs) {
    STRATA_RETURN_IF_ERROR(detail::check_swap_dir(dir));
    if (!seen.insert(std::filesystem::weakly_canonical(dir)).second) {
      return invalid_argument("swap dirs: {} is listed twice; list each directory once", dir.string());
    }
  }
  return Status::Ok();
}

//! Growth step in slots (Note [Growing swap files]).
constexpr std::uint64_t kGrowBytes = 64 * kMiB;

std::uint64_t file_bytes_for(std::uint64_t stripe_bytes, std::uint64_t slots) {
  return detail::kSwapHeaderBytes + stripe_bytes * slots;
}

}  // namespace

Result<std::unique_ptr<SwapStore>> SwapStore::create(IoEngine& engine, SwapStoreOptions options) {
  STRATA_RETURN_IF_ERROR(check_store_options(engine, options));
  const std::size_t n = options.dirs.size();
  for (const auto& dir : options.dirs) STRATA_RETURN_IF_ERROR(detail::reclaim_stale_swap_files(dir));
  const std::uint64_t stripe_bytes = align_up(div_ceil(options.slot_bytes, n), kSwapAlignmentBytes);
  const std::uint32_t initial = std::min(options.initial_slots.value_or(options.slots), options.slots);
  const std::uint64_t file_bytes = file_bytes_for(stripe_bytes, initial);
  STRATA_RETURN_IF_ERROR(detail::check_free_space(options.dirs, file_bytes));

  std::unique_ptr<SwapStore> store(new SwapStore(engine, options.slot_bytes, stripe_bytes, options.slots));
  store->run_id_ = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  Impl& impl = *store->impl_;
  impl.stripe_bytes = stripe_bytes;
  impl.slots_on_disk = initial;
  const detail::SwapOpenMode mode{.direct = options.direct_io,
                                  .simulate_refused = options.simulate_direct_io_refused,
                                  .keep_name = options.keep_file_names};
  for (std::size_t i = 0; i < n; ++i) {
    detail::SwapHeaderInfo info{store->run_id_,
                                options.slot_bytes,
                                stripe_bytes,
                                options.slots,
                                static_cast<std::uint32_t>(i),
                                static_cast<std::uint32_t>(n)};
    STRATA_ASSIGN_OR_RETURN(detail::SwapFile file,
                            detail::create_swap_file(options.dirs[i], info, file_bytes, mode));
    impl.files.push_back(file);
    auto id = engine.register_file(file.fd, file.path.string());
    if (!id.ok()) return id.status();  // the destructor closes the files made so far
    impl.file_ids.push_back(*id);
  }
  impl.slots.resize(initial);
  impl.crcs.resize(std::size_t{initial} * n);
  STRATA_LOG_INFO(
      "swap: {} slots of {} striped over {} file(s) ({} each now, growing to at most {}; {}, unlinked), run "
      "{:016x}",
      options.slots, format_bytes(options.slot_bytes), n, format_bytes(file_bytes),
      format_bytes(file_bytes_for(stripe_bytes, options.slots)), store->direct_io() ? "O_DIRECT" : "buffered",
      store->run_id_);
  return store;
}

SwapStore::~SwapStore() {
  std::lock_guard lock(impl_->mutex);
  STRATA_CHECK_MSG(impl_->ops_in_flight == 0, "SwapStore destroyed with slot I/O in flight");
  for (std::size_t i = 0; i < impl_->files.size(); ++i) {
    if (i < impl_->file_ids.size()) engine_.unregister_file(impl_->file_ids[i]).ignore();
    detail::close_and_remove(impl_->files[i]);
  }
}

Status SwapStore::grow_to_hold(SlotId slot) {
  Impl& impl = *impl_;
  if (slot < impl.slots_on_disk) return Status::Ok();
  // Note [Growing swap files]: a step at once, or just this slot when the step does not fit.
  const std::uint64_t step = std::max<std::uint64_t>(1, kGrowBytes / stripe_bytes_);
  const auto wanted = static_cast<std::uint32_t>(std::min<std::uint64_t>(slots_, std::uint64_t{slot} + step));
  Status grown;
  for (const std::uint32_t target : {wanted, slot + 1}) {
    grown = Status::Ok();
    for (std::size_t i = 0; i < impl.files.size() && grown.ok(); ++i) {
      grown = detail::grow_swap_file(impl.files[i], file_bytes_for(stripe_bytes_, impl.slots_on_disk),
                                     file_bytes_for(stripe_bytes_, target));
    }
    if (grown.ok()) {
      impl.slots_on_disk = target;
      impl.slots.resize(target);
      impl.crcs.resize(std::size_t{target} * impl.files.size());
      return grown;
    }
  }
  return grown;
}

Result<SlotId> SwapStore::allocate() {
  std::lock_guard lock(impl_->mutex);
  auto& heap = impl_->free_slots;
  SlotId slot = 0;
  if (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    slot = heap.back();
    heap.pop_back();
  } else if (impl_->high < slots_) {
    slot = impl_->high;
    STRATA_RETURN_IF_ERROR(grow_to_hold(slot));  // on NoSpace the slot stays unused
    ++impl_->high;
  } else {
    return out_of_budget("swap store full: all {} slots of {} are in use; raise the swap size (budgets.nvme)",
                         slots_, format_bytes(slot_bytes_));
  }
  impl_->slots[slot] = SlotMeta{.state = SlotState::kEmpty};
  return slot;
}

void SwapStore::release(SlotId slot) {
  std::lock_guard lock(impl_->mutex);
  STRATA_CHECK(slot < impl_->high);
  SlotMeta& meta = impl_->slots[slot];
  STRATA_CHECK(meta.state == SlotState::kEmpty || meta.state == SlotState::kWritten);
  STRATA_CHECK(meta.readers == 0);
  meta = SlotMeta{};
  impl_->free_slots.push_back(slot);
  std::push_heap(impl_->free_slots.begin(), impl_->free_slots.end(), std::greater<>{});
}

std::uint32_t SwapStore::slots_free() const {
  std::lock_guard lock(impl_->mutex);
  return static_cast<std::uint32_t>(impl_->free_slots.size()) + (slots_ - impl_->high);
}

std::vector<std::filesystem::path> SwapStore::files() const {
  std::vector<std::filesystem::path> paths;
  for (const auto& file : impl_->files) paths.push_back(file.path);
  return paths;
}

std::vector<std::filesystem::path> SwapStore::reopen_paths() const {
  std::vector<std::filesystem::path> paths;
  for (const auto& file : impl_->files) paths.push_back(fmt::format("/proc/self/fd/{}", file.fd));
  return paths;
}

std::uint32_t SwapStore::slots_allocated_on_disk() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->slots_on_disk;
}

bool SwapStore::direct_io() const {
  for (const auto& file : impl_->files) {
    if (!file.direct) return false;
  }
  return true;
}

std::vector<SlotStripe> SwapStore::locate(SlotId slot, std::uint64_t length_bytes) const {
  std::vector<SlotStripe> stripes;
  for (std::size_t i = 0; i < impl_->files.size(); ++i) {
    const StripeSpan at = stripe_span(stripe_bytes_, i, slot, length_bytes);
    if (at.length_bytes == 0) break;
    stripes.push_back({impl_->files[i].path, at.offset_bytes, at.length_bytes});
  }
  return stripes;
}

SwapStoreCounters SwapStore::counters() const {
  return {.slot_op_records = impl_->ops.created()};
}

namespace {

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

Status reclaim_stale_swap_files(const std::filesystem::path& dir) {
  return detail::reclaim_stale_swap_files(dir);
}

}  // namespace strata::offload
