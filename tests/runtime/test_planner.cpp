#include <gtest/gtest.h>

#include "strata/common/bytes.hpp"
#include "strata/runtime/cost_model.hpp"
#include "strata/runtime/planner.hpp"

namespace strata::runtime {
namespace {

// A layered model: `layers` families of equal size, forward 0..L-1 then backward L-1..0.
PlanInput layered(std::size_t layers, std::uint64_t numel, Budgets budgets) {
  PlanInput in;
  for (std::size_t i = 0; i < layers; ++i) {
    in.families.push_back({.numel = numel,
                           .param_bytes = 4 * numel,
                           .grad_bytes = 4 * numel,
                           .optim_bytes = 8 * numel});  // fp32 params: Adam m, v
  }
  for (std::size_t i = 0; i < layers; ++i) {
    in.trace.uses.push_back(
        {.family = static_cast<FamilyId>(i), .phase = Phase::kForward, .compute_s = 0.01});
  }
  for (std::size_t i = layers; i-- > 0;) {
    in.trace.uses.push_back({.family = static_cast<FamilyId>(i),
                             .phase = Phase::kBackward,
                             .writes_grad = true,
                             .compute_s = 0.02});
  }
  in.budgets = budgets;
  in.slot_bytes = 4 * numel;
  return in;
}

TEST(Planner, EverythingOnGpuWhenItFits) {
  auto in = layered(4, 1u << 20, {.gpu_bytes = 1 * kGiB, .host_bytes = 1 * kGiB});
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->all_gpu);
  StepCost cost = predict_step(in, *plan, Rates{});
  EXPECT_EQ(cost.bytes_h2d, 0u);
  EXPECT_EQ(cost.bytes_d2h, 0u);
  EXPECT_NEAR(cost.compute_s, 4 * 0.03, 1e-12);

  // On the sim device the "GPU" optimizer's kernels share the host's cores with its compute
  // (Note [Host cores as a resource]).
  Rates sim;
  sim.cpu_threads = 2;
  sim.compute_host_threads = 2;
  sim.gpu_optim_params_per_s = 1e6;
  const StepCost host = predict_step(in, *plan, sim);
  ASSERT_GT(host.gpu_optim_s, 0.0);
  EXPECT_NEAR(host.host_cpu_s, host.compute_s + host.gpu_optim_s, 1e-12);
  EXPECT_EQ(host.bottleneck, "host_cpu");
}

TEST(Planner, StreamsAndSpillsToNvmeWithinBudgets) {
  // 24 layers x 4 Mi params = 16 B/param -> 1.5 GiB of state.
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_FALSE(plan->all_gpu);
  EXPECT_LE(plan->gpu_bytes, in.budgets.gpu_bytes);
  EXPECT_LE(plan->host_bytes, in.budgets.host_bytes);
  int nvme = 0;
  for (const auto& f : plan->families) nvme += f.optim_home == Tier::kNvme;
  EXPECT_GT(nvme, 0);
  // The families whose grads complete first (the last layers) are the NVMe ones.
  EXPECT_EQ(plan->families[23].optim_home, Tier::kNvme);
  EXPECT_EQ(plan->families[0].optim_home, Tier::kHost);
  EXPECT_GT(plan->prefetch_depth, 0u);

  StepCost cost = predict_step(in, *plan, Rates{});
  EXPECT_GT(cost.bytes_h2d, 0u);
  EXPECT_EQ(cost.bytes_disk_read, cost.bytes_disk_write);
  EXPECT_GT(cost.step_s, cost.bound_s);
  EXPECT_FALSE(cost.bottleneck.empty());
}

// Note [Host room]: one gradient host copy per streaming slot, or every gradient when
// they wait for the step (micro-batches, a deferred step); counted in host_bytes.
TEST(Planner, HostRoomCountsGradientCopies) {
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  auto plain = make_plan(in);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->grad_host_bytes, plain->gpu_cache_slots * 16 * kMiB);
  EXPECT_LE(plain->host_bytes, in.budgets.host_bytes);
  in.options.micro_batches = 3;
  auto accumulating = make_plan(in);
  ASSERT_TRUE(accumulating.ok()) << accumulating.status();
  EXPECT_EQ(accumulating->grad_host_bytes, 24 * 16 * kMiB);
  // Room for every gradient comes off the host room for states.
  int host_plain = 0, host_accumulating = 0;
  for (const auto& f : plain->families) host_plain += f.optim_home == Tier::kHost;
  for (const auto& f : accumulating->families) host_accumulating += f.optim_home == Tier::kHost;
  EXPECT_LT(host_accumulating, host_plain);
  EXPECT_LE(accumulating->host_bytes, in.budgets.host_bytes);
  in.options.micro_batches = 1;
  in.deferred_step = true;
  auto deferred = make_plan(in);
  ASSERT_TRUE(deferred.ok()) << deferred.status();
  EXPECT_EQ(deferred->grad_host_bytes, 24 * 16 * kMiB);
  // A budget below the landing slots and every gradient's copy is refused by name.
  in.deferred_step = false;
  in.options.micro_batches = 2;
  in.budgets.host_bytes = 64 * kMiB;
  auto refused = make_plan(in);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("every gradient"), std::string::npos) << refused.status();
}

