// 8-bit optimizer states in the chunk runtime (state_dtype q8, Note [Q8 state
// chunks] in runtime/src/pipeline/q8_states.cpp): several AdamW steps equal a
// direct kernels::step_q8 over each tensor alone, from zero bytes, bit for bit —
// with states on the (sim) GPU, on host and on NVMe, fp32 and bf16 compute, one
// thread and three; the refusals of what the runtime does not serve; checkpoints
// of q8 states, and their conversion from and to fp32 states.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "sim_device.hpp"
#include "strata/comm/local.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/scratch_dir.hpp"
#include "strata/kernels/q8.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime {
namespace {

using testing::sim_device;

// One oversized family (more than one kernel piece, so threads split it), one
// family of five tensors at offsets 0, 1024, 1536, 2048 and 2304 (256-aligned),
// and 64 of one tensor each: their states outweigh the NVMe pipeline's host room
// (Note [Host room]: the largest family's states and param, and a deferred update's
// gradient), so a small host budget puts some of them on NVMe.
std::vector<std::size_t> sizes() {
  std::vector<std::size_t> s = {kernels::kPieceElems + 4464, 1000, 300, 257, 1, 4100};
  for (std::size_t k = 0; k < 64; ++k) s.push_back(8000 - 13 * k);
  return s;
}
const std::vector<std::size_t> kSizes = sizes();
constexpr std::uint64_t kChunkElems = 8192;
constexpr int kSteps = 4;

enum class Place { kGpu, kHost, kNvme };

struct Case {
  Place place;
  DType compute;
  std::size_t threads;
  std::uint32_t deferred = 0;  //!< plan.deferred_updates (Note [Deferred updates])
};

std::string case_name(const ::testing::TestParamInfo<Case>& i) {
  const char* place = i.param.place == Place::kGpu ? "gpu" : i.param.place == Place::kHost ? "host" : "nvme";
  return fmt::format("{}_{}_threads{}{}", place, dtype_name(i.param.compute), i.param.threads,
                     i.param.deferred > 0 ? "_deferred" : "");
}

RuntimeOptions options(const Case& c, std::uint64_t host_bytes, const std::filesystem::path& nvme,
                       DType states = DType::kQ8) {
  RuntimeOptions o;
  o.compute_dtype = c.compute;
  o.state_dtype = states;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-2f;
  o.hyper.weight_decay = 0.01f;
  o.layout.chunk_elems = kChunkElems;
  o.threads = c.threads;
  o.budgets = {.gpu_bytes = 64 * kMiB, .host_bytes = host_bytes};
  o.plan.allow_gpu_optimizer = c.place == Place::kGpu;
  o.plan.deferred_updates = c.deferred;
  if (c.place == Place::kNvme) {
    o.budgets.gpu_bytes = 2 * kMiB;
    o.budgets.nvme_bytes = 64 * kMiB;
    o.nvme_dirs = {nvme.string()};
    o.plan.nvme_families_in_flight = 1;
    o.plan.grad_staging_slots = 1;
    o.plan.allow_nvme_params = false;
  }
  return o;
}

//! A directory of this process's own: ctest runs the cases side by side.
Result<ScratchDir> scratch(std::string_view name) {
  return ScratchDir::create(std::filesystem::temp_directory_path(), fmt::format("{}-{}", name, ::getpid()));
}

float grad_value(std::size_t t, std::size_t i, int step) {
  return 0.013f * static_cast<float>((i * 7 + t * 5 + static_cast<std::size_t>(step) * 3) % 29) - 0.17f;
}

float init_value(std::size_t t, std::size_t i) {
  return 0.05f * static_cast<float>((i + 3 * t) % 23) - 0.5f;
}

//! The value the runtime's compute dtype holds for x (what a gradient write stores).
float rounded(DType d, float x) {
  return d == DType::kBF16 ? kernels::bf16_to_float(kernels::float_to_bf16(x)) : x;
}

struct Trained {
  std::unique_ptr<memory::Device> device;
  std::unique_ptr<Runtime> rt;
  std::vector<TensorId> ids;
  std::uint64_t updates_deferred = 0;  //!< summed over the steps
};

//! A runtime with the tensors registered and initialised, or the status that refused it.
Result<Trained> make(const Case& c, std::uint64_t host_bytes, const std::filesystem::path& nvme,
                     DType states = DType::kQ8, const std::function<void(RuntimeOptions&)>& edit = {}) {
  Trained m{.device = sim_device()};
  RuntimeOptions o = options(c, host_bytes, nvme, states);
  if (edit) edit(o);
  STRATA_ASSIGN_OR_RETURN(m.rt, Runtime::create(*m.device, o));
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    STRATA_ASSIGN_OR_RETURN(
        TensorId id, m.rt->register_tensor(fmt::format("t{}", t), {static_cast<std::int64_t>(kSizes[t])}));
    m.ids.push_back(id);
  }
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    std::vector<float> v(kSizes[t]);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = init_value(t, i);
    STRATA_RETURN_IF_ERROR(m.rt->init_tensor(m.ids[t], v));
  }
  return m;
}

