// The runtime's invariants (Note [Chunk state machine], Note [Family run
// states], Note [Pipeline places]), checked after every public call in checked
// builds (STRATA_CHECKED) and by the model-based test. One condition per check,
// so a failure names the broken one.
#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"

namespace strata::runtime {

void Residency::check_invariants() const {
  STRATA_CHECK(cache_slots_ <= device_slots_.size());
  for (std::size_t s = 0; s < device_slots_.size(); ++s) {
    const DeviceSlot& slot = device_slots_[s];
    STRATA_CHECK(slot.dedicated == (s >= cache_slots_));
    if (slot.chunk < 0) continue;
    const Chunk& c = core_.chunks().at(slot.chunk);
    STRATA_CHECK(c.device_slot == static_cast<std::int32_t>(s));
  }
  for (std::size_t i = 0; i < core_.chunks().size(); ++i) {
    const Chunk& c = core_.chunks().at(static_cast<std::int32_t>(i));
    if (c.device_slot >= 0) {
      STRATA_CHECK(static_cast<std::size_t>(c.device_slot) < device_slots_.size());
      STRATA_CHECK(device_slots_[static_cast<std::size_t>(c.device_slot)].chunk ==
                   static_cast<std::int32_t>(i));
    }
    if (c.device_copy) STRATA_CHECK(c.device_slot >= 0);
    // A host buffer beside an NVMe (or absent) param is a staging copy.
    if (c.kind == StateKind::kParam && c.host != nullptr && (c.value == ChunkValue::kNvme || c.absent())) {
      STRATA_CHECK(staging_[c.family].state != Staging::kNone);
    }
    if (c.dirty()) STRATA_CHECK(c.device_copy);
    // A leased device copy keeps its slot (eviction skips leased chunks).
    if (c.readers > 0 || c.writers > 0) STRATA_CHECK(c.device_copy || c.value == ChunkValue::kHost);
  }
  check_staging_invariants();
}

void Residency::check_staging_invariants() const {
  STRATA_CHECK(staged_.size() <= staging_max_);
  int reading = 0;
  for (FamilyId f : staged_) {
    STRATA_CHECK(staging_[f].state != Staging::kNone);
    STRATA_CHECK(staging_[f].lent == 0 || staging_[f].state == Staging::kReady);
    STRATA_CHECK(core_.plan().families[f].param_home == Tier::kNvme);
    reading += staging_[f].state == Staging::kReading ? 1 : 0;
  }
  STRATA_CHECK(reading == staging_reads_);
  STRATA_CHECK(staging_buffers_.size() <= staging_max_ || staging_max_ == 0);
  STRATA_CHECK(staging_free_.size() + staged_.size() == staging_buffers_.size());
}

void OptimizerPipeline::check_invariants() const {
  int running = 0, staging = 0, held = 0, parked = 0, carried = 0, places = 0, reading = 0, writing = 0;
  for (FamilyId f = 0; f < runs_.size(); ++f) {
    const FamilyRun& run = runs_[f];
    running += run.running() ? 1 : 0;
    staging += run.room == GradRoom::kStaging ? 1 : 0;
    held += run.room == GradRoom::kHeld ? 1 : 0;
    parked += run.parked() ? 1 : 0;
    carried += run.carried() ? 1 : 0;
    // Note [Deferred updates]: a parked run is a deferred family's, placeless until
    // step() ends; a carried one runs on; a held gradient is a running run's.
    if (run.parked()) STRATA_CHECK(run.running() && defer_[f] && run.place == NvmePlace::kNone);
    if (run.carried()) STRATA_CHECK(run.running());
    // A landed gradient takes one room; the chunk's own host copy needs no buffer.
    STRATA_CHECK((run.grad == GradStaging::kNone) == (run.room == GradRoom::kNone));
    if (run.grad == GradStaging::kNone) STRATA_CHECK(run.grad_host == nullptr);
    // An NVMe-homed param waits for the gradients only while its family holds a place.
    if (run.param != ParamRead::kNone) STRATA_CHECK(run.place != NvmePlace::kNone);
    places += run.place != NvmePlace::kNone ? 1 : 0;
    reading += run.io_pending > 0 ? 1 : 0;
    writing += writebacks_[f].active ? 1 : 0;
    // Only a launched family stages its gradient, and gives it back before it is done.
    if (run.grad != GradStaging::kNone) STRATA_CHECK(run.running());
    // A place is the NVMe families' (read-ahead may hold one before launch).
    if (run.place != NvmePlace::kNone) STRATA_CHECK(core_.on_nvme(f));
    if (run.place == NvmePlace::kCancelling) STRATA_CHECK(run.io_pending > 0);
    if (run.place == NvmePlace::kReady) STRATA_CHECK(run.io_pending == 0);
    STRATA_CHECK(run.io_pending >= 0);
  }
  STRATA_CHECK(running == tasks_in_flight_);
  STRATA_CHECK(staging == grad_staging_used_);
  STRATA_CHECK(grad_staging_used_ <= grad_staging_max_);
  STRATA_CHECK(held == held_grads_);
  STRATA_CHECK(held_grads_ <= held_max_);
  STRATA_CHECK(parked == parked_);
  STRATA_CHECK(carried == carried_);
  // A write-back keeps its family's place until its writes end (Note [Write-back after step]).
  STRATA_CHECK(places + writing == nvme_places_used_);
  STRATA_CHECK(nvme_places_used_ <= nvme_places_max_);
  STRATA_CHECK(reading == io_families_);
  STRATA_CHECK(writing == writebacks_in_flight_);
}

void Runtime::Impl::check_invariants() const {
  if (!core().finalized()) return;
  int leased = 0;
  for (const Chunk& c : core().chunks()) {
    STRATA_CHECK(c.readers >= 0);
    STRATA_CHECK(c.writers >= 0);
    leased += c.readers + c.writers;
    if (c.bytes == 0) {
      STRATA_CHECK(c.absent());
      STRATA_CHECK(!c.device_copy);
      continue;
    }
    if (c.value == ChunkValue::kHost) STRATA_CHECK(c.host != nullptr);
    if (c.value == ChunkValue::kNvme) STRATA_CHECK(!c.nvme_slots.empty());
    // Only gradients go to the pipeline's staging; a param always has a value, on
    // host (or on the device, updated there, in an everything-on-GPU plan).
    if (c.value == ChunkValue::kStaged) STRATA_CHECK(c.kind == StateKind::kGrad);
    // An NVMe-homed param's value is on NVMe or absent (zeros), or on host while
    // its write-back runs (Note [NVMe-homed params]).
    if (c.kind == StateKind::kParam && !core().param_on_nvme(c.family))
      STRATA_CHECK(c.value == ChunkValue::kHost || c.value == ChunkValue::kDevice);
    if (c.kind == StateKind::kParam && core().param_on_nvme(c.family))
      STRATA_CHECK(c.value == ChunkValue::kHost || c.value == ChunkValue::kNvme || c.absent());
  }
  STRATA_CHECK(leased == book_.leases_out);
  dp().check_invariants();
  residency().check_invariants();
  pipeline().check_invariants();
}

}  // namespace strata::runtime
