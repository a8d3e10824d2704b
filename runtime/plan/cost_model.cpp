#include "strata/runtime/cost_model.hpp"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "strata/common/assert.hpp"

namespace strata::runtime {
namespace {

double seconds(double work, double rate) {
  if (work <= 0) return 0.0;
  if (rate <= 0) return std::numeric_limits<double>::infinity();
  return work / rate;
}

}  // namespace

namespace {

// Note [Cost model follows the runtime]
// The replay below is the runtime's own slot choice (Residency::pick_slot and
// Residency::prefetch, eviction.cpp), run on the traced sequence under two
// assumptions that make it deterministic: every device fence has completed when
// a slot is picked (the device keeps up with the training thread, so "idle" in
// Note [Idle victims first] means "not needed within the prefetch window"), and a
// family's optimizer takes its gradient and commits its param as soon as its last
// backward use ends (the gradient leaves its slot, and the stale device copy of a
// streamed param is dropped: OptimizerPipeline::commit_param). Each use acquires
// its family's param; a backward use then acquires its gradient; every
// placement is followed by a prefetch of the params of the next
// `prefetch_depth` uses (not past the end of the step), which stops while two
// movable slots or fewer remain and takes only clean victims used later than its
// target. A test runs a runtime that meets the assumptions and checks the bytes
// to the byte (test_runtime, Runtime.StepMovesTheBytesTheCostModelPredicts); a
// device that falls behind makes the runtime pick busy slots last, and moves
// somewhat more than this.
class SlotReplay {
 public:
  SlotReplay(const PlanInput& in, const Plan& plan)
      : in_(in),
        plan_(plan),
        next_(in.trace.uses, in.families.size()),
        slots_(plan.gpu_cache_slots),
        param_slot_(in.families.size(), -1),
        grad_slot_(in.families.size(), -1) {}

  // Replays one step; returns the param bytes loaded host -> device (fetches
  // and prefetches) and counts them in *fetches.
  std::uint64_t step(std::uint64_t* fetches) {
    const auto& uses = in_.trace.uses;
    const std::vector<long> last_backward = last_backward_use(in_.trace, in_.families.size());
    std::uint64_t bytes = 0;
    *fetches = 0;
    for (std::size_t pos = 0; pos < uses.size(); ++pos) {
      const FamilyId f = uses[pos].family;
      leased_param_ = static_cast<long>(f);
      leased_grad_ = -1;
      if (streams(f) && param_slot_[f] < 0) {
        const long s = pick(f, pos, 0);
        if (s >= 0) {
          place(static_cast<std::size_t>(s), f, /*grad=*/false);
          bytes += in_.families[f].param_bytes;
          ++*fetches;
        }
      }
      bytes += prefetch(pos, fetches);
      if (uses[pos].phase == Phase::kBackward && takes_grad_slot(f)) {
        if (grad_slot_[f] < 0) {
          const long s = pick(f, pos, 0);
          if (s >= 0) place(static_cast<std::size_t>(s), f, /*grad=*/true);
        }
        leased_grad_ = static_cast<long>(f);
        bytes += prefetch(pos, fetches);
      }
      leased_param_ = leased_grad_ = -1;
      if (static_cast<long>(pos) == last_backward[f]) {
        free_slot(grad_slot_[f]);  // the pipeline takes the gradient
        if (plan_.families[f].optim_home != Tier::kGpu) free_slot(param_slot_[f]);  // commit_param
      }
    }
    return bytes;
  }

 private:
  struct Slot {
    long family = -1;  // -1: free
    bool grad = false;
  };

  bool streams(FamilyId f) const {
    return !plan_.families[f].param_resident_gpu && in_.families[f].param_bytes > 0;
  }
  bool takes_grad_slot(FamilyId f) const {
    return in_.families[f].grad_bytes > 0 && plan_.families[f].optim_home != Tier::kGpu;
  }
  bool movable(const Slot& s) const {
    if (s.family < 0) return true;
    return !(s.grad ? s.family == leased_grad_ : s.family == leased_param_);
  }
  void place(std::size_t s, FamilyId f, bool grad) {
    free_slot(static_cast<long>(s));
    slots_[s] = {static_cast<long>(f), grad};
    (grad ? grad_slot_ : param_slot_)[f] = static_cast<long>(s);
  }
  void free_slot(long s) {
    if (s < 0) return;
    Slot& slot = slots_[static_cast<std::size_t>(s)];
    if (slot.family >= 0) (slot.grad ? grad_slot_ : param_slot_)[static_cast<std::size_t>(slot.family)] = -1;
    slot = {};
  }