// The minimum a host refusal names is one the planner accepts (Note [Host room]).
TEST(Planner, RefusalNamesAnAcceptedHostBudget) {
  for (std::uint64_t host : {1 * kMiB, 40 * kMiB, 200 * kMiB}) {
    auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = host, .nvme_bytes = 8 * kGiB});
    auto refused = make_plan(in);
    ASSERT_FALSE(refused.ok()) << host;
    const std::string m = refused.status().message();  // a copy: status() returns by value
    const auto at = m.find("raise host_budget to at least ");
    ASSERT_NE(at, std::string::npos) << m;
    const auto open = m.find('(', at);
    ASSERT_NE(open, std::string::npos) << m;
    const std::uint64_t least = std::stoull(m.substr(open + 1));
    EXPECT_GT(least, host) << m;
    in.budgets.host_bytes = least;
    auto accepted = make_plan(in);
    ASSERT_TRUE(accepted.ok()) << accepted.status();
    EXPECT_LE(accepted->host_bytes, least);
    in.budgets.host_bytes = least - 64 * kKiB;
    EXPECT_FALSE(make_plan(in).ok()) << "a smaller minimum was missed: " << least;
  }
}

TEST(Planner, NvmeBytesCountWholeSlotsAndCopyOnWriteRoom) {
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  // States stored in 12 MiB slots: each 16 MiB family takes 24 MiB on disk.
  const std::uint64_t slot = nvme_slot_bytes(12 * kMiB);
  EXPECT_EQ(slot, 12 * kMiB);
  EXPECT_EQ(nvme_chunk_bytes(16 * kMiB, slot), 24 * kMiB);
  EXPECT_EQ(nvme_slot_bytes(1 * kGiB), 64 * kMiB);  // capped; big chunks take several slots
  EXPECT_EQ(nvme_slot_bytes(5000), 8192u);
  for (FamilyBytes& f : in.families) f.optim_nvme_bytes = 2 * nvme_chunk_bytes(f.optim_bytes / 2, slot);
  in.options.nvme_families_in_flight = 3;
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::uint64_t families_on_nvme = 0;
  for (const auto& f : plan->families) families_on_nvme += f.optim_home == Tier::kNvme;
  ASSERT_GT(families_on_nvme, 0u);
  // Whole slots for every NVMe family, plus fresh slots for the 3 in flight and one chunk.
  EXPECT_EQ(plan->nvme_bytes, (families_on_nvme + 3 + 1) * 2 * 24 * kMiB);

  // A budget that holds the states but not the copy-on-write room is refused, by name.
  in.budgets.nvme_bytes = families_on_nvme * 2 * 24 * kMiB;
  auto tight = make_plan(in);
  ASSERT_FALSE(tight.ok());
  EXPECT_NE(tight.status().message().find("nvme_budget"), std::string::npos) << tight.status();
  EXPECT_NE(tight.status().message().find("copy-on-write"), std::string::npos) << tight.status();
}

