// strata-probe's report: the same measurements and plans as one JSON object
// (--json) or as text (run.hpp). Printing only; nothing here fails.
#include <cstdio>
#include <nlohmann/json.hpp>

#include "report.hpp"
#include "run.hpp"
#include "strata/common/bytes.hpp"

namespace strata::probe {
namespace {

double gib(double bytes_per_s) {
  return bytes_per_s / static_cast<double>(kGiB);
}

nlohmann::json machine_json(const Machine& m) {
  const HostInfo& host = m.host;
  const DeviceInfo& device = m.device;
  nlohmann::json gpus = nlohmann::json::array();
  if (!m.sim) {
    gpus.push_back({{"name", device.name},
                    {"memory_bytes", device.budget_bytes},
                    {"h2d_gib_s", gib(m.rates.h2d_bytes_per_s)},
                    {"d2h_gib_s", gib(m.rates.d2h_bytes_per_s)}});
  }
  const std::optional<NvmeInfo>& nvme = m.nvme;
  return {
      {"cores", host.cores},
      {"numa_nodes", host.numa_nodes},
      {"ram_bytes", host.ram_bytes},
      {"memlock_bytes",
       host.memlock_bytes == UINT64_MAX ? nlohmann::json(nullptr) : nlohmann::json(host.memlock_bytes)},
      {"topology", host.topology},
      {"gpus", gpus},
      {"device",
       {{"kind", device.kind},
        {"name", device.name},
        {"why", device.why},
        {"budget_bytes", device.budget_bytes},
        {"h2d_gib_s", gib(m.rates.h2d_bytes_per_s)},
        {"d2h_gib_s", gib(m.rates.d2h_bytes_per_s)},
        {"throttled", device.throttled}}},
      {"nvme",
       nvme ? nlohmann::json{{"path", nvme->path},
                             {"engine", nvme->engine},
                             {"direct_io", nvme->direct_io},
                             {"free_bytes", nvme->free_bytes},
                             {"bytes_tested", nvme->bytes_tested},
                             {"read_gib_s", gib(m.rates.disk_read_bytes_per_s)},
                             {"write_gib_s", gib(m.rates.disk_write_bytes_per_s)},
                             {"mixed_gib_s", gib(m.rates.disk_mixed_bytes_per_s)},
                             {"mixed_family_bytes",
                              static_cast<std::uint64_t>(m.rates.disk_mixed_family_bytes)},
                             {"cpu_s_per_gib", m.rates.disk_cpu_seconds_per_byte * static_cast<double>(kGiB)}}
            : nlohmann::json(nullptr)},
      {"cpu_optimizer_mparams_per_s", m.rates.cpu_optim_params_per_s / 1e6},
      {"cpu_optimizer_threads", m.threads},
      {"host_memory_gib_s", m.rates.host_memory_bytes_per_s / static_cast<double>(kGiB)},
  };
}

nlohmann::json model_json(const Settings& s, const Planned& p) {
  return {{"params", p.model_params},
          {"layers", p.spec.shape.layers},
          {"hidden", p.spec.shape.hidden},
          {"seq", p.spec.shape.seq},
          {"batch", p.spec.shape.batch},
          {"vocab", p.spec.shape.vocab},
          {"optimizer", s.optimizer},
          {"precision", s.precision},
          {"state_dtype", s.state_dtype},
          {"device_tflops_assumed", s.tflops},
          {"state_bytes_per_param", state_bytes_per_param(p.spec)}};
}

nlohmann::json data_parallel_json(const Settings& s, const Planned& p) {
  return {
      {"ranks", s.ranks},
      {"ranks_per_node", p.ranks_per_node},
      {"node_host_bytes", p.node_cap.host_bytes},
      {"node_nvme_bytes", p.node_cap.nvme_bytes},
      {"host_bytes_per_rank", p.cap.host_bytes},
      {"nvme_bytes_per_rank", p.cap.nvme_bytes},
      {"gpu_bytes_per_rank", p.cap.gpu_bytes},
      {"state_bytes_per_rank", p.rank_bytes},
      {"state_bytes_single_rank", p.single_bytes},
      {"note",
       "capacity and placements are per rank: each rank keeps its 1/ranks shard of every family's masters "
       "and optimizer states and whole params and gradients; the ranks_per_node ranks share this node's "
       "host RAM and NVMe, each has its own GPU"}};
}

//! A predicted step's terms (seconds of each resource's busy time, and its bytes), to
//! set against a run's own (bench/torch_scale.py reports its disk bytes a step).
nlohmann::json cost_terms_json(const runtime::StepCost& c) {
  return {{"compute_s", c.compute_s},
          {"h2d_s", c.h2d_s},
          {"d2h_s", c.d2h_s},
          {"disk_read_s", c.disk_read_s},
          {"disk_write_s", c.disk_write_s},
          {"disk_s", c.disk_s},
          {"cpu_optim_s", c.cpu_optim_s},
          {"host_memory_s", c.host_memory_s},
          {"host_cpu_s", c.host_cpu_s},
          {"host_cpu_device_s", c.host_cpu_device_s},
          {"host_cpu_copy_s", c.host_cpu_copy_s},
          {"host_cpu_disk_s", c.host_cpu_disk_s},
          {"bound_s", c.bound_s},
          {"tail_s", c.tail_s},
          {"bytes_h2d", c.bytes_h2d},
          {"bytes_d2h", c.bytes_d2h},
          {"bytes_disk_read", c.bytes_disk_read},
          {"bytes_disk_write", c.bytes_disk_write}};
}

nlohmann::json placements_json(const Planned& p) {
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t i = 0; i < p.rows.size(); ++i) {
    const Estimate& e = p.rows[i];
    const std::optional<runtime::StepCost>& yours = p.yours[i];
    nlohmann::json row = {
        {"name", placement_name(e.placement)},
        {"feasible", e.feasible},
        {"max_params", e.max_params},
        {"max_params_is_lower_bound", e.capped},
        {"layers", e.layers},
        {"predicted_step_s", e.feasible ? nlohmann::json(e.cost.step_s) : nlohmann::json(nullptr)},
        {"fits_model", yours.has_value()},
        {"model_step_s", yours ? nlohmann::json(yours->step_s) : nlohmann::json(nullptr)},
        {"model_bottleneck", yours ? nlohmann::json(yours->bottleneck) : nlohmann::json(nullptr)},
        {"model_terms", yours ? cost_terms_json(*yours) : nlohmann::json(nullptr)}};
    if (e.feasible) {
      row["bottleneck"] = e.cost.bottleneck;
      row["plan"] = e.plan.summary();
      std::uint64_t homes[3] = {0, 0, 0};  // families whose param lives on gpu / host / nvme
      for (const runtime::FamilyPlan& f : e.plan.families) ++homes[static_cast<int>(f.param_home)];
      row["param_home_families"] = {{"gpu", homes[0]}, {"host", homes[1]}, {"nvme", homes[2]}};
    } else {
      row["reason"] = e.reason;
      row["why"] = e.why;
    }
    if (e.placement == Placement::kAllNvme) row["note"] = kAllNvmeNote;
    rows.push_back(row);
  }
  return rows;
}

nlohmann::json needs_json(const Planned& p) {
  nlohmann::json rows = nlohmann::json::array();
  for (const Need& n : p.needs) {
    nlohmann::json row = {{"name", placement_name(n.placement)}};
    if (n.budgets.ok()) {
      row["gpu_bytes"] = n.budgets->gpu_bytes;
      row["host_bytes"] = n.budgets->host_bytes;
      row["nvme_bytes"] = n.budgets->nvme_bytes;
    } else {
      row["why"] = n.budgets.status().message();
    }
    rows.push_back(row);
  }
  return rows;
}

nlohmann::json verify_json(const Verified& verified) {
  const VerifyResult& v = *verified.result;
  nlohmann::json j = {{"placement", placement_name(verified.options.placement)},
                      {"params", v.params},
                      {"device", "sim (Note [Verify on the sim device])"},
                      {"plan", v.plan},
                      {"plan_matches", v.plan_matches},
                      {"predicted_step_s", v.predicted_s},
                      {"runtime_predicted_step_s", v.runtime_predicted_s},
                      {"measured_step_s", v.measured_s},
                      {"ratio", v.ratio},
                      {"within_25_percent", v.ratio > 1 - kVerifyTolerance && v.ratio < 1 + kVerifyTolerance},
                      {"passed", v.passed()},
                      {"budgets_held", v.budgets_held},
                      {"gpu_budget_bytes", v.budgets.gpu_bytes},
                      {"gpu_chunk_budget_bytes", v.gpu_chunk_budget_bytes},
                      {"gpu_high_water_bytes", v.gpu_high_water_bytes},
                      {"host_budget_bytes", v.host_budget_bytes},
                      {"host_high_water_bytes", v.host_high_water_bytes},
                      {"nvme_budget_bytes", v.budgets.nvme_bytes},
                      {"nvme_bytes", v.nvme_bytes},
                      {"tokens", v.tokens},
                      {"compute_gflops_measured", v.compute_flops_per_s / 1e9}};
  nlohmann::json terms = nlohmann::json::array();
  for (const VerifyTerm& t : verify_terms(v)) {
    terms.push_back({{"name", t.name},
                     {"predicted_s", t.predicted_s},
                     {"measured_busy_s", t.measured_s},
                     {"predicted_bytes", t.predicted_bytes},
                     {"measured_bytes", t.measured_bytes}});
  }
  j["terms"] = terms;
  return j;
}

void print_machine(const Flags& f, const Machine& m, const Planned& p) {
  const DeviceInfo& device = m.device;
  fmt::print("strata-probe — this machine\n");
  fmt::print("  host      {}; memlock {}\n",
             host_line(m.host, p.node_cap.host_bytes,
                       f.host_budget ? HostCapacitySource::kHostBudget : HostCapacitySource::kRamShare),
             m.host.memlock_bytes == UINT64_MAX ? "unlimited" : format_bytes(m.host.memlock_bytes));
  if (m.sim) {
    fmt::print("  GPU       none: {}\n", device.why);
    fmt::print(
        "            placements below are for the sim device: budget {}, copies {} at {:.1f} GiB/s h2d, "
        "{:.1f} GiB/s d2h\n",
        format_bytes(device.budget_bytes), device.throttled ? "throttled" : "memcpy",
        gib(m.rates.h2d_bytes_per_s), gib(m.rates.d2h_bytes_per_s));
  } else {
    fmt::print(
        "  GPU       {}: h2d {:.1f} GiB/s, d2h {:.1f} GiB/s (measured); optimizer rate assumed {:.0f} "
        "Gparams/s\n",
        device.name, gib(m.rates.h2d_bytes_per_s), gib(m.rates.d2h_bytes_per_s),
        p.rates.gpu_optim_params_per_s / 1e9);
  }
  if (m.nvme) {
    const NvmeInfo& nvme = *m.nvme;
    fmt::print(
        "  NVMe      {}: write {:.2f} GiB/s, read {:.2f} GiB/s ({} through SwapStore, {}, {}); {} free\n",
        nvme.path, gib(m.rates.disk_write_bytes_per_s), gib(m.rates.disk_read_bytes_per_s),
        format_bytes(nvme.bytes_tested), nvme.engine, nvme.direct_io ? "O_DIRECT" : "buffered",
        format_bytes(nvme.free_bytes));
    fmt::print("            {:.2f} s of CPU a GiB moved (checksums, I/O engine, kernel)\n",
               m.rates.disk_cpu_seconds_per_byte * static_cast<double>(kGiB));
  } else {
    fmt::print("  NVMe      not measured (give --nvme DIR)\n");
  }
  fmt::print("  CPU opt   {:.0f} Mparams/s ({} AdamW, {} threads)\n", m.rates.cpu_optim_params_per_s / 1e6,
             p.spec.state_dtype == kernels::DType::kQ8 ? "q8-state" : "fp32", m.threads);
  fmt::print("  memory    {:.1f} GiB/s of host memory traffic (parallel copy, read + write)\n",
             m.rates.host_memory_bytes_per_s / static_cast<double>(kGiB));
}

void print_placements(const Settings& s, const Planned& p) {
  const TrainSpec& spec = p.spec;
  fmt::print(
      "\nModel: GPT-like, hidden {}, seq {}, batch {}, vocab {}; {} {} (states {}), {:.4g} B of state a "
      "param; device compute assumed {:.3g} TFLOP/s\n",
      spec.shape.hidden, spec.shape.seq, spec.shape.batch, spec.shape.vocab, s.optimizer, s.precision,
      s.state_dtype, state_bytes_per_param(spec), s.tflops);
  fmt::print("Your model: {} params ({} layers). Capacity: gpu {}, host {}, nvme {}\n\n",
             format_count(p.model_params), spec.shape.layers, format_bytes(p.cap.gpu_bytes),
             format_bytes(p.cap.host_bytes), p.cap.nvme_bytes ? format_bytes(p.cap.nvme_bytes) : "none");
  if (s.ranks > 1) {
    fmt::print(
        "Data parallel: {} ranks, {} on this node sharing its host and NVMe: capacity and placements are "
        "per "
        "rank; each rank keeps {} of masters and optimizer states (one rank alone: {})\n\n",
        s.ranks, p.ranks_per_node, format_bytes(p.rank_bytes), format_bytes(p.single_bytes));
  }
  fmt::print("{:<20}{:>12}{:>9}{:>14}  {:<14}{}\n", "placement", "max params", "layers", "step (pred.)",
             "bottleneck", "your model's step (pred.)");
  for (std::size_t i = 0; i < p.rows.size(); ++i) {
    const Estimate& e = p.rows[i];
    if (!e.feasible) {
      fmt::print("{:<20}{:>12}{:>9}{:>14}  {}\n", placement_name(e.placement), "-", "-", "-", e.reason);
      continue;
    }
    const std::optional<runtime::StepCost>& yours = p.yours[i];
    fmt::print("{:<20}{:>12}{:>9}{:>14}  {:<14}{}\n", placement_name(e.placement),
               (e.capped ? ">= " : "") + format_count(e.max_params), e.layers,
               fmt::format("{:.3f} s", e.cost.step_s), e.cost.bottleneck,
               yours ? fmt::format("{:.3f} s ({})", yours->step_s, yours->bottleneck) : "does not fit");
  }
  fmt::print("(all-nvme: {})\n", kAllNvmeNote);
  if (const std::optional<Placement> best = fastest_for_model(p)) {
    const runtime::StepCost& c = *p.yours[static_cast<std::size_t>(*best)];
    fmt::print("Your model trains fastest with {}: {:.3f} s a step (predicted; bound by {})\n",
               placement_name(*best), c.step_s, c.bottleneck);
  } else {
    fmt::print("Your model fits no placement with these budgets (--needs: the least budgets each needs)\n");
  }
  if (s.verbose) {
    fmt::print("\nPer placement (--verbose):\n");
    for (const Estimate& e : p.rows) {
      fmt::print("  {:<18}  {}\n", placement_name(e.placement), e.feasible ? e.plan.summary() : e.why);
    }
  } else {
    fmt::print("(--verbose: each placement's plan, or the planner's full reason)\n");
  }
}

void print_needs(const Planned& p) {
  fmt::print("\nWhat your model ({} params) needs per placement (least budgets the planner accepts):\n",
             format_count(p.model_params));
  fmt::print("{:<20}{:>12}{:>12}{:>12}\n", "placement", "gpu", "host", "nvme");
  for (const Need& n : p.needs) {
    if (!n.budgets.ok()) {
      fmt::print("{:<20}  {}\n", placement_name(n.placement), n.budgets.status().message());
      continue;
    }
    fmt::print("{:<20}{:>12}{:>12}{:>12}\n", placement_name(n.placement), format_bytes(n.budgets->gpu_bytes),
               format_bytes(n.budgets->host_bytes), format_bytes(n.budgets->nvme_bytes));
  }
}

void print_verify(const Settings& s, const Verified& verified) {
  const VerifyResult& v = *verified.result;
  fmt::print(
      "\nverify ({}, {} params, sim device): measured {:.3f} s vs predicted {:.3f} s (ratio {:.2f}, {}); "
      "runtime's own prediction {:.3f} s\n",
      placement_name(verified.options.placement), format_count(v.params), v.measured_s, v.predicted_s,
      v.ratio,
      v.ratio > 1 - kVerifyTolerance && v.ratio < 1 + kVerifyTolerance ? "within 25%" : "OUTSIDE 25%",
      v.runtime_predicted_s);
  fmt::print(
      "  compute: real products over {} tokens at the {:.1f} GFLOP/s measured before the run (Note "
      "[Verify "
      "compute]); predicted bottleneck {} ({:.3f} s) + tail {:.3f} s\n",
      v.tokens, v.compute_flops_per_s / 1e9, v.predicted_cost.bottleneck, v.predicted_cost.bound_s,
      v.predicted_cost.tail_s);
  fmt::print("  {:<14}{:>12}{:>12}{:>8}{:>14}{:>14}\n", "term", "pred. s", "busy s", "ratio", "pred. bytes",
             "bytes");
  for (const VerifyTerm& t : verify_terms(v)) {
    fmt::print("  {:<14}{:>12.3f}{:>12.3f}{:>8}{:>14}{:>14}\n", t.name, t.predicted_s, t.measured_s,
               t.predicted_s > 0 ? fmt::format("{:.2f}", t.measured_s / t.predicted_s) : "-",
               t.predicted_bytes + t.measured_bytes > 0 ? format_bytes(t.predicted_bytes) : "-",
               t.predicted_bytes + t.measured_bytes > 0 ? format_bytes(t.measured_bytes) : "-");
  }
  if (s.verbose || !v.plan_matches) {
    fmt::print("  plan: {}{}\n", v.plan, v.plan_matches ? "" : "  (NOT the placement asked for)");
  }
  fmt::print(
      "  budgets {} (high water / budget): gpu chunks {} / {} (+ {} modelled activations), host {} / {}, "
      "nvme {} / {}\n",
      v.budgets_held ? "held" : "EXCEEDED", format_bytes(v.gpu_high_water_bytes),
      format_bytes(v.gpu_chunk_budget_bytes), format_bytes(v.budgets.gpu_bytes - v.gpu_chunk_budget_bytes),
      format_bytes(v.host_high_water_bytes), format_bytes(v.host_budget_bytes), format_bytes(v.nvme_bytes),
      format_bytes(v.budgets.nvme_bytes));
}

}  // namespace