  // Residency::pick_slot with every fence complete.
  long pick(FamilyId for_family, std::size_t here, std::uint64_t farther_than) const {
    long best = -1;
    std::uint64_t best_key = 0;
    int best_rank = -1;
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      if (!movable(s)) continue;
      const bool free = s.family < 0;
      std::uint64_t key = 0;
      bool soon = false;
      if (!free) {
        const auto g = static_cast<FamilyId>(s.family);
        if (g == for_family && !s.grad) continue;
        const std::uint64_t d = next_.distance(g, here);
        const bool dirty = s.grad;  // a gradient in a slot was written there
        if (farther_than > 0 && (dirty || d <= farther_than)) continue;
        key = (d == NextUse::kNever ? std::numeric_limits<std::uint32_t>::max() : d) * 2 + (dirty ? 0 : 1);
        soon = d <= std::uint64_t{plan_.prefetch_depth} + 1;
      }
      const int rank = (soon ? 0 : 2) + (free ? 1 : 0);
      if (rank > best_rank || (rank == best_rank && key > best_key)) {
        best = static_cast<long>(i);
        best_key = key;
        best_rank = rank;
      }
    }
    return best;
  }

  // Residency::prefetch.
  std::uint64_t prefetch(std::size_t here, std::uint64_t* fetches) {
    if (!in_.options.prefetch || plan_.prefetch_depth == 0) return 0;
    const auto& uses = in_.trace.uses;
    std::uint64_t bytes = 0;
    for (std::size_t q = here + 1; q < uses.size() && q < here + 1 + plan_.prefetch_depth; ++q) {
      const FamilyId f = uses[q].family;
      if (!streams(f) || param_slot_[f] >= 0) continue;
      std::size_t room = 0;
      for (const Slot& s : slots_) room += movable(s) ? 1 : 0;
      if (room <= 2) return bytes;
      const long s = pick(f, here, std::max<std::uint64_t>(q - here, 1));
      if (s < 0) return bytes;
      place(static_cast<std::size_t>(s), f, /*grad=*/false);
      bytes += in_.families[f].param_bytes;
      ++*fetches;
    }
    return bytes;
  }

  const PlanInput& in_;
  const Plan& plan_;
  NextUse next_;
  std::vector<Slot> slots_;
  std::vector<long> param_slot_, grad_slot_;
  long leased_param_ = -1, leased_grad_ = -1;
};

}  // namespace

std::uint64_t simulate_param_fetches(const PlanInput& in, const Plan& plan, std::uint64_t* fetch_bytes) {
  *fetch_bytes = 0;
  if (plan.all_gpu) return 0;
  SlotReplay replay(in, plan);
  std::uint64_t fetches = 0;
  replay.step(&fetches);  // the first step starts from empty slots; count the second (steady)
  *fetch_bytes = replay.step(&fetches);
  return fetches;
}