Tier optim_home(const Runtime& rt, TensorId t) {
  return rt.plan().families[rt.layout().slots[t].family].optim_home;
}

//! NVMe: the smallest host budget (in 64 KiB steps) that plans; the states that do
//! not fit on host then live on NVMe.
Result<Trained> make_placed(const Case& c, const std::filesystem::path& nvme) {
  if (c.place != Place::kNvme) return make(c, 64 * kMiB, nvme);
  Status last = Status::Ok();
  for (std::uint64_t host = 256 * kKiB; host <= 16 * kMiB; host += 64 * kKiB) {
    Result<Trained> m = make(c, host, nvme);
    if (m.ok()) return m;
    last = m.status();
  }
  return last;
}

//! One step's gradients and step(); with `nan`, tensor 3's last gradient is NaN.
//! Whether the step was applied.
Result<bool> run_step(Trained& m, DType compute, int step, bool nan) {
  for (std::size_t t = 0; t < m.ids.size(); ++t) {
    STRATA_ASSIGN_OR_RETURN(Lease p, m.rt->acquire(m.ids[t], StateKind::kParam, Access::kRead));
    STRATA_ASSIGN_OR_RETURN(Lease g, m.rt->acquire(m.ids[t], StateKind::kGrad, Access::kWrite));
    void* G = g.data();
    const std::size_t n = kSizes[t];
    const bool poison = nan && t == 3;
    STRATA_RETURN_IF_ERROR(m.rt->launch([G, n, t, step, compute, poison] {
      for (std::size_t i = 0; i < n; ++i) {
        const float x =
            poison && i + 1 == n ? std::numeric_limits<float>::quiet_NaN() : grad_value(t, i, step);
        if (compute == DType::kBF16) {
          static_cast<std::uint16_t*>(G)[i] = kernels::float_to_bf16(x);
        } else {
          static_cast<float*>(G)[i] = x;
        }
      }
    }));
  }
  STRATA_ASSIGN_OR_RETURN(StepStats st, m.rt->step());
  m.updates_deferred += st.updates_deferred;
  return st.applied;
}

Status train_step(Trained& m, DType compute, int step) {
  STRATA_ASSIGN_OR_RETURN(const bool applied, run_step(m, compute, step, false));
  if (!applied) return failed_precondition("step {} was not applied", step);
  return Status::Ok();
}

//! The reference: each tensor alone through kernels::step_q8, from zero bytes.
struct Reference {
  std::vector<std::vector<float>> master;
  std::vector<std::vector<std::uint8_t>> m_codes, v_codes;
  std::vector<std::vector<float>> m_scales, v_scales;

