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
  if (group < groups_.size() && groups_[group].set) {
    h.lr = groups_[group].lr;
    h.weight_decay = groups_[group].weight_decay;
  }
  return h;
}

std::uint64_t Core::largest_optim_chunk() const {
  std::uint64_t largest = 0;
  for (const Chunk& c : chunks_) {
    if (is_optim_kind(c.kind)) largest = std::max(largest, c.bytes);
  }
  return largest;
}

// Note [Table writes]
// Only core/ writes the tensor and chunk tables (issue 46): every other part reads
// them through const references (Core::tensors(), Core::chunks(), Core::chunk()), so
// the compiler refuses a write that does not go through Core. A tensor's writes are
// the step's facts, each named above (a lease opened, a gradient handed over, a
// micro-batch ended, an update counted); the layout of the chunks is one operation
// (lay_out_chunks). A chunk's copies change under the chunk state machine (Note
// [Chunk state machine]), driven by residency, the optimizer pipeline and data
// parallelism: they take the chunk through the escape hatch Core::chunk_mut (or
// chunks_mut), and scripts/check-owners counts every call of a mutating entry outside
// core/, failing above its limit, so a new writer is a visible choice.

void Core::lease_taken(TensorId t, std::int32_t chunk, bool write) {
  Chunk& c = chunks_.at(chunk);
  if (!write) {
    ++c.readers;
    return;
  }
  ++c.writers;
  ++tensors_[t].write_leases;
}

void Core::lease_returned(TensorId t, std::int32_t chunk, bool write) {
  Chunk& c = chunks_.at(chunk);
  if (!write) {
    STRATA_CHECK(c.readers > 0);
    --c.readers;
    return;
  }
  STRATA_CHECK(c.writers > 0);
  STRATA_CHECK(tensors_[t].write_leases > 0);
  --c.writers;
  --tensors_[t].write_leases;
}

bool Core::grad_handed_over(TensorId t) {
  TensorInfo& info = tensors_[t];
  info.grad_written = true;
  if (info.written_in_micro_batch) return false;
  info.written_in_micro_batch = true;
  return true;
}

void Core::family_grads_consumed(FamilyId f) {
  for (TensorId t : layout_.families[f].tensors) tensors_[t].grad_written = false;
}

void Core::count_updates(std::span<const TensorId> updated) {
  for (TensorId t : updated) ++tensors_[t].updates;
}

void Core::lay_out_chunks(std::span<const std::array<std::uint64_t, kStateKindCount>> bytes,
                          std::span<const std::uint64_t> numels) {
  STRATA_CHECK(bytes.size() == numels.size());
  chunks_.lay_out(bytes.size());
  for (FamilyId f = 0; f < bytes.size(); ++f) {
    for (std::size_t k = 0; k < kStateKindCount; ++k)
      chunks_.at(f, static_cast<StateKind>(k)).bytes = bytes[f][k] == 0 ? 0 : align_up(bytes[f][k], 4096);
    FamilyBytes& b = chunks_.bytes(f);
    b.numel = numels[f];
    b.param_bytes = chunks_.at(f, StateKind::kParam).bytes;
    b.grad_bytes = chunks_.at(f, StateKind::kGrad).bytes;
    for (StateKind k : {StateKind::kMaster, StateKind::kState0, StateKind::kState1})
      b.optim_bytes += chunks_.at(f, k).bytes;
  }
  // Each family's bytes as the NVMe tier will store them: in the slots of the store
  // the embedder supplied (RuntimeOptions::nvme_store), else in those
  // ensure_nvme_store picks. A supplied store's slot may be larger than a chunk; each
  // chunk then holds a whole slot, and the plan counts it so.
  const std::uint64_t nvme_slot =
      nvme.is_open() ? nvme.store().slot_bytes() : nvme_slot_bytes(largest_optim_chunk());
  for (FamilyId f = 0; f < chunks_.families(); ++f) {
    FamilyBytes& b = chunks_.bytes(f);
    for (StateKind k : {StateKind::kMaster, StateKind::kState0, StateKind::kState1})
      b.optim_nvme_bytes += nvme_chunk_bytes(chunks_.at(f, k).bytes, nvme_slot);
    b.param_nvme_bytes = nvme_chunk_bytes(chunks_.at(f, StateKind::kParam).bytes, nvme_slot);
  }
}

void ErrorState::fail(Status status) {
  if (background_.ok()) {
    STRATA_LOG_ERROR("runtime: {}", status.to_string());
    background_ = std::move(status);
  }
}

