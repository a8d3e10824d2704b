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
#include "swap_file.hpp"
#include "swap_store_impl.hpp"

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

using detail::SlotMeta;
using detail::SlotState;
using detail::stripe_span;
using detail::StripeSpan;

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

Status reclaim_stale_swap_files(const std::filesystem::path& dir) {
  return detail::reclaim_stale_swap_files(dir);
}

}  // namespace strata::offload