  void run(const kernels::Hyper& hyper, DType compute) {
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      master.emplace_back(kSizes[t]);  // the fp32 values init_tensor was given
      for (std::size_t i = 0; i < kSizes[t]; ++i) master[t][i] = init_value(t, i);
      m_codes.emplace_back(kSizes[t], 0);
      v_codes.emplace_back(kSizes[t], 0);
      m_scales.emplace_back(kernels::q8_blocks(kSizes[t]), 0.0f);
      v_scales.emplace_back(kernels::q8_blocks(kSizes[t]), 0.0f);
    }
    for (int s = 0; s < kSteps; ++s) {
      for (std::size_t t = 0; t < kSizes.size(); ++t) {
        std::vector<float> g(kSizes[t]);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = rounded(compute, grad_value(t, i, s));
        const kernels::Q8Span span{.master = master[t].data(),
                                   .grad = g.data(),
                                   .grad_dtype = DType::kF32,
                                   .m_codes = m_codes[t].data(),
                                   .m_scales = m_scales[t].data(),
                                   .v_codes = v_codes[t].data(),
                                   .v_scales = v_scales[t].data(),
                                   .n = kSizes[t]};
        auto r = kernels::step_q8({.hyper = hyper, .step = s + 1, .spans = {&span, 1}});
        ASSERT_TRUE(r.ok()) << r.status();
        ASSERT_TRUE(r->applied);
      }
    }
  }
};

//! Every tensor's master, m and v as read_tensor gives them (q8: dequantized).
std::vector<std::vector<float>> read_states(Runtime& rt, const std::vector<TensorId>& ids) {
  std::vector<std::vector<float>> out;
  for (std::size_t t = 0; t < ids.size(); ++t) {
    for (StateKind k : {StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      std::vector<float> v(kSizes[t]);
      EXPECT_TRUE(rt.read_tensor(ids[t], k, v).ok());
      out.push_back(std::move(v));
    }
  }
  return out;
}

//! Bitwise equality of float vectors (-0.0 differs from 0.0).
bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * 4) != 0)
      return false;
  }
  return true;
}

class Q8States : public ::testing::TestWithParam<Case> {};

