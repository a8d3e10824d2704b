// Core: the shared context of the runtime's parts (core.hpp).
#include "core/core.hpp"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <iterator>

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

DType Core::kind_dtype(StateKind kind) const {
  if (kind == StateKind::kParam || kind == StateKind::kGrad) return opt.compute_dtype;
  return kind == StateKind::kMaster ? DType::kF32 : opt.state_dtype;
}

kernels::Hyper Core::hyper(std::uint32_t group) const {
  kernels::Hyper h = opt.hyper;
  if (group < groups.size() && groups[group].set) {
    h.lr = groups[group].lr;
    h.weight_decay = groups[group].weight_decay;
  }
  return h;
}

std::uint64_t Core::largest_optim_chunk() const {
  std::uint64_t largest = 0;
  for (const Chunk& c : chunks) {
    if (is_optim_kind(c.kind)) largest = std::max(largest, c.bytes);
  }
  return largest;
}

void Core::fail(Status status) {
  if (background_error.ok()) {
    STRATA_LOG_ERROR("runtime: {}", status.to_string());
    background_error = std::move(status);
  }
}

void Core::prefetch_failed(Status status) {
  STRATA_LOG_WARN("runtime: {} (not fatal: the use reads it again)", status.to_string());
  if (prefetch_errors++ == 0) first_prefetch_error = status.to_string();
  if (prefetch_error.ok()) prefetch_error = std::move(status);
}

Status Core::take_error() {
  if (!background_error.ok()) return background_error;
  return take_prefetch_error();
}

Result<std::byte*> Core::host_buffer(Chunk& c) {
  if (c.host != nullptr) return c.host;
  auto buffer = host->allocate(c.bytes);
  if (!buffer.ok()) {
    Status s = buffer.status();
    s.with_context(fmt::format("host copy of family {} {} ({})", c.family, state_kind_name(c.kind),
                               format_bytes(c.bytes)));
    return s;
  }
  c.host = *buffer;
  return c.host;
}