TEST(CostModel, HostMemoryAndSharedDiskAreResources) {
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  Rates rates;
  const StepCost base = predict_step(in, *plan, rates);
  EXPECT_EQ(base.host_memory_s, 0.0);  // not modelled without a rate
  EXPECT_EQ(base.disk_s, 0.0);

  // A slow host memory becomes the bottleneck; sim copies (memcpy) count twice.
  rates.host_memory_bytes_per_s = 1e8;
  const StepCost dma = predict_step(in, *plan, rates);
  EXPECT_EQ(dma.bottleneck, "host_memory");
  EXPECT_NEAR(dma.host_memory_s, static_cast<double>(dma.bytes_host_memory) / 1e8, 1e-9);
  rates.copy_host_passes = 2.0;
  const StepCost sim = predict_step(in, *plan, rates);
  EXPECT_EQ(sim.bytes_host_memory - dma.bytes_host_memory, dma.bytes_h2d + dma.bytes_d2h);

  // Reads and writes sharing one disk: the mixed rate bounds both together.
  rates = Rates{};
  rates.disk_mixed_bytes_per_s = 1e8;
  const StepCost disk = predict_step(in, *plan, rates);
  EXPECT_EQ(disk.bottleneck, "disk");
  EXPECT_NEAR(disk.disk_s, static_cast<double>(disk.bytes_disk_read + disk.bytes_disk_write) / 1e8, 1e-9);
  EXPECT_GT(disk.step_s, base.step_s);

  // Compute on host threads (the sim device) shares the cores with the CPU optimizer.
  EXPECT_EQ(base.host_cpu_s, 0.0);  // not modelled unless the optimizer's thread count is given
  rates = Rates{};
  rates.compute_host_threads = 1;
  rates.cpu_threads = 2;
  const StepCost cores = predict_step(in, *plan, rates);
  EXPECT_NEAR(cores.host_cpu_s, cores.compute_s / 2 + cores.cpu_optim_s, 1e-12);
  EXPECT_GE(cores.bound_s, cores.host_cpu_s);
}

TEST(CostModel, TheMixedDiskRateScalesWithTheFamilysSize) {
  // Note [Disk rate by family size]: the pipeline pass's cost a byte beyond the disk's serial
  // rate is its hops, paid once a family, so it shrinks as the plan's families grow.
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  double families = 0, state_bytes = 0;
  for (std::size_t i = 0; i < in.families.size(); ++i) {
    if (plan->families[i].optim_home != Tier::kNvme) continue;
    families += 1;
    state_bytes += static_cast<double>(in.families[i].optim_bytes);
  }
  ASSERT_GT(families, 0);
  const double mean = state_bytes / families;
  // As many pipeline places as families: no forward window (Note [NVMe pipeline window]), so
  // disk_s is the bytes at the mixed rate alone.
  in.options.nvme_families_in_flight = static_cast<std::uint32_t>(in.families.size());
  Rates rates;
  rates.disk_read_bytes_per_s = 2e9;
  rates.disk_write_bytes_per_s = 2e9;  // serial: 2e9 bytes a second of equal reads and writes
  rates.disk_mixed_bytes_per_s = 1e9;  // the pass paid as much again in hops
  const auto disk_s = [&](double family_bytes) {
    Rates r = rates;
    r.disk_mixed_family_bytes = family_bytes;
    const StepCost c = predict_step(in, *plan, r);
    return std::pair{c.disk_s, static_cast<double>(c.bytes_disk_read + c.bytes_disk_write)};
  };
  const auto [as_measured, bytes] = disk_s(0);  // no family size: the mixed rate as measured
  ASSERT_GT(bytes, 0);
  EXPECT_NEAR(as_measured, bytes / 1e9, 1e-9);
  EXPECT_NEAR(disk_s(mean).first, bytes / 1e9, 1e-9);  // measured at the plan's size: the same
  // Families 4x the pass's: a quarter of the hops' cost a byte.
  EXPECT_NEAR(disk_s(mean / 4).first, bytes * (0.5e-9 + 0.25 * 0.5e-9), 1e-9);
  // Families a quarter of the pass's: 4x.
  EXPECT_NEAR(disk_s(mean * 4).first, bytes * (0.5e-9 + 4 * 0.5e-9), 1e-9);
  // A pass faster than the serial rates (reads overlapping writes) is taken as measured.
  rates.disk_mixed_bytes_per_s = 3e9;
  EXPECT_NEAR(disk_s(mean / 4).first, bytes / 3e9, 1e-9);
}