TEST_P(Q8States, AdamWStepsEqualTheKernelOnEachTensorAloneBitForBit) {
  const Case c = GetParam();
  auto nvme = scratch("strata-q8-states");
  ASSERT_TRUE(nvme.ok()) << nvme.status();
  auto made = make_placed(c, nvme->path());
  ASSERT_TRUE(made.ok()) << made.status();
  Trained& m = *made;
  for (std::size_t t = 0; t < m.ids.size(); ++t) {
    EXPECT_EQ(m.rt->layout().slots[m.ids[t]].offset_elems % kernels::kQ8BlockElems, 0u) << "tensor " << t;
  }
  for (int s = 0; s < kSteps; ++s) ASSERT_TRUE(train_step(m, c.compute, s).ok()) << "step " << s;
  ASSERT_TRUE(m.rt->flush().ok());
  bool on_place = false;
  const Tier want = c.place == Place::kGpu ? Tier::kGpu : c.place == Place::kHost ? Tier::kHost : Tier::kNvme;
  for (TensorId t : m.ids) on_place = on_place || optim_home(*m.rt, t) == want;
  ASSERT_TRUE(on_place) << "no family's states on " << tier_name(want) << ": " << m.rt->plan().summary();
  if (c.deferred > 0) {
    EXPECT_GT(m.updates_deferred, 0u) << "no update ran in the next forward";
  }

  Reference ref;
  ref.run(options(c, 0, {}).hyper, c.compute);
  for (std::size_t t = 0; t < m.ids.size(); ++t) {
    const std::size_t n = kSizes[t];
    std::vector<float> got(n), want_m(n), want_v(n);
    ASSERT_TRUE(m.rt->read_tensor(m.ids[t], StateKind::kMaster, got).ok());
    EXPECT_EQ(std::memcmp(got.data(), ref.master[t].data(), n * 4), 0) << "master of tensor " << t;
    kernels::q8_dequantize(ref.m_codes[t].data(), ref.m_scales[t].data(), kernels::Q8Map::kSigned, want_m);
    kernels::q8_dequantize(ref.v_codes[t].data(), ref.v_scales[t].data(), kernels::Q8Map::kUnsigned, want_v);
    ASSERT_TRUE(m.rt->read_tensor(m.ids[t], StateKind::kState0, got).ok());
    EXPECT_EQ(std::memcmp(got.data(), want_m.data(), n * 4), 0) << "m of tensor " << t;
    ASSERT_TRUE(m.rt->read_tensor(m.ids[t], StateKind::kState1, got).ok());
    EXPECT_EQ(std::memcmp(got.data(), want_v.data(), n * 4), 0) << "v of tensor " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Places, Q8States,
    ::testing::Values(Case{Place::kHost, DType::kF32, 1}, Case{Place::kHost, DType::kF32, 3},
                      Case{Place::kHost, DType::kBF16, 3}, Case{Place::kNvme, DType::kF32, 1},
                      Case{Place::kNvme, DType::kF32, 3}, Case{Place::kNvme, DType::kBF16, 3},
                      Case{Place::kNvme, DType::kF32, 3, 1}, Case{Place::kGpu, DType::kF32, 3}),
    case_name);

TEST(Q8StatesState, WriteThenReadGivesTheQuantizedValuesAndLeasesAreRefused) {
  const Case c{Place::kHost, DType::kF32, 2};
  auto made = make(c, 64 * kMiB, {});
  ASSERT_TRUE(made.ok()) << made.status();
  const std::size_t n = kSizes[3];  // 257: one whole block and one of a single element
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 1e-3f * static_cast<float>(i) - 0.1f;
  ASSERT_TRUE(made->rt->write_tensor(made->ids[3], StateKind::kState0, v).ok());
  std::vector<std::uint8_t> codes(n);
  std::vector<float> scales(kernels::q8_blocks(n)), want(n), got(n);
  ASSERT_TRUE(kernels::q8_quantize(v, kernels::Q8Map::kSigned, codes.data(), scales.data()).ok());
  kernels::q8_dequantize(codes.data(), scales.data(), kernels::Q8Map::kSigned, want);
  ASSERT_TRUE(made->rt->read_tensor(made->ids[3], StateKind::kState0, got).ok());
  EXPECT_EQ(got, want);
  EXPECT_EQ(got[n - 1], v[n - 1]) << "a one-element block is its own scale";

  for (float& x : v) x = std::fabs(x);
  ASSERT_TRUE(made->rt->write_tensor(made->ids[3], StateKind::kState1, v).ok());
  v[7] = -1.0f;  // v is unsigned
  Status st = made->rt->write_tensor(made->ids[3], StateKind::kState1, v);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("index 7"), std::string::npos) << st;

  auto lease = made->rt->acquire(made->ids[3], StateKind::kState0, Access::kRead, Where::kHost);
  ASSERT_FALSE(lease.ok());
  EXPECT_EQ(lease.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(lease.status().message().find("read_tensor/write_tensor"), std::string::npos) << lease.status();
}

// Loss scaling and clipping (Note [Step semantics]): an Inf/NaN gradient skips the
// step and leaves codes and scales as they were; clipping scales the gradients.
TEST(Q8StatesStep, ANonFiniteGradientWritesNoStateAndClippingTrains) {
  for (const bool clip : {false, true}) {
    auto made = make({Place::kHost, DType::kF32, 2}, 64 * kMiB, {}, DType::kQ8, [clip](RuntimeOptions& o) {
      o.loss_scaling = !clip;
      o.clip_max_norm = clip ? 0.5 : 0.0;
    });
    ASSERT_TRUE(made.ok()) << made.status();
    ASSERT_TRUE(train_step(*made, DType::kF32, 0).ok());
    const auto before = read_states(*made->rt, made->ids);
    auto skipped = run_step(*made, DType::kF32, 1, true);
    ASSERT_TRUE(skipped.ok()) << skipped.status();
    EXPECT_FALSE(*skipped) << "clip " << clip;
    EXPECT_TRUE(same_bits(read_states(*made->rt, made->ids), before)) << "clip " << clip;
    ASSERT_TRUE(train_step(*made, DType::kF32, 2).ok()) << "clip " << clip;
    EXPECT_FALSE(same_bits(read_states(*made->rt, made->ids), before)) << "clip " << clip;
  }
}

TEST(Q8StatesOptions, RefusedWithoutAnEightBitRuleNamingThePair) {
  for (kernels::Optimizer o : {kernels::Optimizer::kLamb, kernels::Optimizer::kSgd, kernels::Optimizer::kLion,
                               kernels::Optimizer::kLars, kernels::Optimizer::kAdagrad}) {
    RuntimeOptions ro = options({Place::kHost, DType::kF32, 1}, 64 * kMiB, {});
    ro.hyper = kernels::optimizer_defaults(o);
    auto device = sim_device();
    auto rt = Runtime::create(*device, ro);
    ASSERT_FALSE(rt.ok()) << kernels::optimizer_name(o);
    EXPECT_EQ(rt.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(rt.status().message().find(fmt::format(
                  "optimizer {} has no 8-bit state rule; use precision.states", kernels::optimizer_name(o))),
              std::string::npos)
        << rt.status();
  }
  RuntimeOptions ro = options({Place::kHost, DType::kF32, 1}, 64 * kMiB, {});
  ro.layout.chunk_elems = 4096 + 64;
  ro.layout.chunk_align_elems = 64;
  auto device = sim_device();
  auto rt = Runtime::create(*device, ro);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("whole 256-element scale blocks"), std::string::npos) << rt.status();
  // (Data parallelism is served: shards are whole scale blocks, shard_align_elems; strata.torch's
  // tests/torch/test_data_parallel.py trains q8 states at W = 2 and 4 bit-identically to one rank.)
  ro = options({Place::kHost, DType::kF32, 1}, 64 * kMiB, {});
  ro.compute_dtype = DType::kQ8;
  rt = Runtime::create(*device, ro);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("compute_dtype q8 must be fp32, bf16 or fp16"), std::string::npos)
      << rt.status();
}

