#include "strata/offload/swap_store.hpp"

#include <array>
#include <atomic>
#include <mutex>
#include <random>
#include <set>
#include <string>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
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

struct SwapStore::Impl {
  std::vector<detail::SwapFile> files;
  std::vector<FileId> file_ids;
  mutable std::mutex mutex;  // guards everything below
  std::vector<SlotMeta> slots;
  std::vector<std::uint32_t> crcs;  // slots x files, of the stripes as written
  std::vector<SlotId> free_slots;
  std::uint32_t ops_in_flight = 0;
};

namespace {

// One slot read or write in flight: the stripes' outcomes meet here.
struct SlotOp {
  SwapStore::Impl* impl = nullptr;
  SlotId slot = 0;
  ChunkId chunk = 0;
  IoOp op = IoOp::kRead;
  std::uint64_t length_bytes = 0;
  std::array<std::uint32_t, kSwapDirsMax> crcs{};
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

void record_failure(SlotOp& op, Status status) {
  std::lock_guard lock(op.mutex);
  if (op.failure.ok()) op.failure = std::move(status);
}

void finish(const std::shared_ptr<SlotOp>& op) {
  Status status;
  {
    std::lock_guard lock(op->mutex);
    status = op->failure;
  }
  {
    std::lock_guard lock(op->impl->mutex);
    SlotMeta& meta = op->impl->slots[op->slot];
    std::size_t n = op->impl->files.size();
    if (op->op == IoOp::kWrite) {
      STRATA_ASSERT(meta.state == SlotState::kWriting);
      if (status.ok()) {
        meta.state = SlotState::kWritten;
        meta.chunk = op->chunk;
        meta.length_bytes = op->length_bytes;
        std::copy_n(op->crcs.begin(), n, op->impl->crcs.begin() + op->slot * n);
      } else {
        meta.state = SlotState::kEmpty;
        meta.last_failure = status.to_string();
      }
    } else {
      STRATA_ASSERT(meta.readers > 0);
      --meta.readers;
    }
    --op->impl->ops_in_flight;
  }
  if (op->done) op->done(std::move(status));
}

}  // namespace

SwapStore::SwapStore(IoEngine& engine, std::uint64_t slot_bytes, std::uint64_t stripe_bytes,
                     std::uint32_t slots)
    : engine_(engine),
      slot_bytes_(slot_bytes),
      stripe_bytes_(stripe_bytes),
      slots_(slots),
      impl_(std::make_unique<Impl>()) {}

Result<std::unique_ptr<SwapStore>> SwapStore::create(IoEngine& engine, SwapStoreOptions options) {
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
  for (std::size_t i = 0; i < n; ++i) {
    STRATA_RETURN_IF_ERROR(detail::reclaim_stale_swap_files(
        options.dirs[i], detail::swap_file_name(static_cast<std::uint32_t>(i))));
  }
  const std::uint64_t stripe_bytes = align_up(div_ceil(options.slot_bytes, n), kSwapAlignmentBytes);
  const std::uint64_t file_bytes = detail::kSwapHeaderBytes + stripe_bytes * options.slots;
  STRATA_RETURN_IF_ERROR(detail::check_free_space(options.dirs, file_bytes));

  std::unique_ptr<SwapStore> store(new SwapStore(engine, options.slot_bytes, stripe_bytes, options.slots));
  store->run_id_ = (std::uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  Impl& impl = *store->impl_;
  for (std::size_t i = 0; i < n; ++i) {
    detail::SwapHeaderInfo info{store->run_id_,
                                options.slot_bytes,
                                stripe_bytes,
                                options.slots,
                                static_cast<std::uint32_t>(i),
                                static_cast<std::uint32_t>(n)};
    STRATA_ASSIGN_OR_RETURN(detail::SwapFile file,
                            detail::create_swap_file(options.dirs[i], info, file_bytes, options.direct_io,
                                                     options.simulate_direct_io_refused));
    impl.files.push_back(file);
    auto id = engine.register_file(file.fd, file.path.string());
    if (!id.ok()) return id.status();  // the destructor removes the files made so far
    impl.file_ids.push_back(*id);
  }
  impl.slots.resize(options.slots);
  impl.crcs.resize(std::size_t{options.slots} * n);
  impl.free_slots.reserve(options.slots);
  for (SlotId s = options.slots; s-- > 0;) impl.free_slots.push_back(s);
  STRATA_LOG_INFO("swap: {} slots of {} striped over {} file(s) ({} each, {}), run {:016x}", options.slots,
                  format_bytes(options.slot_bytes), n, format_bytes(file_bytes),
                  store->direct_io() ? "O_DIRECT" : "buffered", store->run_id_);
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

Result<SlotId> SwapStore::allocate() {
  std::lock_guard lock(impl_->mutex);
  if (impl_->free_slots.empty()) {
    return out_of_budget("swap store full: all {} slots of {} are in use; raise the swap size", slots_,
                         format_bytes(slot_bytes_));
  }
  SlotId slot = impl_->free_slots.back();
  impl_->free_slots.pop_back();
  impl_->slots[slot] = SlotMeta{.state = SlotState::kEmpty};
  return slot;
}

void SwapStore::release(SlotId slot) {
  std::lock_guard lock(impl_->mutex);
  STRATA_CHECK(slot < slots_);
  SlotMeta& meta = impl_->slots[slot];
  STRATA_CHECK(meta.state == SlotState::kEmpty || meta.state == SlotState::kWritten);
  STRATA_CHECK(meta.readers == 0);
  meta = SlotMeta{};
  impl_->free_slots.push_back(slot);
}

std::uint32_t SwapStore::slots_free() const {
  std::lock_guard lock(impl_->mutex);
  return static_cast<std::uint32_t>(impl_->free_slots.size());
}

std::vector<std::filesystem::path> SwapStore::files() const {
  std::vector<std::filesystem::path> paths;
  for (const auto& file : impl_->files) paths.push_back(file.path);
  return paths;
}

bool SwapStore::direct_io() const {
  for (const auto& file : impl_->files) {
    if (!file.direct) return false;
  }
  return true;
}

std::vector<SlotStripe> SwapStore::locate(SlotId slot, std::uint64_t length_bytes) const {
  std::vector<SlotStripe> stripes;
  for (std::size_t i = 0; i < impl_->files.size() && i * stripe_bytes_ < length_bytes; ++i) {
    stripes.push_back({impl_->files[i].path, detail::kSwapHeaderBytes + std::uint64_t{slot} * stripe_bytes_,
                       std::min(stripe_bytes_, length_bytes - i * stripe_bytes_)});
  }
  return stripes;
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
    if (slot >= slots_) return invalid_argument("slot {} does not exist (the store has {})", slot, slots_);
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
  auto op = std::make_shared<SlotOp>();
  op->start(impl_.get(), slot, chunk, IoOp::kWrite, data.size(), std::move(done));
  std::vector<IoRequest> batch;
  for (const SlotStripe& stripe : locate(slot, data.size())) {
    std::size_t i = batch.size();
    // The engine only reads a write's buffer; IoRequest is not const-typed for both directions' sake.
    std::span<std::byte> bytes(const_cast<std::byte*>(data.data()) + i * stripe_bytes_, stripe.length_bytes);
    op->crcs[i] = crc32c(bytes);
    batch.push_back({IoOp::kWrite, impl_->file_ids[i], stripe.offset_bytes, bytes, [op](Status status) {
                       if (!status.ok()) record_failure(*op, std::move(status));
                       if (op->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(op);
                     }});
  }
  STRATA_ASSERT(batch.size() <= n);
  op->remaining.store(static_cast<std::uint32_t>(batch.size()), std::memory_order_relaxed);
  Status submitted = engine_.submit(batch);
  if (!submitted.ok()) {
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
  auto op = std::make_shared<SlotOp>();
  {
    std::lock_guard lock(impl_->mutex);
    if (slot >= slots_) return invalid_argument("slot {} does not exist (the store has {})", slot, slots_);
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
    std::copy_n(impl_->crcs.begin() + slot * n, n, op->crcs.begin());
    ++meta.readers;
    ++impl_->ops_in_flight;
  }
  op->start(impl_.get(), slot, chunk, IoOp::kRead, out.size(), std::move(done));
  std::vector<IoRequest> batch;
  for (const SlotStripe& stripe : locate(slot, out.size())) {
    std::size_t i = batch.size();
    std::span<std::byte> bytes = out.subspan(i * stripe_bytes_, stripe.length_bytes);
    batch.push_back(
        {IoOp::kRead, impl_->file_ids[i], stripe.offset_bytes, bytes, [op, i, bytes, stripe](Status s) {
           if (s.ok()) {
             std::uint32_t actual = crc32c(bytes);
             if (actual != op->crcs[i]) {
               s = corrupt(
                   "chunk {} slot {}: CRC32C mismatch in {} at offsets [{}, {}) (written {:08x}, "
                   "read {:08x}): the swap file was changed behind strata's back or the device "
                   "returned wrong data",
                   op->chunk, op->slot, stripe.file.string(), stripe.offset_bytes,
                   stripe.offset_bytes + stripe.length_bytes, op->crcs[i], actual);
             }
           }
           if (!s.ok()) record_failure(*op, std::move(s));
           if (op->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) finish(op);
         }});
  }
  op->remaining.store(static_cast<std::uint32_t>(batch.size()), std::memory_order_relaxed);
  Status submitted = engine_.submit(batch);
  if (!submitted.ok()) {
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
  return detail::reclaim_stale_swap_files(dir, /*wanted=*/"");
}

}  // namespace strata::offload