void print_json(const Settings& s, const Flags&, const Machine& m, const Planned& p, const Verified& v,
                double elapsed_s) {
  nlohmann::json j;
  j["machine"] = machine_json(m);
  j["model"] = model_json(s, p);
  j["capacity"] = {
      {"gpu_bytes", p.cap.gpu_bytes}, {"host_bytes", p.cap.host_bytes}, {"nvme_bytes", p.cap.nvme_bytes}};
  j["data_parallel"] = data_parallel_json(s, p);
  j["placements"] = placements_json(p);
  const std::optional<Placement> best = fastest_for_model(p);
  j["model"]["fastest_placement"] = best ? nlohmann::json(placement_name(*best)) : nlohmann::json(nullptr);
  j["model"]["predicted_step_s"] =
      best ? nlohmann::json(p.yours[static_cast<std::size_t>(*best)]->step_s) : nlohmann::json(nullptr);
  if (s.needs) j["needs"] = needs_json(p);
  if (v.result) j["verify"] = verify_json(v);
  j["elapsed_s"] = elapsed_s;
  std::printf("%s\n", j.dump(2).c_str());
}

void print_text(const Settings& s, const Flags& f, const Machine& m, const Planned& p, const Verified& v,
                double elapsed_s) {
  print_machine(f, m, p);
  print_placements(s, p);
  if (s.needs) print_needs(p);
  if (v.result) print_verify(s, v);
  fmt::print("\n(probe took {:.1f} s)\n", elapsed_s);
}

}  // namespace strata::probe