std::uint64_t align_4k(std::uint64_t x) {
  return (x + 4095) / 4096 * 4096;
}

TEST(Q8StatesPlan, StateChunksAreCodesAndScalesAndThePlanCountsThem) {
  // fp32 compute: the param is the master, so the optimizer's chunks are m and v.
  auto q8 = make({Place::kHost, DType::kF32, 1}, 64 * kMiB, {});
  ASSERT_TRUE(q8.ok()) << q8.status();
  Case fp32_case{Place::kHost, DType::kF32, 1};
  RuntimeOptions o = options(fp32_case, 64 * kMiB, {});
  o.state_dtype = DType::kF32;
  auto device = sim_device();
  auto fp32 = Runtime::create(*device, o);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    ASSERT_TRUE((*fp32)->register_tensor(fmt::format("t{}", t), {static_cast<std::int64_t>(kSizes[t])}).ok());
  }
  std::vector<float> v(kSizes[0], 0.5f);
  ASSERT_TRUE((*fp32)->init_tensor(0, v).ok());  // fixes the layout

  std::uint64_t want_q8 = 0, want_fp32 = 0;
  for (const FamilyLayout& f : q8->rt->layout().families) {
    want_q8 += 2 * align_4k(f.capacity_elems + 4 * (f.capacity_elems / 256));  // codes, then scales
    want_fp32 += 2 * align_4k(f.capacity_elems * 4);
  }
  EXPECT_EQ(q8->rt->state_bytes(), want_q8);
  EXPECT_EQ((*fp32)->state_bytes(), want_fp32);
  // 1 + 4/256 bytes an element against 4; these small chunks also round to 4 KiB
  // (12 KiB of q8 against 32 KiB of fp32 for 8192 elements).
  EXPECT_LT(static_cast<double>(q8->rt->state_bytes()), 0.4 * static_cast<double>((*fp32)->state_bytes()));
}