namespace {

// Bytes and optimizer work per steady step, per resource, beside the param
// fetches simulate_param_fetches counts.
void count_work(const PlanInput& in, const Plan& plan, StepCost& c) {
  const std::size_t n = in.families.size();
  for (std::size_t i = 0; i < n; ++i) {
    const FamilyBytes& f = in.families[i];
    const FamilyPlan& p = plan.families[i];
    if (f.numel == 0) continue;  // frozen: no optimizer work
    if (p.optim_home == Tier::kGpu) {
      c.params_gpu_optim += f.numel;
      continue;
    }
    c.params_cpu_optim += f.numel;
    // Gradient read; params and optimizer states read and written.
    c.bytes_host_memory += f.grad_bytes + 2 * f.param_bytes + 2 * f.optim_bytes;
    if (p.optim_home == Tier::kNvme) c.bytes_host_memory += 2 * f.param_bytes;  // the param's staging copy
    c.bytes_d2h += f.grad_bytes;
    if (p.param_resident_gpu) c.bytes_h2d += f.param_bytes;  // refreshed after the update
    if (p.optim_home == Tier::kNvme) {
      c.bytes_disk_read += f.optim_bytes;
      c.bytes_disk_write += f.optim_bytes;
    }
    if (p.param_home == Tier::kNvme) {
      c.bytes_disk_write += f.param_bytes;  // updated param written home
    }
  }
  // An NVMe-homed param is read for its forward and its backward use (approximation:
  // every fetch reads it from disk), and by its optimizer beside its states. The
  // optimizer copies the backward's copy instead while it still exists (Note
  // [NVMe-homed params] in residency.hpp), which it does only when the pipeline keeps
  // up with backward: not where the disk decides the step, the case this term is
  // for (3.2 B on this machine: 0.9 of a read a family a step).
  for (std::size_t i = 0; i < n; ++i) {
    if (plan.families[i].param_home == Tier::kNvme) c.bytes_disk_read += 3 * in.families[i].param_bytes;
  }
}

// What cannot overlap: the optimizer step of the family whose gradient completes last.
double tail_seconds(const PlanInput& in, const Plan& plan, const Rates& rates, long last_family) {
  double tail_s = 0.0;
  if (last_family >= 0) {
    const FamilyBytes& f = in.families[static_cast<std::size_t>(last_family)];
    const FamilyPlan& p = plan.families[static_cast<std::size_t>(last_family)];
    if (p.optim_home == Tier::kGpu) {
      tail_s = seconds(static_cast<double>(f.numel), rates.gpu_optim_params_per_s);
    } else {
      // Its NVMe states are written back after step() returns, overlapping the
      // next forward (Note [Write-back after step]): busy disk time, not tail.
      tail_s = seconds(static_cast<double>(f.grad_bytes), rates.d2h_bytes_per_s) +
               seconds(static_cast<double>(f.numel), rates.cpu_optim_params_per_s) +
               seconds(static_cast<double>(f.param_bytes), rates.h2d_bytes_per_s);
    }
  }
  return tail_s;
}

// The trainable families whose optimizer states live on NVMe: how many, and their
// state bytes (each way).
std::pair<std::uint64_t, std::uint64_t> nvme_state_families(const PlanInput& in, const Plan& plan) {
  std::uint64_t families = 0, optim_bytes = 0;
  for (std::size_t i = 0; i < in.families.size(); ++i) {
    if (in.families[i].numel == 0 || plan.families[i].optim_home != Tier::kNvme) continue;
    ++families;
    optim_bytes += in.families[i].optim_bytes;
  }
  return {families, optim_bytes};
}

// Note [NVMe pipeline window]
// The optimizer pipeline's NVMe I/O does not spread over the whole step. A
// family's states are written back only after its gradient exists (backward),
// and during forward only `nvme_families_in_flight` places read ahead (Note
// [Pipeline places] in optimizer_pipeline.cpp): the forward gives the disk those
// families' reads and the last step's write-backs of as many, nothing more. A
// trace of strata-probe --verify at optim-nvme (24M params, 17 families, 2
// places) showed it: the disk busy for the first half of forward, then idle
// until backward. So when the disk bounds the step, it takes the forward's
// compute plus the states' bytes past the places' share at the disk's rate, not
// all bytes at that rate. The share is by family count (the families of a
// placement are of one size where this matters); params on NVMe are read in
// forward too and are not counted here. Updates deferred into the next forward
// (Plan::deferred_update_families, Note [Deferred updates]) move their families'
// state traffic into forward too: forward then lasts at least as long as the
// disk takes for that share, and the rest follows.
double nvme_window_seconds(const PlanInput& in, const Plan& plan, double rate) {
  const auto [families, optim_bytes] = nvme_state_families(in, plan);
  const std::uint64_t state_bytes = 2 * optim_bytes;  // read and written
  const std::uint64_t places = in.options.nvme_families_in_flight;
  const std::uint64_t in_forward = places + plan.deferred_update_families;
  if (families <= in_forward || rate <= 0) return 0.0;
  double forward_s = 0.0;
  for (const FamilyUse& use : in.trace.uses) {
    if (use.phase == Phase::kForward) forward_s += use.compute_s;
  }
  const double share = static_cast<double>(families - in_forward) / static_cast<double>(families);
  const double rest_s = share * static_cast<double>(state_bytes) / rate;
  if (plan.deferred_update_families == 0) return forward_s + rest_s;
  const double forward_disk_s = (1.0 - share) * static_cast<double>(state_bytes) / rate;
  return std::max(forward_s, forward_disk_s) + rest_s;
}

// Note [Disk rate by family size]
// The mixed rate (Rates::disk_mixed_bytes_per_s) is measured with the optimizer
// pipeline's shape (Note [Probe disk pipeline pass]): each place reads a family's
// states, waits, runs the kernel, writes them and waits, so every family costs the
// disk a drain and the threads' hops besides its bytes. Those hops cost a fixed
// time a family, so what they cost a byte falls as families grow. So the mixed
// rate is read as two parts: the disk's own rate for equal reads and writes one
// after the other (the separately measured read and write rates) and a cost a
// byte that scales with disk_mixed_family_bytes / the plan's mean NVMe family's
// state bytes. At 3.2 B params with bf16 params (105 MB chunks), the probe's
// pass with 32 MiB families measured 2.1 GiB/s where the run moved 2.8 GB/s; the
// serial rates alone gave 30.2 s for the 28.9 s step (docs/scale.md). Where the
// pass ran faster than the serial rates (reads overlapping writes), or a rate is
// missing, the mixed rate is used as measured.
double mixed_disk_rate(const PlanInput& in, const Plan& plan, const Rates& rates) {
  const double mixed = rates.disk_mixed_bytes_per_s;
  if (mixed <= 0 || rates.disk_mixed_family_bytes <= 0 || rates.disk_read_bytes_per_s <= 0 ||
      rates.disk_write_bytes_per_s <= 0) {
    return mixed;
  }
  const auto [families, state_bytes] = nvme_state_families(in, plan);
  if (families == 0 || state_bytes == 0) return mixed;
  const double serial_s_per_byte = 0.5 / rates.disk_read_bytes_per_s + 0.5 / rates.disk_write_bytes_per_s;
  const double hops_s_per_byte = 1.0 / mixed - serial_s_per_byte;  // at the pass's family size
  if (hops_s_per_byte <= 0) return mixed;
  const double mean_family = static_cast<double>(state_bytes) / static_cast<double>(families);
  return 1.0 / (serial_s_per_byte + hops_s_per_byte * rates.disk_mixed_family_bytes / mean_family);
}

// Note [Host cores as a resource]: each piece of host work's share of all cores,
// into c's host_cpu_* fields.
void host_cores_seconds(StepCost& c, const Rates& rates) {
  if (rates.cpu_threads <= 0) return;
  if (rates.compute_host_threads > 0) {  // the device's compute and kernels run on the host
    c.host_cpu_device_s = c.compute_s * rates.compute_host_threads / rates.cpu_threads + c.gpu_optim_s;
  }
  if (rates.copy_host_passes > 1 && rates.host_memory_bytes_per_s > 0) {  // memcpy copies
    c.host_cpu_copy_s = rates.copy_host_passes * static_cast<double>(c.bytes_h2d + c.bytes_d2h) /
                        rates.host_memory_bytes_per_s;
  }
  c.host_cpu_disk_s = static_cast<double>(c.bytes_disk_read + c.bytes_disk_write) *
                      rates.disk_cpu_seconds_per_byte / rates.cpu_threads;
  c.host_cpu_s = c.cpu_optim_s + c.host_cpu_device_s + c.host_cpu_copy_s + c.host_cpu_disk_s;
}

}  // namespace