void ErrorState::prefetch_failed(Status status) {
  STRATA_LOG_WARN("runtime: {} (not fatal: the use reads it again)", status.to_string());
  if (prefetch_count_++ == 0) first_prefetch_ = status.to_string();
  if (prefetch_.ok()) prefetch_ = std::move(status);
}

Status ErrorState::take() {
  if (!background_.ok()) return background_;
  return take_prefetch();
}

// Note [Working sets]
// The planner's smallest streaming set is three chunk slots: the param in use, a
// gradient being written, and the next param. A caller that leases several tensors at
// once (strata.torch binds a module's parameters, and its ancestors' stay bound, for
// the module's forward and backward) needs a slot for each family they span, and one
// for the gradient written meanwhile: an LSTM whose four parameters span three
// families fills three slots, and its first gradient found none (OutOfBudget in the
// first backward, after the plan was accepted). Runtime::add_to_working_set declares
// such sets before the layout is fixed; each plan counts the largest set's families
// (PlanInput::working_set_families), and a budget below it is refused at plan time,
// naming the size that plans.
std::uint32_t Core::working_set_families() const {
  if (working_sets.empty() || layout_.slots.empty()) return 1;
  std::vector<std::pair<std::uint32_t, FamilyId>> pairs;
  pairs.reserve(working_sets.size());
  for (const auto& [set, t] : working_sets) {
    if (t < layout_.slots.size()) pairs.emplace_back(set, layout_.slots[t].family);
  }
  std::sort(pairs.begin(), pairs.end());
  pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
  std::uint32_t most = 1, run = 0;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    run = (i > 0 && pairs[i].first == pairs[i - 1].first) ? run + 1 : 1;
    most = std::max(most, run);
  }
  return most;
}

void Core::set_group(std::uint32_t group, GroupHyper h) {
  if (groups_.size() <= group) groups_.resize(group + 1);
  groups_[group] = h;
}

void Core::adopt_plan(Plan p, bool counts_accumulation) {
  accumulation_planned_ = counts_accumulation;
  planned_max_.host_bytes = std::max(planned_max_.host_bytes, p.host_bytes);
  planned_max_.gpu_bytes = std::max(planned_max_.gpu_bytes, p.gpu_bytes);
  planned_max_.nvme_bytes = std::max(planned_max_.nvme_bytes, p.nvme_bytes);
  plan_ = std::move(p);
}

void Core::end_step_launches() {
  if (launches_this_step_ > launches_per_step_max_) {
    launches_per_step_max_ = launches_this_step_;
    launch_records_.reserve(launches_per_step_max_);
  }
  launches_this_step_ = 0;
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
  if (nvme.is_open()) return Status::Ok();
  return nvme.open({.dirs = opt.nvme_dirs,
                    .slot_bytes = nvme_slot_bytes(largest_optim_chunk()),
                    .capacity_bytes = opt.budgets.nvme_bytes,
                    .initial_bytes = initial_bytes.value_or(plan_.nvme_bytes),
                    .engine = opt.io_engine,
                    .fixed_buffers = host->regions(),
                    .io_result_filter = io_fault_file_filter()});
}

Status Core::nvme_transfer(std::unique_lock<std::mutex>& lock, bool write, std::span<std::byte> data,
                           std::vector<std::uint32_t>& slots_io) {
  STRATA_RETURN_IF_ERROR(ensure_nvme_store());
  return nvme.transfer(lock, write, data, slots_io);
}

Status Core::timed_copy(const memory::Stream& stream, Track track, void* dst, const void* src,
                        std::uint64_t bytes, memory::CopyKind kind, SpanName name) {
  // The span starts when the stream reaches the copy (after any event waits),
  // not when it was enqueued.
  // Note [Completion records]: the host functions capture only the record.
  CopyRecord* r = copy_records_.take();
  *r = CopyRecord{.core = this, .track = track, .bytes = bytes, .name = name};
  Status st = device.launch_host(stream, [r] { r->start_us = r->core->timeline.now_us(); });
  if (!st.ok()) {  // never enqueued
    copy_records_.give_back(r);
    return st;
  }
  st = device.copy_async(stream, dst, src, bytes, kind);
  if (st.ok()) {
    st = device.launch_host(stream, [r] {
      Core& core = *r->core;
      core.timeline.add(r->track, r->name, r->start_us, core.timeline.now_us(), r->bytes);
      core.copy_records_.give_back(r);
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
  const double previous = track_end_us_[static_cast<std::size_t>(track)].exchange(end);
  timeline.add(track, name, std::max(enqueued_us, previous), end, bytes);
}

}  // namespace strata::runtime
