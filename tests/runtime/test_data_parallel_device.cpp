// #14: the runtime's device-buffer path (the one the nccl backend takes), run
// on the sim device. DeviceBufferLocal is the local backend as the runtime sees
// nccl: it says device_buffers(), and every collective runs in order on a
// stream of the runtime's device (a launch_host function that issues it on the
// local group and waits for it there), so a collective runs after what the
// runtime ordered before issuing it, and a Handle completes once its stream got
// there. The reduce-scatter then reads each gradient in its device slot and
// sums this rank's shard in place; the all-gather fills the param's slot. W = 2
// and 4 ranks match one rank bit for bit on three tiers (the local reduction is
// rank-ordered), and each rank copies at most 1/W of the gradients down.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <thread>

#include "dp_harness.hpp"
#include "strata/comm/local.hpp"
#include "strata/common/scratch_dir.hpp"

namespace strata::runtime {
namespace {

using testing::DpResult;

//! The local backend with nccl's view of buffers and ordering (see the top).
class DeviceBufferLocal final : public comm::Communicator {
 public:
  //! `ran` counts the collectives run on `stream` (a stream of `device`).
  DeviceBufferLocal(std::unique_ptr<comm::Communicator> inner, memory::Device& device, memory::Stream stream,
                    std::atomic<int>* ran)
      : Communicator(inner->rank(), inner->size(), inner->options()),
        inner_(std::move(inner)),
        device_(device),
        stream_(std::move(stream)),
        ran_(ran) {}
  ~DeviceBufferLocal() override { device_.synchronize(stream_).ignore(); }
  std::string_view backend() const override { return "local-device"; }
  bool device_buffers() const override { return true; }
  void abort(std::string_view reason) override { inner_->abort(reason); }

 private:
  struct Op final : comm::PendingOp {
    Op(memory::Device& d, memory::Event e, std::shared_ptr<Status> r)
        : device(d), finished(std::move(e)), result(std::move(r)) {}
    Status wait() override {
      STRATA_RETURN_IF_ERROR(device.synchronize(finished));
      return *result;
    }
    bool done() override {
      auto q = device.query(finished);
      return q.ok() && *q;
    }
    memory::Device& device;
    memory::Event finished;
    std::shared_ptr<Status> result;
  };

  //! Runs `start` (a collective on the inner group) and its wait on the stream.
  Result<std::unique_ptr<comm::PendingOp>> on_stream(std::function<Result<comm::Handle>()> start) {
    auto result = std::make_shared<Status>();
    STRATA_RETURN_IF_ERROR(device_.launch_host(stream_, [this, start = std::move(start), result] {
      Result<comm::Handle> h = start();
      *result = h.ok() ? h->wait() : h.status();
      ran_->fetch_add(1);
    }));
    STRATA_ASSIGN_OR_RETURN(memory::Event e, device_.create_event());
    STRATA_RETURN_IF_ERROR(device_.record(e, stream_));
    return std::unique_ptr<comm::PendingOp>(std::make_unique<Op>(device_, std::move(e), std::move(result)));
  }
  std::uint64_t peer_bytes(std::size_t bytes) const { return bytes * static_cast<std::uint64_t>(size() - 1); }

  Result<std::unique_ptr<comm::PendingOp>> start_reduce_scatter(const void* send, void* recv,
                                                                std::size_t count,
                                                                comm::DType dtype) override {
    stats_.reduce_scatter_bytes += peer_bytes(count * comm::dtype_size(dtype));
    return on_stream([=, this] { return inner_->reduce_scatter(send, recv, count, dtype); });
  }
  Result<std::unique_ptr<comm::PendingOp>> start_all_gather(const void* send, void* recv, std::size_t count,
                                                            comm::DType dtype) override {
    stats_.all_gather_bytes += peer_bytes(count * comm::dtype_size(dtype));
    return on_stream([=, this] { return inner_->all_gather(send, recv, count, dtype); });
  }
  Result<std::unique_ptr<comm::PendingOp>> start_all_reduce(std::span<double> values,
                                                            comm::ReduceOp op) override {
    stats_.all_reduce_bytes += peer_bytes(values.size_bytes());
    return on_stream([=, this] { return inner_->all_reduce(values, op); });
  }
  Result<std::unique_ptr<comm::PendingOp>> start_broadcast(void* data, std::size_t bytes, int root) override {
    if (rank() == root) stats_.broadcast_bytes += peer_bytes(bytes);
    return on_stream([=, this] { return inner_->broadcast(data, bytes, root); });
  }