TEST(CostModel, UpdatesDeferredIntoTheNextForwardMoveTheirStatesIntoItsWindow) {
  // Note [NVMe pipeline window]: forward gives the disk the places' share of the states'
  // traffic; deferred updates (Note [Deferred updates]) add theirs, and forward lasts at
  // least as long as the disk takes for that share.
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  Rates rates;
  rates.disk_mixed_bytes_per_s = 1e9;
  const auto disk_s = [&](std::uint32_t deferred, std::uint64_t* nvme_families, double* state_bytes) {
    PlanInput with = in;
    with.options.deferred_updates = deferred;
    with.budgets.host_bytes += std::uint64_t{deferred} * with.families[0].grad_bytes;  // their held gradients
    auto plan = make_plan(with);
    EXPECT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->deferred_update_families, deferred);
    *nvme_families = 0;
    *state_bytes = 0;
    for (std::size_t i = 0; i < with.families.size(); ++i) {
      if (plan->families[i].optim_home != Tier::kNvme) continue;
      ++*nvme_families;
      *state_bytes += 2.0 * static_cast<double>(with.families[i].optim_bytes);
    }
    return predict_step(with, *plan, rates).disk_s;
  };
  std::uint64_t families = 0;
  double bytes = 0;
  const double places = in.options.nvme_families_in_flight;
  const double forward_s = 24 * 0.01;
  const double none = disk_s(0, &families, &bytes);
  ASSERT_GT(families, 8u);
  EXPECT_NEAR(none, std::max(bytes / 1e9, forward_s + (families - places) / families * bytes / 1e9), 1e-9);
  // Four deferred: their share is more than forward's compute, so forward waits for the disk.
  const double four = disk_s(4, &families, &bytes);
  const double in_forward = (places + 4) / static_cast<double>(families);
  ASSERT_GT(in_forward * bytes / 1e9, forward_s);
  EXPECT_NEAR(four, std::max(bytes / 1e9, in_forward * bytes / 1e9 + (1 - in_forward) * bytes / 1e9), 1e-9);
  EXPECT_LT(four, none + 1e-12);
}

TEST(CostModel, MemcpyCopiesAndChecksumsShareTheHostCores) {
  // Note [Host cores as a resource]: on two cores the sim device's memcpy copies and the
  // disk's checksums and I/O take core time beside the compute and the optimizer.
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  Rates rates;
  rates.cpu_threads = 2;
  rates.compute_host_threads = 2;
  const StepCost plain = predict_step(in, *plan, rates);
  ASSERT_GT(plain.bytes_disk_read + plain.bytes_disk_write, 0u);
  ASSERT_GT(plain.bytes_h2d + plain.bytes_d2h, 0u);
  EXPECT_NEAR(plain.host_cpu_s, plain.compute_s + plain.cpu_optim_s, 1e-12);

  rates.host_memory_bytes_per_s = 1e9;  // DMA copies (one pass) take no core
  EXPECT_NEAR(predict_step(in, *plan, rates).host_cpu_s, plain.host_cpu_s, 1e-12);
  rates.copy_host_passes = 2.0;  // memcpy: each copied byte read and written by a core
  const StepCost sim = predict_step(in, *plan, rates);
  EXPECT_NEAR(sim.host_cpu_s - plain.host_cpu_s,
              2.0 * static_cast<double>(sim.bytes_h2d + sim.bytes_d2h) / 1e9, 1e-9);

  rates.disk_cpu_seconds_per_byte = 2e-8;  // two cores at 1e8 bytes a second: enough to bound the step
  const StepCost crc = predict_step(in, *plan, rates);
  EXPECT_NEAR(crc.host_cpu_s - sim.host_cpu_s,
              static_cast<double>(crc.bytes_disk_read + crc.bytes_disk_write) / 1e8, 1e-9);
  EXPECT_EQ(crc.bottleneck, "host_cpu");
  EXPECT_NEAR(crc.bound_s, crc.host_cpu_s, 1e-12);
  // The parts the probe reports (model_terms) add up to the whole.
  EXPECT_NEAR(crc.host_cpu_device_s, crc.compute_s, 1e-12);
  EXPECT_NEAR(crc.host_cpu_copy_s, sim.host_cpu_s - plain.host_cpu_s, 1e-9);
  EXPECT_NEAR(crc.host_cpu_s,
              crc.cpu_optim_s + crc.host_cpu_device_s + crc.host_cpu_copy_s + crc.host_cpu_disk_s, 1e-12);
}