namespace {

// Note [I/O fault file]
// Tests that reach the runtime only through a binding (strata.torch) inject NVMe
// faults through the environment: with STRATA_IO_FAULT_FILE set, every I/O
// result of the NVMe tier goes through a filter that reads that file and fails
// reads with EIO while it holds "eio-read", writes while it holds "eio-write"
// (the real engine then names the file and the offset). Unset, nothing changes.
// (C++ tests pass their own NvmeStore: RuntimeOptions::nvme_store.)
std::function<std::int64_t(bool, std::uint64_t, std::int64_t)> io_fault_file_filter() {
  const char* path = std::getenv("STRATA_IO_FAULT_FILE");
  if (path == nullptr || *path == '\0') return nullptr;
  STRATA_LOG_WARN("runtime: NVMe I/O faults are injected while {} says so (STRATA_IO_FAULT_FILE)", path);
  return [file = std::string(path)](bool write, std::uint64_t, std::int64_t result) -> std::int64_t {
    if (result <= 0) return result;
    std::ifstream in(file);
    std::string said((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return said.find(write ? "eio-write" : "eio-read") != std::string::npos ? -EIO : result;
  };
}

}  // namespace

Status Core::ensure_nvme_store(std::optional<std::uint64_t> initial_bytes) {
  if (nvme != nullptr) return Status::Ok();
  const std::uint64_t slot = nvme_slot_bytes(largest_optim_chunk());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NvmeStore> store,
                          make_nvme_store({.dirs = opt.nvme_dirs,
                                           .slot_bytes = slot,
                                           .capacity_bytes = opt.budgets.nvme_bytes,
                                           .initial_bytes = initial_bytes.value_or(plan.nvme_bytes),
                                           .engine = opt.io_engine,
                                           .fixed_buffers = host->regions(),
                                           .io_result_filter = io_fault_file_filter()}));
  nvme = std::move(store);
  STRATA_LOG_INFO("runtime: NVMe tier {}", nvme->describe());
  return Status::Ok();
}

void Core::free_nvme_slot(std::uint32_t slot) {
  auto it = nvme_pins.find(slot);
  if (it != nvme_pins.end()) {
    it->second = true;
    return;
  }
  nvme->free_slot(slot);
}

void Core::unpin_nvme_slot(std::uint32_t slot) {
  auto it = nvme_pins.find(slot);
  if (it == nvme_pins.end()) return;
  const bool freed = it->second;
  nvme_pins.erase(it);
  if (freed) nvme->free_slot(slot);
}

Status Core::nvme_transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                           std::vector<std::uint32_t>& slots_io) {
  STRATA_RETURN_IF_ERROR(ensure_nvme_store());
  const std::uint64_t piece = nvme->slot_bytes();
  std::vector<std::uint32_t> fresh;
  if (write) {
    for (std::uint64_t begin = 0; begin < data.size(); begin += piece) {
      auto s = nvme->allocate_slot();
      if (!s.ok()) {
        for (std::uint32_t f : fresh) nvme->free_slot(f);
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
    Status st = write ? nvme->write(targets[i], part, done) : nvme->read(targets[i], part, done);
    if (!st.ok()) done(st);
  }
  {
    std::unique_lock g(latch.mu);
    latch.cv.wait(g, [&] { return latch.pending == 0; });
  }
  lock.lock();
  if (!latch.status.ok()) {
    for (std::uint32_t f : fresh) nvme->free_slot(f);
    return latch.status;
  }
  if (write) {
    for (std::uint32_t old : slots_io) free_nvme_slot(old);
    slots_io = std::move(fresh);
  }
  return Status::Ok();
}

namespace {
void nvme_piece_done(NvmeIoRecord* r, Status status) {
  const NvmeIoRecord rec = *r;
  rec.core->nvme_io_records.give_back(r);
  rec.done(rec.owner, rec.family, std::move(status), rec.enqueued_us, rec.bytes);
}
}  // namespace

void Core::submit_nvme_pieces(NvmeIo io, std::span<const NvmePiece> pieces, NvmePieceDone done, void* owner,
                              FamilyId f, double enqueued_us) {
  const std::size_t n = pieces.size();
  for (std::size_t i = 0; i < n; ++i) {
    const NvmePiece piece = pieces[i];
    NvmeIoRecord* r = nvme_io_records.take();
    *r = {.core = this,
          .done = done,
          .owner = owner,
          .family = f,
          .enqueued_us = enqueued_us,
          .bytes = piece.data.size()};
    // Note [Completion records]: the callback captures only the record.
    auto on_done = [r](Status s) { nvme_piece_done(r, std::move(s)); };
    Status st = io == NvmeIo::kWrite       ? nvme->write(piece.slot, piece.data, on_done)
                : io == NvmeIo::kReadAhead ? nvme->read_ahead(piece.slot, piece.data, on_done)
                                           : nvme->read(piece.slot, piece.data, on_done);
    if (!st.ok()) on_done(std::move(st));  // no callback will come for this piece
  }
}

Status Core::timed_copy(const memory::Stream& stream, Track track, void* dst, const void* src,
                        std::uint64_t bytes, memory::CopyKind kind, SpanName name) {
  // The span starts when the stream reaches the copy (after any event waits),
  // not when it was enqueued.
  // Note [Completion records]: the host functions capture only the record.
  CopyRecord* r = copy_records.take();
  *r = CopyRecord{.core = this, .track = track, .bytes = bytes, .name = name};
  Status st = device.launch_host(stream, [r] { r->start_us = r->core->timeline.now_us(); });
  if (!st.ok()) {  // never enqueued
    copy_records.give_back(r);
    return st;
  }
  st = device.copy_async(stream, dst, src, bytes, kind);
  if (st.ok()) {
    st = device.launch_host(stream, [r] {
      Core& core = *r->core;
      core.timeline.add(r->track, r->name, r->start_us, core.timeline.now_us(), r->bytes);
      core.copy_records.give_back(r);
    });
  }
  // A later failure keeps the record out of the pool: the start function
  // enqueued may still write it.
  return st;
}

void Core::record_span(Track track, SpanName name, double enqueued_us, std::uint64_t bytes) {
  // Called in stream order on the track's own stream: the span began when both
  // it was enqueued and the previous span on the track had ended.
  const double end = timeline.now_us();
  const double previous = track_end_us[static_cast<std::size_t>(track)].exchange(end);
  timeline.add(track, name, std::max(enqueued_us, previous), end, bytes);
}

}  // namespace strata::runtime