  std::unique_ptr<comm::Communicator> inner_;
  memory::Device& device_;
  memory::Stream stream_;
  std::atomic<int>* ran_;
};

struct Case {
  Tier tier;
  int ranks;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return fmt::format("{}_W{}", tier_name(info.param.tier), info.param.ranks);
}

//! Every rank of a local group on its own thread (testing::run_ranks), each
//! through a DeviceBufferLocal on a stream of its own device. `on_stream`
//! (optional) gets how many collectives each rank ran on its stream.
std::vector<DpResult> run_device_ranks(Tier tier, int w, std::vector<int>* on_stream = nullptr,
                                       const bench::DpModel& model = testing::dp_model()) {
  std::vector<std::atomic<int>> ran(static_cast<std::size_t>(w));
  auto wrap = [&ran](std::unique_ptr<comm::Communicator> inner,
                     memory::Device& device) -> std::shared_ptr<comm::Communicator> {
    auto stream = device.create_stream();
    EXPECT_TRUE(stream.ok()) << stream.status();
    if (!stream.ok()) return nullptr;  // (the runtime then runs one rank: the comparison fails)
    std::atomic<int>* count = &ran[static_cast<std::size_t>(inner->rank())];
    return std::make_shared<DeviceBufferLocal>(std::move(inner), device, std::move(stream).value(), count);
  };
  std::vector<DpResult> results = testing::run_ranks(tier, w, {}, model, wrap);
  if (on_stream != nullptr) {
    on_stream->clear();
    for (auto& n : ran) on_stream->push_back(n.load());
  }
  return results;
}

class DataParallelDeviceBuffers : public ::testing::TestWithParam<Case> {};

TEST_P(DataParallelDeviceBuffers, RanksMatchOneRankBitForBit) {
  const auto [tier, w] = GetParam();
  ScratchDir dir = testing::dp_scratch("dev-single");
  const DpResult single = testing::dp_train(testing::dp_options(tier, dir.path().string()), -1, w);
  ASSERT_TRUE(single.status.ok()) << single.status;
  testing::expect_trained(single);
  if (tier != Tier::kNvme) {  // (as in DataParallel.RanksWithAPartOfTheBatchMatchOneRankWithAllOfIt)
    EXPECT_GT(std::count(single.homes.begin(), single.homes.end(), tier), 0)
        << "no family's states on " << tier_name(tier);
  }

  std::vector<int> on_stream;
  const std::vector<DpResult> ranked = run_device_ranks(tier, w, &on_stream);
  std::vector<std::uint64_t> covered;
  for (int r = 0; r < w; ++r) {
    const DpResult& res = ranked[static_cast<std::size_t>(r)];
    testing::expect_bit_identical(single, res, r, &covered);
    EXPECT_GT(res.bytes_comm, 0u);
    // Every collective ran on the stream: the start-up check, and per step one
    // reduce-scatter and one all-gather per trainable family plus the agreement.
    EXPECT_GE(on_stream[static_cast<std::size_t>(r)],
              static_cast<int>(res.homes.size()) * 2 * testing::kDpSteps)
        << "rank " << r;
  }
  const bench::DpModel model = testing::dp_model();
  for (std::size_t t = 0; t < model.numels.size(); ++t) {
    EXPECT_EQ(covered[t], t == model.frozen ? 0 : model.numels[t]) << "tensor t" << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Tiers, DataParallelDeviceBuffers,
                         ::testing::Values(Case{Tier::kGpu, 2}, Case{Tier::kGpu, 4}, Case{Tier::kHost, 2},
                                           Case{Tier::kHost, 4}, Case{Tier::kNvme, 2}, Case{Tier::kNvme, 4}),
                         case_name);

// Gradients written on host (host leases) are not in a device slot: each goes
// up into a device buffer of its own for the reduce-scatter, and only the
// shard's sum comes down; the result is still one rank's, bit for bit.
TEST(DataParallelDeviceBuffersHost, GradientsWrittenOnHostGoUpThroughADeviceBuffer) {
  bench::DpModel model = testing::dp_model();
  model.grad_where = Where::kHost;
  for (const int w : {2, 4}) {
    ScratchDir dir = testing::dp_scratch("dev-host-single");
    const DpResult single =
        testing::dp_train(testing::dp_options(Tier::kHost, dir.path().string()), -1, w, model);
    ASSERT_TRUE(single.status.ok()) << single.status;
    testing::expect_trained(single);
    const std::vector<DpResult> ranked = run_device_ranks(Tier::kHost, w, nullptr, model);
    for (int r = 0; r < w; ++r) {
      testing::expect_bit_identical(single, ranked[static_cast<std::size_t>(r)], r);
      // The gradients went up (h2d) and only the shards' sums came down: at
      // most the gathered params plus 1/W of the gradient chunks.
      const DpResult& res = ranked[static_cast<std::size_t>(r)];
      const std::uint64_t params_down = res.offgpu_param_bytes * (testing::kDpSteps - 1);
      EXPECT_LE(res.bytes_d2h, params_down + params_down / static_cast<std::uint64_t>(w)) << "W " << w;
    }
  }
}

// The gradients are reduced in their device slots: a rank copies down only its
// shard of each off-GPU family's gradient sum (1/W of what one rank copies),
// plus the gathered param chunks of those families (NCCL gathers device memory:
// a param updated on host goes up as a shard and comes down whole).
TEST(DataParallelDeviceBuffersTraffic, ARankCopiesAtMostOneWthOfTheGradientsDown) {
  for (const int w : {2, 4}) {
    ScratchDir dir = testing::dp_scratch("dev-d2h");
    const DpResult single = testing::dp_train(testing::dp_options(Tier::kHost, dir.path().string()), -1, w);
    ASSERT_TRUE(single.status.ok()) << single.status;
    ASSERT_GT(single.bytes_d2h, 0u);
    const std::vector<DpResult> ranked = run_device_ranks(Tier::kHost, w);
    for (int r = 0; r < w; ++r) {
      const DpResult& res = ranked[static_cast<std::size_t>(r)];
      ASSERT_TRUE(res.status.ok()) << res.status;
      const std::uint64_t params_down = res.offgpu_param_bytes * (testing::kDpSteps - 1);
      fmt::print("W {} rank {}: d2h {} B (of which gathered params <= {} B) vs one rank's {} B\n", w, r,
                 res.bytes_d2h, params_down, single.bytes_d2h);
      EXPECT_GT(res.bytes_d2h, 0u) << "the shards' sums come down (the device path ran)";
      // Here every off-GPU param is updated on host, so it comes down whole, and
      // each gradient chunk (as many bytes as its param chunk, fp32) as 1/W.
      EXPECT_EQ(res.bytes_d2h, params_down + params_down / static_cast<std::uint64_t>(w))
          << "W " << w << " rank " << r;
      EXPECT_LE((res.bytes_d2h - std::min(res.bytes_d2h, params_down)) * static_cast<std::uint64_t>(w),
                single.bytes_d2h)
          << "W " << w << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace strata::runtime
