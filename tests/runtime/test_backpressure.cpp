// A plan the runtime accepts is a promise kept (issue #24): Note [Host room] in
// runtime/plan/planner.cpp (what the plan counts) and Note [Backpressure] in
// runtime/src/residency/residency.cpp (how the runtime waits instead of failing).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>

#include "runtime_fixtures.hpp"
#include "strata/common/bytes.hpp"
#include "strata/runtime/gradient_order.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::runtime::testing {
namespace {

constexpr std::uint64_t kElems = 4096;  // one chunk per tensor
constexpr int kTensors = 10;

RuntimeOptions options(const fs::path& dir, std::uint64_t host, std::uint32_t micro_batches) {
  RuntimeOptions o;
  o.hyper.optimizer = kernels::Optimizer::kAdamW;
  o.hyper.lr = 1e-3f;
  o.layout.chunk_elems = kElems;
  o.threads = 2;
  // Three streaming slots: every step evicts gradients.
  o.budgets = {.gpu_bytes = 3 * kElems * 4, .host_bytes = host, .nvme_bytes = 64 * kMiB};
  o.nvme_dirs = {dir.string()};
  o.plan.micro_batches = micro_batches;
  o.plan.prefetch_depth_max = 1;
  o.plan.grad_staging_slots = 1;
  o.plan.nvme_families_in_flight = 1;
  return o;
}

// Registers kTensors tensors and trains `steps` steps of `micro` micro-batches
// (forward reads every param, backward writes or accumulates every gradient in
// reverse). Returns the first error, and the last step's stats in *last.
Status train(Runtime& r, int steps, int micro, StepStats* last) {
  std::vector<TensorId> ids;
  for (int t = 0; t < kTensors; ++t) {
    STRATA_ASSIGN_OR_RETURN(TensorId id, r.register_tensor({fmt::format("t{}", t), {kElems}}));
    ids.push_back(id);
  }
  std::vector<float> init(kElems, 0.5f);
  for (TensorId id : ids) STRATA_RETURN_IF_ERROR(r.init_tensor(id, init));
  for (int step = 0; step < steps; ++step) {
    for (int m = 0; m < micro; ++m) {
      STRATA_RETURN_IF_ERROR(r.begin_micro_batch(m == micro - 1));
      for (TensorId id : ids)
        STRATA_RETURN_IF_ERROR(r.acquire(id, StateKind::kParam, Access::kRead).status());
      for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
        STRATA_ASSIGN_OR_RETURN(
            Lease g, r.acquire(*it, StateKind::kGrad, m == 0 ? Access::kWrite : Access::kAccumulate));
        float* gp = g.as<float>();
        STRATA_RETURN_IF_ERROR(r.launch([gp, m] {
          for (std::size_t i = 0; i < kElems; ++i) gp[i] = (m == 0 ? 0.0f : gp[i]) + 1e-3f;
        }));
      }
    }
    STRATA_ASSIGN_OR_RETURN(*last, r.step());
  }
  return r.flush();
}

// The smallest host budget a refusal names ("raise host_budget to at least X (N bytes)").
std::uint64_t named_minimum(const Status& refused) {
  const std::string& m = refused.message();
  const auto at = m.find("raise host_budget to at least ");
  EXPECT_NE(at, std::string::npos) << m;
  if (at == std::string::npos) return 0;
  return std::stoull(m.substr(m.find('(', at) + 1));
}

// A run that hangs fails the test by name instead of blocking ctest.
template <class F>
void within(std::chrono::seconds limit, F&& f) {
  auto done = std::async(std::launch::async, std::forward<F>(f));
  if (done.wait_for(limit) == std::future_status::timeout) {
    ADD_FAILURE() << "hung for " << limit.count() << " s (Note [Backpressure])";
    std::_Exit(1);
  }
  done.get();
}

// Micro-batches keep every gradient until the last one: the plan counts host room
// for all of them, and the minimum a refusal names trains (with the high water
// within the plan and the budget).
TEST(Backpressure, MicroBatchesTrainAtTheNamedMinimum) {
  TempDir dir;
  auto device = sim_device();
  auto small = Runtime::create(*device, options(dir.path, 256 * kKiB, 3));
  ASSERT_TRUE(small.ok()) << small.status();
  StepStats last;
  Status refused = train(**small, 1, 3, &last);
  ASSERT_EQ(refused.code(), StatusCode::kOutOfBudget) << refused;
  const std::uint64_t least = named_minimum(refused);
  ASSERT_GT(least, 256 * kKiB);
  TempDir dir2;  // (the refused runtime still holds its swap file)
  within(std::chrono::seconds(60), [&] {
    auto rt = Runtime::create(*device, options(dir2.path, least, 3));
    ASSERT_TRUE(rt.ok()) << rt.status();
    Status st = train(**rt, 4, 3, &last);
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_LE(last.host_high_water_bytes, (*rt)->plan().host_bytes);
    EXPECT_LE((*rt)->plan().host_bytes, least);
    EXPECT_EQ((*rt)->plan().grad_host_bytes, kTensors * kElems * 4);
  });
}