TEST(Q8StatesPlan, NvmeBytesAreTheQuantizedChunksSlots) {
  // The swap files are preallocated for the plan's NVMe bytes (Note [Growing swap
  // files] in offload/src/swap_store.cpp), which count whole slots of the q8 chunks.
  auto dir = scratch("strata-q8-swap");
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto made = make_placed({Place::kNvme, DType::kF32, 1}, dir->path());
  ASSERT_TRUE(made.ok()) << made.status();
  const Plan& plan = made->rt->plan();
  const ChunkLayout& layout = made->rt->layout();
  auto q8_chunk = [](std::uint64_t cap) { return align_4k(cap + 4 * (cap / 256)); };
  std::uint64_t largest = 0;
  for (const FamilyLayout& f : layout.families) largest = std::max(largest, q8_chunk(f.capacity_elems));
  const std::uint64_t slot = nvme_slot_bytes(largest);
  std::uint64_t states = 0;
  for (std::size_t f = 0; f < plan.families.size(); ++f) {
    if (plan.families[f].optim_home == Tier::kNvme)
      states += 2 * nvme_chunk_bytes(q8_chunk(layout.families[f].capacity_elems), slot);
  }
  ASSERT_GT(states, 0u) << plan.summary();
  // Beside them (runtime/plan/planner.cpp): the copy-on-write slots of the one
  // family in flight (its two states) and room for one chunk write_tensor writes.
  EXPECT_GE(plan.nvme_bytes, states + 2 * slot);
  EXPECT_LE(plan.nvme_bytes, states + 4 * slot) << plan.summary();
}

// --- Checkpoints (Note [Q8 checkpoints] in runtime/checkpoint/q8_states.cpp) ---

struct CheckpointDirs {
  ScratchDir nvme_a, nvme_b, ckpt;
  static CheckpointDirs make() {
    auto dir = [](const char* name) {
      auto d = scratch(name);
      EXPECT_TRUE(d.ok()) << d.status();
      return std::move(d).value();
    };
    return {dir("strata-q8-nvme-a"), dir("strata-q8-nvme-b"), dir("strata-q8-ckpt")};
  }
};

class Q8Checkpoint : public ::testing::TestWithParam<Place> {};

