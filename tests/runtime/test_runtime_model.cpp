// Model-based random test of the chunk runtime: seeded sequences of register /
// acquire / release / step / init / read operations, on small budgets that force
// eviction, write-back and NVMe, checked against a plain reference model.
//
// The optimizer is SGD with lr = 1 and integer-valued params and gradients, so
// every update (p - 1 * g) is exact and the reference can predict every element.
// Compute is bf16, so the fp32 master lives with the optimizer states (host or
// NVMe) and the bf16 param is the master rounded: exact for these integers.
// Contents seen through device leases are checked by a kernel on the compute
// stream (that is when the data is valid), host leases directly.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <tuple>

#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/layout.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

namespace fs = std::filesystem;

struct Reference {
  std::vector<std::vector<float>> param;
  std::vector<std::vector<float>> grad;  // accumulated this step
  std::vector<bool> grad_written;
  std::vector<bool> frozen;
};

struct Held {
  Lease lease;
  TensorId tensor;
  StateKind kind;
  Access access;
  Where where;
};

// (seed, NVMe-homed params: a host budget that holds the staging and not the params)
class RuntimeModel : public ::testing::TestWithParam<std::tuple<std::uint64_t, bool>> {};

TEST_P(RuntimeModel, RandomOperationsMatchReference) {
  const auto [seed, nvme_params] = GetParam();
  SCOPED_TRACE(
      fmt::format("seed {} nvme_params {} (rerun with --gtest_filter='*RuntimeModel*')", seed, nvme_params));
  std::mt19937_64 rng(seed);
  const fs::path dir = fs::temp_directory_path() / fmt::format("strata-model-{}-{}", ::getpid(), seed);
  fs::create_directories(dir);

  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = 64 * kMiB;
  auto device = memory::make_device(dopt);
  ASSERT_TRUE(device.ok());

  constexpr std::size_t kTensors = 24;
  constexpr std::uint64_t kChunkElems = 8192;
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kSgd;
  o.compute_dtype = DType::kBF16;
  o.hyper.lr = 1.0f;
  o.threads = 2;
  // The model is drawn first: the host budget counts its gradients (below).
  std::vector<std::uint64_t> numels;
  std::vector<bool> frozen_drawn;
  for (std::size_t t = 0; t < kTensors; ++t) {
    numels.push_back(1 + rng() % 3000);
    frozen_drawn.push_back(rng() % 8 == 0);
  }
  std::vector<TensorId> order(kTensors);
  std::iota(order.begin(), order.end(), TensorId{0});
  o.layout.chunk_elems = kChunkElems;
  auto drawn_layout = build_layout(numels, order, o.layout);
  ASSERT_TRUE(drawn_layout.ok()) << drawn_layout.status();
  const std::uint64_t families = drawn_layout->families.size();
  // Small budgets: 5 GPU slots, host for about half of the states, the rest on NVMe.
  // Host (Note [Host room]): a landing slot (16 KiB), every gradient (16 KiB per
  // family: the plan counts them all, below), one NVMe chunk's copy (a 32 KiB
  // master), and 144 KiB for homes (masters 32 KiB, params 16 KiB per family: 4
  // families need 192 KiB).
  const std::uint64_t rooms = (16 + 16 * families + 32) * kKiB;
  o.budgets = {.gpu_bytes = 5 * kChunkElems * 2, .host_bytes = rooms + 144 * kKiB, .nvme_bytes = 16 * kMiB};
  o.plan.prefetch_depth_max = 2;
  o.plan.nvme_families_in_flight = 1;
  // The ops below accumulate over micro-batches (begin_micro_batch(false)), and
  // random access orders evict half-written gradients to host: plan for micro-batches
  // from the start, so the plan counts every gradient's host copy and the re-plan at the
  // first begin_micro_batch(false) keeps the placement.
  o.plan.micro_batches = 2;
  o.plan.grad_staging_slots = 1;
  if (nvme_params) {
    // The rooms + 4 param staging buffers of 16 KiB (prefetch depth 2 + 2) + one NVMe
    // family in flight (32 KiB master, SGD without momentum keeps no state, 16 KiB
    // param): with 5 families or more no room is left for every param's home beside the
    // staging (Note [NVMe param staging]).
    o.budgets.host_bytes = rooms + (64 + 48) * kKiB;
  }
  o.hyper.momentum = 0.0f;
  o.nvme_dirs = {dir.string()};
  auto created = Runtime::create(**device, o);
  ASSERT_TRUE(created.ok()) << created.status();
  Runtime& rt = **created;

  Reference ref;
  for (std::size_t t = 0; t < kTensors; ++t) {
    const auto n = static_cast<std::int64_t>(numels[t]);
    const bool frozen = frozen_drawn[t];
    ASSERT_TRUE(rt.register_tensor({fmt::format("t{}", t), {n}, DType::kBF16, frozen}).ok());
    ref.param.emplace_back(static_cast<std::size_t>(n));
    ref.grad.emplace_back(static_cast<std::size_t>(n), 0.0f);
    ref.grad_written.push_back(false);
    ref.frozen.push_back(frozen);
  }
  for (std::size_t t = 0; t < kTensors; ++t) {
    for (auto& v : ref.param[t]) v = static_cast<float>(static_cast<int>(rng() % 201) - 100);
    ASSERT_TRUE(rt.init_tensor(static_cast<TensorId>(t), ref.param[t]).ok());
  }

  // Families, for Note [Gradient completion]: a family's update happens as soon
  // as all its trainable tensors' gradients were handed over in the last
  // micro-batch and no lease holds its gradient or param.
  const ChunkLayout& layout = rt.layout();
  ASSERT_EQ(layout.families.size(), families) << "the runtime packs as build_layout did";
  std::vector<bool> param_nvme(layout.families.size(), false);
  for (FamilyId f = 0; f < layout.families.size(); ++f)
    param_nvme[f] = rt.plan().families[f].param_home == Tier::kNvme;
  // With 4 families or fewer the staging costs as much as the params: they stay on host.
  EXPECT_EQ(std::count(param_nvme.begin(), param_nvme.end(), true) > 0,
            nvme_params && layout.families.size() > 4)
      << rt.plan().summary();
  std::vector<std::vector<TensorId>> family_tensors(layout.families.size());
  for (TensorId t = 0; t < kTensors; ++t) family_tensors[layout.slots[t].family].push_back(t);
  std::vector<bool> written_in_micro(kTensors, false);
  bool last_micro = true;
  std::vector<Held> held;
  auto apply = [&](TensorId k) {
    if (ref.grad_written[k] && !ref.frozen[k]) {
      for (std::size_t i = 0; i < ref.param[k].size(); ++i) ref.param[k][i] -= ref.grad[k][i];
    }
    ref.grad_written[k] = false;
  };
  auto maybe_complete = [&](FamilyId f) {
    if (!last_micro) return;
    std::size_t trainable = 0, written = 0;
    for (TensorId k : family_tensors[f]) {
      trainable += ref.frozen[k] ? 0 : 1;
      written += !ref.frozen[k] && written_in_micro[k] ? 1 : 0;
    }
    if (written == 0 || written != trainable) return;
    for (const Held& h : held) {
      if (layout.slots[h.tensor].family == f &&
          ((h.kind == StateKind::kGrad && h.access != Access::kRead) || h.kind == StateKind::kParam)) {
        return;
      }
    }
    bool pending = false;
    for (TensorId k : family_tensors[f]) pending = pending || ref.grad_written[k];
    if (!pending) return;
    for (TensorId k : family_tensors[f]) apply(k);
  };
  std::atomic<std::uint64_t> mismatches{0};
  std::uint64_t ops = 0, steps = 0, device_checks = 0, refused = 0;
  auto bf16 = [](const std::vector<float>& v) {
    std::vector<std::uint16_t> out(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) out[i] = kernels::float_to_bf16(v[i]);
    return out;
  };
  auto check_device = [&](const std::uint16_t* p, std::vector<std::uint16_t> expect) {
    ++device_checks;
    ASSERT_TRUE(rt.launch([p, expect = std::move(expect), &mismatches] {
                    for (std::size_t i = 0; i < expect.size(); ++i) {
                      if (p[i] != expect[i]) {
                        mismatches.fetch_add(1);
                        return;
                      }
                    }
                  }).ok());
  };

  constexpr std::uint64_t kOps = 10000;
  const char* watch_env = std::getenv("STRATA_MODEL_WATCH");
  const long watch = watch_env ? std::atol(watch_env) : -1;
  while (ops < kOps) {
    rt.check_invariants();  // after every operation (Note [Chunk state machine])
    ++ops;
    const int op = static_cast<int>(rng() % 100);
    const auto t = static_cast<TensorId>(rng() % kTensors);
    if (watch >= 0 && layout.slots[t].family == layout.slots[static_cast<TensorId>(watch)].family) {
      std::fprintf(stderr,
                   "op %lu kind %d tensor %u (fam %u) ref0 %g grad_written %d wim %d last %d held %zu\n",
                   static_cast<unsigned long>(ops), op, t, layout.slots[t].family, ref.param[watch][0],
                   static_cast<int>(ref.grad_written[t]), static_cast<int>(written_in_micro[t]),
                   static_cast<int>(last_micro), held.size());
    }
    if (op < 35 && held.size() < 4) {
      // Read a param, on the device (mostly) or the host.
      const Where where = rng() % 5 == 0 ? Where::kHost : Where::kDevice;
      auto lease = rt.acquire(t, StateKind::kParam, Access::kRead, where);
      if (where == Where::kHost && param_nvme[layout.slots[t].family]) {
        // NVMe-homed params have no host copy to lease (Note [NVMe-homed params]).
        ASSERT_EQ(lease.status().code(), StatusCode::kFailedPrecondition) << "op " << ops;
        ++refused;
        continue;
      }
      ASSERT_TRUE(lease.ok()) << "op " << ops << ": " << lease.status();
      Held h{std::move(lease).value(), t, StateKind::kParam, Access::kRead, where};
      if (where == Where::kDevice) {
        check_device(h.lease.as<std::uint16_t>(), bf16(ref.param[t]));
      } else {
        const auto expect = bf16(ref.param[t]);
        const auto* got = static_cast<const std::uint16_t*>(h.lease.data());
        std::size_t bad = 0;
        while (bad < expect.size() && got[bad] == expect[bad]) ++bad;
        ASSERT_EQ(bad, expect.size())
            << "op " << ops << ": tensor " << t << " element " << bad << " is "
            << kernels::bf16_to_float(got[bad]) << ", expected " << kernels::bf16_to_float(expect[bad]);
      }
      held.push_back(std::move(h));
    } else if (op < 60 && held.size() < 4) {
      // Hand over (write or accumulate) a gradient on the device.
      bool leased_for_write = false;
      for (const Held& h : held)
        leased_for_write = leased_for_write || (h.tensor == t && h.access != Access::kRead);
      const Access access = ref.grad_written[t] && rng() % 2 == 0 ? Access::kAccumulate : Access::kWrite;
      auto lease = rt.acquire(t, StateKind::kGrad, access);
      if (ref.frozen[t] || leased_for_write || written_in_micro[t]) {
        ASSERT_EQ(lease.status().code(), StatusCode::kFailedPrecondition) << "op " << ops;
        ++refused;
        continue;
      }
      ASSERT_TRUE(lease.ok()) << "op " << ops << ": " << lease.status();
      std::vector<float> add(ref.param[t].size());
      for (auto& v : add) v = static_cast<float>(static_cast<int>(rng() % 9) - 4);
      auto* g = lease->as<std::uint16_t>();
      if (access == Access::kAccumulate) check_device(g, bf16(ref.grad[t]));
      ASSERT_TRUE(rt.launch([g, add, access] {
                      for (std::size_t i = 0; i < add.size(); ++i) {
                        const float old = access == Access::kWrite ? 0.0f : kernels::bf16_to_float(g[i]);
                        g[i] = kernels::float_to_bf16(old + add[i]);
                      }
                    }).ok());
      for (std::size_t i = 0; i < add.size(); ++i) {
        ref.grad[t][i] = (access == Access::kWrite ? 0.0f : ref.grad[t][i]) + add[i];
      }
      held.push_back({std::move(lease).value(), t, StateKind::kGrad, access, Where::kDevice});
    } else if (op < 85 && !held.empty()) {
      const std::size_t i = rng() % held.size();
      Held h = std::move(held[i]);
      held.erase(held.begin() + static_cast<long>(i));
      h.lease.release();
      if (h.kind == StateKind::kGrad) {
        ref.grad_written[h.tensor] = true;
        written_in_micro[h.tensor] = true;
      }
      maybe_complete(layout.slots[h.tensor].family);
    } else if (op < 88 && held.empty()) {
      last_micro = rng() % 2 == 0;
      ASSERT_TRUE(rt.begin_micro_batch(last_micro).ok());
      std::fill(written_in_micro.begin(), written_in_micro.end(), false);
    } else if (op < 95) {
      // Step: release everything first (step() refuses held leases).
      if (!held.empty()) {
        EXPECT_EQ(rt.step().status().code(), StatusCode::kFailedPrecondition);
        while (!held.empty()) {
          Held h = std::move(held.back());
          held.pop_back();
          h.lease.release();
          if (h.kind == StateKind::kGrad) {
            ref.grad_written[h.tensor] = true;
            written_in_micro[h.tensor] = true;
          }
          maybe_complete(layout.slots[h.tensor].family);
        }
      }
      auto stats = rt.step();
      ASSERT_TRUE(stats.ok()) << "op " << ops << ": " << stats.status();
      ++steps;
      for (TensorId k = 0; k < kTensors; ++k) apply(k);
      std::fill(written_in_micro.begin(), written_in_micro.end(), false);
      EXPECT_LE(stats->gpu_high_water_bytes, o.budgets.gpu_bytes);
      EXPECT_LE(stats->host_high_water_bytes, o.budgets.host_bytes);
    } else if (held.empty()) {
      // Between steps: read back a param (and sometimes re-initialise it).
      std::vector<float> out(ref.param[t].size());
      ASSERT_TRUE(rt.read_tensor(t, StateKind::kMaster, out).ok());
      ASSERT_EQ(out, ref.param[t]) << "op " << ops;
      if (rng() % 4 == 0 && !ref.grad_written[t]) {
        for (auto& v : ref.param[t]) v = static_cast<float>(static_cast<int>(rng() % 101) - 50);
        ASSERT_TRUE(rt.init_tensor(t, ref.param[t]).ok());
      }
    }
  }
  held.clear();
  ASSERT_TRUE(rt.step().ok());
  ASSERT_TRUE(device->get()->synchronize().ok());
  EXPECT_EQ(mismatches.load(), 0u) << device_checks << " device checks";
  EXPECT_GT(steps, 100u);
  EXPECT_GT(refused, 10u);
  EXPECT_GT(rt.timeline().stats(Track::kDiskRead).bytes, 0u) << "the budgets should force NVMe";
  EXPECT_GT(device_checks, 1000u);
  created->reset();
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Seeds, RuntimeModel,
                         ::testing::Combine(::testing::Values(1u, 2u, 3u, 4u, 5u, 6u), ::testing::Bool()),
                         [](const auto& p) {
                           return fmt::format("seed{}{}", std::get<0>(p.param),
                                              std::get<1>(p.param) ? "_NvmeParams" : "");
                         });

}  // namespace
}  // namespace strata::runtime