// A runtime that saw micro-batches its plan did not count re-plans after the step
// (Note [Host room]): it trains, within the new plan.
TEST(Backpressure, UnannouncedMicroBatchesReplan) {
  TempDir dir;
  auto device = sim_device();
  auto rt = Runtime::create(*device, options(dir.path, 8 * kMiB, 1));
  ASSERT_TRUE(rt.ok()) << rt.status();
  StepStats last;
  within(std::chrono::seconds(60), [&] {
    Status st = train(**rt, 3, 2, &last);
    ASSERT_TRUE(st.ok()) << st;
  });
  EXPECT_EQ((*rt)->plan().grad_host_bytes, kTensors * kElems * 4);
  EXPECT_LE(last.host_high_water_bytes, 8 * kMiB);
}

// The host store holds less than the budget the plan was told: requests find no
// room the plan counted. The runtime waits for the pipeline where that frees room
// and otherwise fails, saying it is a planner bug; it never hangs.
TEST(Backpressure, ShortHostStoreWaitsOrNamesAPlannerBug) {
  for (std::uint64_t short_by : {0 * kKiB, 16 * kKiB, 48 * kKiB, 96 * kKiB}) {
    TempDir dir;
    auto device = sim_device();
    RuntimeOptions o = options(dir.path, 1 * kMiB, 1);
    auto probe = Runtime::create(*device, o);
    ASSERT_TRUE(probe.ok()) << probe.status();
    StepStats last;
    ASSERT_TRUE(train(**probe, 1, 1, &last).ok());
    const std::uint64_t planned = (*probe)->plan().host_bytes;
    probe->reset();
    auto store = make_host_store(planned - short_by, device.get());
    ASSERT_TRUE(store.ok()) << store.status();
    o.host_store = std::move(store).value();
    TempDir dir2;
    o.nvme_dirs = {dir2.path.string()};
    within(std::chrono::seconds(60), [&] {
      auto rt = Runtime::create(*device, o);
      ASSERT_TRUE(rt.ok()) << rt.status();
      Status st = train(**rt, 4, 1, &last);
      if (short_by == 0) {
        EXPECT_TRUE(st.ok()) << st;  // exactly the planned bytes suffice
      } else if (!st.ok()) {
        EXPECT_EQ(st.code(), StatusCode::kOutOfBudget) << st;
      }
      SCOPED_TRACE(fmt::format("store short by {}: {}", short_by, st.to_string()));
    });
  }
}