StepCost predict_step(const PlanInput& in, const Plan& plan, const Rates& rates) {
  StepCost c;
  simulate_param_fetches(in, plan, &c.bytes_h2d);
  long last_family = -1;
  for (const FamilyUse& use : in.trace.uses) {
    if (use.phase == Phase::kBackward) last_family = use.family;
  }
  count_work(in, plan, c);
  c.bytes_host_memory +=
      static_cast<std::uint64_t>(rates.copy_host_passes * static_cast<double>(c.bytes_h2d + c.bytes_d2h));
  c.bytes_host_memory += c.bytes_disk_read + c.bytes_disk_write;
  c.compute_s = in.trace.compute_total_s();
  c.h2d_s = seconds(static_cast<double>(c.bytes_h2d), rates.h2d_bytes_per_s);
  c.d2h_s = seconds(static_cast<double>(c.bytes_d2h), rates.d2h_bytes_per_s);
  c.disk_read_s = seconds(static_cast<double>(c.bytes_disk_read), rates.disk_read_bytes_per_s);
  c.disk_write_s = seconds(static_cast<double>(c.bytes_disk_write), rates.disk_write_bytes_per_s);
  c.cpu_optim_s = seconds(static_cast<double>(c.params_cpu_optim), rates.cpu_optim_params_per_s);
  c.gpu_optim_s = seconds(static_cast<double>(c.params_gpu_optim), rates.gpu_optim_params_per_s);
  const double mixed = mixed_disk_rate(in, plan, rates);  // Note [Disk rate by family size]
  c.disk_s = mixed > 0 ? static_cast<double>(c.bytes_disk_read + c.bytes_disk_write) / mixed : 0.0;
  c.disk_s = std::max(c.disk_s, nvme_window_seconds(in, plan, mixed));  // Note [NVMe pipeline window]
  c.host_memory_s = rates.host_memory_bytes_per_s > 0
                        ? static_cast<double>(c.bytes_host_memory) / rates.host_memory_bytes_per_s
                        : 0.0;

  host_cores_seconds(c, rates);

  const std::pair<const char*, double> busy[] = {{"compute", c.compute_s},
                                                 {"h2d", c.h2d_s},
                                                 {"d2h", c.d2h_s},
                                                 {"disk_read", c.disk_read_s},
                                                 {"disk_write", c.disk_write_s},
                                                 {"cpu_optimizer", c.cpu_optim_s},
                                                 {"gpu_optimizer", c.gpu_optim_s},
                                                 {"host_memory", c.host_memory_s},
                                                 {"disk", c.disk_s},
                                                 {"host_cpu", c.host_cpu_s}};
  for (const auto& [name, s] : busy) {
    if (s > c.bound_s || c.bottleneck.empty()) {
      c.bound_s = s;
      c.bottleneck = name;
    }
  }
  c.tail_s = tail_seconds(in, plan, rates, last_family);
  c.step_s = c.bound_s + c.tail_s;
  return c;
}

}  // namespace strata::runtime
