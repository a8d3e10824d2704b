// NvmeTier: the runtime's side of the NVMe store (nvme_tier.hpp).
#include "core/nvme_tier.hpp"

#include <algorithm>
#include <condition_variable>

#include "strata/common/log.hpp"

namespace strata::runtime {

Status NvmeTier::open(const NvmeStoreOptions& options) {
  if (store_ != nullptr) return Status::Ok();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NvmeStore> store, make_nvme_store(options));
  store_ = std::move(store);
  STRATA_LOG_INFO("runtime: NVMe tier {}", store_->describe());
  return Status::Ok();
}

void NvmeTier::free_slot(std::uint32_t slot) {
  auto it = pins_.find(slot);
  if (it != pins_.end()) {
    it->second = true;
    return;
  }
  store_->free_slot(slot);
}

void NvmeTier::unpin_slot(std::uint32_t slot) {
  auto it = pins_.find(slot);
  if (it == pins_.end()) return;
  const bool freed = it->second;
  pins_.erase(it);
  if (freed) store_->free_slot(slot);
}

Status NvmeTier::transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                          std::vector<std::uint32_t>& slots_io) {
  const std::uint64_t piece = store_->slot_bytes();
  std::vector<std::uint32_t> fresh;
  if (write) {
    for (std::uint64_t begin = 0; begin < data.size(); begin += piece) {
      auto s = store_->allocate_slot();
      if (!s.ok()) {
        for (std::uint32_t f : fresh) store_->free_slot(f);
        return s.status();
      }
      fresh.push_back(*s);
    }
  }
  const std::vector<std::uint32_t>& targets = write ? fresh : slots_io;
  struct Latch {
    std::mutex mu;
    std::condition_variable cv;
    std::size_t pending;
    Status status;
  } latch{.pending = targets.size()};
  lock.unlock();
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const std::uint64_t begin = i * piece;
    auto part = data.subspan(begin, std::min<std::uint64_t>(piece, data.size() - begin));
    auto done = [&latch](Status s) {
      std::lock_guard g(latch.mu);
      if (!s.ok() && latch.status.ok()) latch.status = std::move(s);
      if (--latch.pending == 0) latch.cv.notify_all();
    };
    Status st = write ? store_->write(targets[i], part, done) : store_->read(targets[i], part, done);
    if (!st.ok()) done(st);
  }
  {
    std::unique_lock g(latch.mu);
    latch.cv.wait(g, [&] { return latch.pending == 0; });
  }
  lock.lock();
  if (!latch.status.ok()) {
    for (std::uint32_t f : fresh) store_->free_slot(f);
    return latch.status;
  }
  if (write) {
    for (std::uint32_t old : slots_io) free_slot(old);
    slots_io = std::move(fresh);
  }
  return Status::Ok();
}

void NvmeTier::piece_done(NvmeIoRecord* r, Status status) {
  const NvmeIoRecord rec = *r;
  rec.tier->io_records_.give_back(r);
  rec.done(rec.owner, rec.family, std::move(status), rec.enqueued_us, rec.bytes);
}

void NvmeTier::submit_pieces(NvmeIo io, std::span<const NvmePiece> pieces, NvmePieceDone done, void* owner,
                             FamilyId f, double enqueued_us) {
  const std::size_t n = pieces.size();
  for (std::size_t i = 0; i < n; ++i) {
    const NvmePiece piece = pieces[i];
    NvmeIoRecord* r = io_records_.take();
    *r = {.tier = this,
          .done = done,
          .owner = owner,
          .family = f,
          .enqueued_us = enqueued_us,
          .bytes = piece.data.size()};
    // Note [Completion records]: the callback captures only the record.
    auto on_done = [r](Status s) { piece_done(r, std::move(s)); };
    Status st = io == NvmeIo::kWrite       ? store_->write(piece.slot, piece.data, on_done)
                : io == NvmeIo::kReadAhead ? store_->read_ahead(piece.slot, piece.data, on_done)
                                           : store_->read(piece.slot, piece.data, on_done);
    if (!st.ok()) on_done(std::move(st));  // no callback will come for this piece
  }
}

}  // namespace strata::runtime