// Registers 2 * kTensors tensors of half a chunk (two per family) and trains
// `steps` steps of one micro-batch. The first step writes the gradients in
// reverse (each family's two pieces one after the other). Later steps write one
// piece of `opened_first` families first and the other pieces after them, as torch
// does under autocast when the casts of the weights are cached across steps (#24):
// with opened_first = kTensors every family's gradient is incomplete at once.
// With `unused`, the first tensor of every family gets no gradient on odd steps (a branch
// unused on those steps); with `declare`, backward's end goes through
// GradientOrder::end_backward, declaring those tensors (Runtime::no_gradient), else
// through take_kept (the kept ones only).
Status train_in_pieces(Runtime& r, int steps, std::size_t opened_first, StepStats* last,
                       GradientOrder* keep = nullptr, bool unused = false, bool declare = false) {
  std::vector<TensorId> ids;
  for (int t = 0; t < 2 * kTensors; ++t) {
    STRATA_ASSIGN_OR_RETURN(TensorId id, r.register_tensor({fmt::format("t{}", t), {kElems / 2}}));
    ids.push_back(id);
  }
  std::vector<float> init(kElems / 2, 0.5f);
  for (TensorId id : ids) STRATA_RETURN_IF_ERROR(r.init_tensor(id, init));
  for (int step = 0; step < steps; ++step) {
    STRATA_RETURN_IF_ERROR(r.begin_micro_batch(true));
    for (TensorId id : ids) STRATA_RETURN_IF_ERROR(r.acquire(id, StateKind::kParam, Access::kRead).status());
    std::vector<TensorId> order(ids.rbegin(), ids.rend());
    if (step > 0) {
      // One piece of each of the first `opened_first` families (in backward order), then the rest.
      std::stable_partition(order.begin(), order.end(), [&](TensorId id) {
        return id % 2 == 1 && ids.size() - 1 - id < 2 * opened_first;
      });
    }
    if (unused && step % 2 == 1) std::erase_if(order, [](TensorId id) { return id % 2 == 0; });
    // With `keep`, each gradient goes through GradientOrder, as strata.torch's do (Note [Gradients in
    // pieces]).
    std::vector<std::uint32_t> hand;
    if (keep != nullptr && !keep->has_families()) {
      std::vector<std::uint32_t> family;
      for (TensorId id : ids) family.push_back(static_cast<std::uint32_t>(r.layout().slots[id].family));
      keep->set_families(std::move(family), std::vector<bool>(ids.size(), true));
    }
    if (keep != nullptr) keep->begin_micro_batch(r.incomplete_gradients_max());
    for (std::size_t i = 0; i <= order.size(); ++i) {
      hand.clear();
      if (keep == nullptr && i < order.size()) hand.push_back(order[i]);
      if (keep != nullptr && i < order.size()) keep->offer(order[i], kElems / 2 * 4, &hand);
      if (keep != nullptr && i == order.size() && !declare) keep->take_kept(&hand);
      if (keep != nullptr && i == order.size() && declare) {
        std::vector<GradientOrder::Handing> handings;
        keep->end_backward(&handings);
        for (const GradientOrder::Handing& h : handings) {  // in order: each family completes in turn
          if (!h.gradient) {
            STRATA_RETURN_IF_ERROR(r.no_gradient(h.tensor));
            continue;
          }
          STRATA_ASSIGN_OR_RETURN(Lease g, r.acquire(h.tensor, StateKind::kGrad, Access::kWrite));
          float* gp = g.as<float>();
          STRATA_RETURN_IF_ERROR(r.launch([gp] {
            for (std::size_t e = 0; e < kElems / 2; ++e) gp[e] = 1e-3f;
          }));
        }
      }
      for (std::uint32_t id : hand) {
        STRATA_ASSIGN_OR_RETURN(Lease g, r.acquire(id, StateKind::kGrad, Access::kWrite));
        float* gp = g.as<float>();
        STRATA_RETURN_IF_ERROR(r.launch([gp] {
          for (std::size_t e = 0; e < kElems / 2; ++e) gp[e] = 1e-3f;
        }));
      }
    }
    STRATA_ASSIGN_OR_RETURN(*last, r.step());
  }
  return r.flush();
}

// SGD at three streaming slots and a host budget far above the plan's.
RuntimeOptions sgd_options(const fs::path& dir) {
  RuntimeOptions o = options(dir, 8 * kMiB, 1);
  o.hyper.optimizer = kernels::Optimizer::kSgd;
  return o;
}

// Gradients written in pieces, every family incomplete at once, with three
// streaming slots: more incomplete gradients than the plan's host room holds
// (Runtime::incomplete_gradients_max()). The run cannot go on within the plan;
// it must stop cleanly, before exceeding it, saying that the order is the cause
// and what to do (Note [Gradients in pieces] in runtime/include/strata/runtime/gradient_order.hpp is
// what strata.torch does), and leave the runtime usable.
TEST(Backpressure, MoreIncompleteGradientsThanTheRoomHoldsFailNamingTheOrder) {
  TempDir dir;
  auto device = sim_device();
  auto rt = Runtime::create(*device, sgd_options(dir.path));
  ASSERT_TRUE(rt.ok()) << rt.status();
  StepStats last;
  Status st;
  within(std::chrono::seconds(60), [&] { st = train_in_pieces(**rt, 3, kTensors, &last); });
  ASSERT_EQ(st.code(), StatusCode::kOutOfBudget) << st;
  EXPECT_NE(st.message().find("incomplete at once"), std::string::npos) << st;
  EXPECT_NE(st.message().find("Gradients in pieces"), std::string::npos) << st;
  EXPECT_EQ((*rt)->incomplete_gradients_max(), 3u);  // one per streaming slot
  // Usable after the error: the failed step is discarded, state reads back.
  EXPECT_TRUE((*rt)->abort_step().ok());
  std::vector<float> value(kElems / 2);
  EXPECT_TRUE((*rt)->read_tensor(0, StateKind::kParam, value).ok());
}