TEST(Planner, ParamsThatDoNotFitOnHostGoToNvmeWithTheirStatesAndCountedStaging) {
  // 24 x 16 MiB of params; 512 MiB of host.
  auto in =
      layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 512 * kMiB, .nvme_bytes = 8 * kGiB});
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_LE(plan->host_bytes, in.budgets.host_bytes);
  EXPECT_LE(plan->nvme_bytes, in.budgets.nvme_bytes);
  EXPECT_EQ(plan->families.back().param_home, Tier::kNvme);
  EXPECT_EQ(plan->param_staging_buffers, plan->prefetch_depth + 2);
  std::uint64_t host_params = 0, nvme_params = 0;
  for (std::size_t i = 0; i < plan->families.size(); ++i) {
    const FamilyPlan& f = plan->families[i];
    // A param is updated where its states are.
    if (f.param_home == Tier::kNvme) {
      EXPECT_EQ(f.optim_home, Tier::kNvme) << "family " << i;
    }
    (f.param_home == Tier::kHost ? host_params : nvme_params) += in.families[i].param_bytes;
  }
  EXPECT_GT(nvme_params, 0u);
  // The host holds the grad landing slots, a gradient host copy per streaming slot,
  // one NVMe chunk's temporary copy (a family's states), both stagings and the
  // host-homed params (Note [Host room]).
  EXPECT_EQ(plan->grad_host_bytes, plan->gpu_cache_slots * 16 * kMiB);
  const std::uint64_t staging = (plan->prefetch_depth + 2) * (16 * kMiB) + 2 * (32 * kMiB + 16 * kMiB);
  EXPECT_EQ(plan->host_bytes, 2 * 16 * kMiB + plan->grad_host_bytes + 32 * kMiB + staging + host_params);
  // Every spilled param and all states on NVMe, plus copy-on-write room for 2 families (states + param)
  // and for one chunk written meanwhile.
  EXPECT_EQ(plan->nvme_bytes, nvme_params + 24 * 32 * kMiB + 2 * (32 * kMiB + 16 * kMiB) + 32 * kMiB);

  in.options.allow_nvme_params = false;  // the old behaviour, on request
  auto refused = make_plan(in);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(refused.status().message().find("allow_nvme_params is off"), std::string::npos)
      << refused.status();
}

TEST(Planner, HostBudgetBelowTheParamStagingIsAOneLineErrorWithTheSizes) {
  // Params spill, but the host cannot even hold the staging they need.
  auto in =
      layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 300 * kMiB, .nvme_bytes = 8 * kGiB});
  auto plan = make_plan(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kOutOfBudget);
  const std::string msg = plan.status().message();
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_NE(msg.find("host_budget 300.00 MiB is smaller than the staging NVMe-homed params need"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("6 param staging buffers x 16.00 MiB"), std::string::npos) << msg;
}