TEST_P(Q8Checkpoint, SavedAsTheyAreAndLoadedBitForBit) {
  CheckpointDirs dirs = CheckpointDirs::make();
  const Case c{GetParam(), DType::kF32, 2};
  auto a = make_placed(c, dirs.nvme_a.path());
  ASSERT_TRUE(a.ok()) << a.status();
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(train_step(*a, c.compute, s).ok());
  const std::string ckpt = (dirs.ckpt.path() / "c").string();
  ASSERT_TRUE(a->rt->save_checkpoint(ckpt).ok());
  auto b = make_placed(c, dirs.nvme_b.path());
  ASSERT_TRUE(b.ok()) << b.status();
  Status loaded = b->rt->load_checkpoint(ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_TRUE(same_bits(read_states(*b->rt, b->ids), read_states(*a->rt, a->ids)));
  // And they train on alike: the codes and scales were loaded, not values requantized.
  for (Trained* m : {&*a, &*b}) ASSERT_TRUE(train_step(*m, c.compute, 2).ok());
  EXPECT_TRUE(same_bits(read_states(*b->rt, b->ids), read_states(*a->rt, a->ids)));
}

INSTANTIATE_TEST_SUITE_P(Places, Q8Checkpoint, ::testing::Values(Place::kHost, Place::kNvme),
                         [](const ::testing::TestParamInfo<Place>& i) {
                           return i.param == Place::kHost ? "host" : "nvme";
                         });

TEST(Q8CheckpointConvert, AQ8CheckpointLoadsIntoFp32StatesDequantized) {
  CheckpointDirs dirs = CheckpointDirs::make();
  const Case c{Place::kHost, DType::kF32, 2};
  auto q8 = make(c, 64 * kMiB, {});
  ASSERT_TRUE(q8.ok()) << q8.status();
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(train_step(*q8, c.compute, s).ok());
  const std::string ckpt = (dirs.ckpt.path() / "c").string();
  ASSERT_TRUE(q8->rt->save_checkpoint(ckpt).ok());
  auto fp32 = make(c, 64 * kMiB, {}, DType::kF32);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  Status loaded = fp32->rt->load_checkpoint(ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded;
  EXPECT_TRUE(same_bits(read_states(*fp32->rt, fp32->ids), read_states(*q8->rt, q8->ids)));
  EXPECT_EQ(*fp32->rt->tensor_steps(fp32->ids[0]), 2);
}

TEST(Q8CheckpointConvert, AnFp32CheckpointLoadsIntoQ8StatesQuantizedPerTensor) {
  CheckpointDirs dirs = CheckpointDirs::make();
  const Case c{Place::kHost, DType::kF32, 2};
  auto fp32 = make(c, 64 * kMiB, {}, DType::kF32);
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  for (int s = 0; s < 2; ++s) ASSERT_TRUE(train_step(*fp32, c.compute, s).ok());
  const std::string ckpt = (dirs.ckpt.path() / "c").string();
  ASSERT_TRUE(fp32->rt->save_checkpoint(ckpt).ok());
  auto q8 = make(c, 64 * kMiB, {});
  ASSERT_TRUE(q8.ok()) << q8.status();
  Status loaded = q8->rt->load_checkpoint(ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded;
  // Each state quantized alone, as q8_quantize (step_q8's requantization) does it.
  auto want = read_states(*fp32->rt, fp32->ids);
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    for (std::size_t k = 1; k < 3; ++k) {
      std::vector<float>& v = want[3 * t + k];
      std::vector<std::uint8_t> codes(v.size());
      std::vector<float> scales(kernels::q8_blocks(v.size()));
      const auto map = k == 1 ? kernels::Q8Map::kSigned : kernels::Q8Map::kUnsigned;
      ASSERT_TRUE(kernels::q8_quantize(v, map, codes.data(), scales.data()).ok());
      kernels::q8_dequantize(codes.data(), scales.data(), map, v);
    }
  }
  EXPECT_TRUE(same_bits(read_states(*q8->rt, q8->ids), want));
  ASSERT_TRUE(train_step(*q8, c.compute, 2).ok()) << "it trains on";
}

TEST(Q8CheckpointConvert, ACorruptedScaleIsCaughtByTheCrc) {
  CheckpointDirs dirs = CheckpointDirs::make();
  const Case c{Place::kHost, DType::kF32, 1};
  auto a = make(c, 64 * kMiB, {});
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(train_step(*a, c.compute, 0).ok());
  const std::filesystem::path ckpt = dirs.ckpt.path() / "c";
  ASSERT_TRUE(a->rt->save_checkpoint(ckpt.string()).ok());
  // Tensor t3's first v scale: right after its codes in the q8 record.
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(ckpt / "manifest.json"));
  const nlohmann::json* t3 = nullptr;
  for (const auto& t : manifest.at("tensors")) {
    if (t.at("name") == "t3") t3 = &t;
  }
  ASSERT_NE(t3, nullptr);
  const auto& v = t3->at("states").at("state1");
  ASSERT_EQ(v.at("dtype"), "q8");
  const std::uint64_t at = v.at("offset").get<std::uint64_t>() + kSizes[3];
  const std::string file = manifest.at("files")[t3->at("file").get<std::size_t>()].at("name");
  std::fstream f(ckpt / file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(at));
  char byte = 0;
  f.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x40);
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&byte, 1);
  f.close();
  auto b = make(c, 64 * kMiB, {});
  ASSERT_TRUE(b.ok()) << b.status();
  const auto before = read_states(*b->rt, b->ids);
  Status loaded = b->rt->load_checkpoint(ckpt.string());
  EXPECT_EQ(loaded.code(), StatusCode::kCorrupt) << loaded;
  EXPECT_TRUE(same_bits(read_states(*b->rt, b->ids), before)) << "nothing was loaded";
}

}  // namespace
}  // namespace strata::runtime
