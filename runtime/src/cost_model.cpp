#include "strata/runtime/cost_model.hpp"

#include <algorithm>
#include <limits>
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

std::uint64_t simulate_param_fetches(const PlanInput& in, const Plan& plan, std::uint64_t* fetch_bytes) {
  *fetch_bytes = 0;
  if (plan.all_gpu) return 0;
  const auto& uses = in.trace.uses;
  const std::size_t n = in.families.size();
  NextUse next(uses, n);
  const std::vector<long> last_backward = last_backward_use(in.trace, n);
  std::vector<bool> param_in(n, false);
  std::vector<bool> grad_in(n, false);
  std::uint64_t used = 0;  // slots held
  std::uint64_t fetches = 0;
  // Two passes over the cyclic sequence; count the second (steady state).
  for (int pass = 0; pass < 2; ++pass) {
    for (std::size_t pos = 0; pos < uses.size(); ++pos) {
      const FamilyUse& use = uses[pos];
      const FamilyId f = use.family;
      const bool streams = !plan.families[f].param_resident_gpu;
      auto make_room = [&] {
        if (used < plan.gpu_cache_slots) return;
        // Evict the resident param with the farthest next use (never the current one).
        FamilyId victim = static_cast<FamilyId>(n);
        std::uint64_t farthest = 0;
        for (FamilyId g = 0; g < n; ++g) {
          if (!param_in[g] || g == f) continue;
          std::uint64_t d = next.distance(g, pos);
          if (victim == n || d > farthest) {
            victim = g;
            farthest = d;
          }
        }
        if (victim < n) {
          param_in[victim] = false;
          --used;
        }
      };
      if (streams && !param_in[f]) {
        make_room();
        param_in[f] = true;
        ++used;
        if (pass == 1) {
          ++fetches;
          *fetch_bytes += in.families[f].param_bytes;
        }
      }
      if (use.phase == Phase::kBackward && in.families[f].grad_bytes > 0 && !grad_in[f] &&
          plan.families[f].optim_home != Tier::kGpu) {
        make_room();
        grad_in[f] = true;
        ++used;
      }
      if (grad_in[f] && static_cast<long>(pos) == last_backward[f]) {
        grad_in[f] = false;  // complete: copied to host, slot freed
        --used;
      }
    }
  }
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
  // Params read from NVMe for each fetch of an NVMe-homed family (approximation:
  // every fetch of such a family reads it from disk).
  for (std::size_t i = 0; i < n; ++i) {
    if (plan.families[i].param_home == Tier::kNvme) c.bytes_disk_read += 2 * in.families[i].param_bytes;
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
      tail_s = seconds(static_cast<double>(f.grad_bytes), rates.d2h_bytes_per_s) +
               seconds(static_cast<double>(f.numel), rates.cpu_optim_params_per_s) +
               seconds(static_cast<double>(f.param_bytes), rates.h2d_bytes_per_s);
      if (p.optim_home == Tier::kNvme) {
        tail_s += seconds(static_cast<double>(f.optim_bytes), rates.disk_write_bytes_per_s);
      }
    }
  }
  return tail_s;
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
  c.disk_s = rates.disk_mixed_bytes_per_s > 0
                 ? static_cast<double>(c.bytes_disk_read + c.bytes_disk_write) / rates.disk_mixed_bytes_per_s
                 : 0.0;
  c.host_memory_s = rates.host_memory_bytes_per_s > 0
                        ? static_cast<double>(c.bytes_host_memory) / rates.host_memory_bytes_per_s
                        : 0.0;

  const std::pair<const char*, double> busy[] = {{"compute", c.compute_s},
                                                 {"h2d", c.h2d_s},
                                                 {"d2h", c.d2h_s},
                                                 {"disk_read", c.disk_read_s},
                                                 {"disk_write", c.disk_write_s},
                                                 {"cpu_optimizer", c.cpu_optim_s},
                                                 {"gpu_optimizer", c.gpu_optim_s},
                                                 {"host_memory", c.host_memory_s},
                                                 {"disk", c.disk_s}};
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