// The same order, every family opened by one piece, with each gradient offered to
// GradientOrder first (what strata.torch does): what would open more families than
// the room holds is kept back and handed with its family's last piece, so the run
// trains within the plan. (The test above is the same run without it.)
TEST(Backpressure, GradientsKeptBackByGradientOrderFitThePlan) {
  TempDir dir;
  auto device = sim_device();
  auto rt = Runtime::create(*device, sgd_options(dir.path));
  ASSERT_TRUE(rt.ok()) << rt.status();
  StepStats last;
  GradientOrder keep;
  within(std::chrono::seconds(60), [&] {
    Status st = train_in_pieces(**rt, 4, kTensors, &last, &keep);
    ASSERT_TRUE(st.ok()) << st;
  });
  EXPECT_EQ((*rt)->incomplete_gradients_max(), 3u);
  EXPECT_GT(keep.kept_total(), 0u);  // (else the order under test did not happen)
  EXPECT_LE(last.host_high_water_bytes, (*rt)->plan().host_bytes);
}

// A tensor per family unused on odd steps (each family's other gradient comes in
// plan order): every family stays incomplete. Through GradientOrder, backward's end
// hands the kept families and, without declaring the unused tensors, they all wait
// for step() beyond the plan's room: OutOfBudget naming the order. Declaring them
// (GradientOrder::end_backward, Runtime::no_gradient) completes each family in turn,
// and the run trains within the plan.
// Four steps of train_in_pieces with a tensor per family unused on odd steps; the
// runtime usable after an error (abort_step). `plan_host`: the plan's host bytes.
Status train_unused(bool declare, GradientOrder& keep, StepStats& last, std::uint64_t& plan_host) {
  TempDir dir;
  auto device = sim_device();
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, Runtime::create(*device, sgd_options(dir.path)));
  Status st;
  within(std::chrono::seconds(60), [&] { st = train_in_pieces(*rt, 4, 0, &last, &keep, true, declare); });
  plan_host = rt->plan().host_bytes;
  if (!st.ok()) {
    EXPECT_TRUE(rt->abort_step().ok());
  }
  return st;
}

TEST(Backpressure, TensorsWithoutAGradientDeclaredAtBackwardsEndKeepThePlan) {
  GradientOrder keep, keep_declaring;
  StepStats last;
  std::uint64_t plan_host = 0;
  const Status st = train_unused(false, keep, last, plan_host);
  ASSERT_EQ(st.code(), StatusCode::kOutOfBudget) << st;
  EXPECT_NE(st.message().find("no_gradient"), std::string::npos) << st;
  const Status declared = train_unused(true, keep_declaring, last, plan_host);
  ASSERT_TRUE(declared.ok()) << declared;
  EXPECT_GT(keep_declaring.kept_total(), 0u);
  EXPECT_LE(last.host_high_water_bytes, plan_host);
}

// Runtime::no_gradient refuses what it cannot mean: an unknown id, a frozen tensor, a
// tensor whose gradient was handed over (or declared absent) in this micro-batch.
TEST(Backpressure, NoGradientRefusesWhatItCannotMean) {
  TempDir dir;
  auto device = sim_device();
  auto rt = Runtime::create(*device, sgd_options(dir.path));
  ASSERT_TRUE(rt.ok()) << rt.status();
  Runtime& r = **rt;
  auto a = r.register_tensor({"a", {64}});
  auto b = r.register_tensor({"b", {64}});
  TensorSpec frozen{"f", {64}};
  frozen.frozen = true;
  auto f = r.register_tensor(frozen);
  ASSERT_TRUE(a.ok() && b.ok() && f.ok());
  ASSERT_TRUE(r.begin_micro_batch(true).ok());
  EXPECT_EQ(r.no_gradient(99).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.no_gradient(*f).code(), StatusCode::kFailedPrecondition);
  {
    auto g = r.acquire(*a, StateKind::kGrad, Access::kWrite);
    ASSERT_TRUE(g.ok()) << g.status();
  }
  EXPECT_EQ(r.no_gradient(*a).code(), StatusCode::kFailedPrecondition);  // handed over
  EXPECT_TRUE(r.no_gradient(*b).ok());
  EXPECT_EQ(r.no_gradient(*b).code(), StatusCode::kFailedPrecondition);  // declared twice
  auto late = r.acquire(*b, StateKind::kGrad, Access::kWrite);
  EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition);  // declared gradient-less
  auto stats = r.step();
  ASSERT_TRUE(stats.ok()) << stats.status();
  auto steps_a = r.tensor_steps(*a), steps_b = r.tensor_steps(*b);
  ASSERT_TRUE(steps_a.ok() && steps_b.ok());
  EXPECT_EQ(*steps_a, 1);
  EXPECT_EQ(*steps_b, 0);  // no gradient: not updated
}

}  // namespace
}  // namespace strata::runtime::testing