TEST(Planner, HostBudgetTooSmallWithoutAnNvmeTierSaysThereIsNoNvmeTier) {
  // budgets.nvme is 0 and the host cannot hold the params (300 MiB), or holds the params but not
  // the optimizer states: the error names the missing tier, not the staging an NVMe tier would need.
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 300 * kMiB, .nvme_bytes = 0});
  std::uint64_t params = 0, states = 0;
  for (const FamilyBytes& f : in.families) {
    params += f.param_bytes;
    states += f.optim_bytes;
  }
  for (std::uint64_t host : {300 * kMiB, params + states / 2}) {
    in.budgets.host_bytes = host;
    auto plan = make_plan(in);
    ASSERT_FALSE(plan.ok());
    EXPECT_EQ(plan.status().code(), StatusCode::kOutOfBudget);
    const std::string msg = plan.status().message();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find(fmt::format("host_budget {} cannot hold the params", format_bytes(host))),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("no NVMe tier to spill to (budgets.nvme is 0)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("staging"), std::string::npos) << msg;
  }
}

TEST(Planner, NvmeBudgetBelowParamsStatesAndCopyOnWriteRoomIsAnError) {
  auto in =
      layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 512 * kMiB, .nvme_bytes = 8 * kGiB});
  auto fits = make_plan(in);
  ASSERT_TRUE(fits.ok()) << fits.status();
  in.budgets.nvme_bytes = fits->nvme_bytes - 4096;  // one page short of the copy-on-write room
  auto plan = make_plan(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kOutOfBudget);
  const std::string msg = plan.status().message();
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_NE(msg.find("nvme_budget"), std::string::npos) << msg;
  EXPECT_NE(msg.find("copy-on-write"), std::string::npos) << msg;
}

TEST(Planner, BudgetTooSmallNamesTheBudget) {
  auto in = layered(8, 4u << 20, {.gpu_bytes = 32 * kMiB, .host_bytes = 1 * kGiB, .nvme_bytes = 8 * kGiB});
  auto plan = make_plan(in);
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(plan.status().message().find("gpu_budget"), std::string::npos) << plan.status();

  auto no_nvme = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 512 * kMiB});
  auto p2 = make_plan(no_nvme);
  ASSERT_FALSE(p2.ok());
  EXPECT_NE(p2.status().message().find("NVMe"), std::string::npos) << p2.status();
}

// Note [Working sets]: tensors leased together over 3 families (an LSTM's weights) need a
// slot each and one for a gradient: 3 slots, which plan without them, are refused naming 4.
TEST(Planner, AWorkingSetOverSeveralFamiliesNeedsASlotEachAndOneForAGradient) {
  auto in = layered(8, 1u << 20, {.gpu_bytes = 12 * kMiB + kMiB, .host_bytes = 1 * kGiB});
  auto three = make_plan(in);
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->gpu_cache_slots, 3u);
  in.working_set_families = 3;
  auto refused = make_plan(in);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfBudget);
  EXPECT_NE(
      refused.status().message().find("4 chunk slots of 4.00 MiB: tensors leased together span 3 families"),
      std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("needs 16.00 MiB"), std::string::npos) << refused.status();
  in.budgets.gpu_bytes = 16 * kMiB;
  auto four = make_plan(in);
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->gpu_cache_slots, 4u);
}

TEST(Planner, BeladyFetchesEachStreamedParamTwicePerStepAtMost) {
  auto in = layered(24, 4u << 20, {.gpu_bytes = 256 * kMiB, .host_bytes = 4 * kGiB, .nvme_bytes = 0});
  auto plan = make_plan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::uint64_t bytes = 0;
  std::uint64_t fetches = simulate_param_fetches(in, *plan, &bytes);
  std::size_t streamed = 0;
  for (const auto& f : plan->families) streamed += f.param_resident_gpu ? 0 : 1;
  EXPECT_LE(fetches, 2 * streamed);
  // The turn from forward to backward reuses the last layers' params from the cache.
  EXPECT_LT(fetches, 2 * streamed);
}

}  // namespace
}  // namespace strata::runtime
