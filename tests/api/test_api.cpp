// The C++ facade: a tiny linear model trained through strata::Runtime on the sim
// device with every tier in use, stats, the trace, and errors as Status.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>

#include "strata/common/bytes.hpp"
#include "strata/strata.hpp"

namespace strata {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  TempDir() : path(fs::temp_directory_path() / ("strata-api-test-" + std::to_string(::getpid()))) {
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  fs::path path;
};

// y = x W for a fixed target W*; 6 layers of n x n so that state exceeds the budgets.
struct Linear {
  static constexpr std::size_t kN = 256, kLayers = 6, kBatch = 16;
  std::vector<TensorId> w;
  std::vector<float> x, target;
  float loss = 0;
};

Status forward_backward(Runtime& rt, Linear& m) {
  // Each layer: out = in * W_l; the "model" is the sum of layer outputs (independent layers).
  std::vector<float> out(Linear::kBatch * Linear::kN, 0.0f);
  for (TensorId w : m.w) {
    STRATA_ASSIGN_OR_RETURN(Lease p, rt.param(w));
    const float* W = p.as<float>();
    STRATA_RETURN_IF_ERROR(rt.launch([&, W] {
      for (std::size_t r = 0; r < Linear::kBatch; ++r)
        for (std::size_t k = 0; k < Linear::kN; ++k)
          for (std::size_t j = 0; j < Linear::kN; ++j)
            out[r * Linear::kN + j] += m.x[r * Linear::kN + k] * W[k * Linear::kN + j];
    }));
  }
  STRATA_RETURN_IF_ERROR(rt.synchronize());
  std::vector<float> dout(out.size());
  float loss = 0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const float d = out[i] - m.target[i];
    loss += d * d / static_cast<float>(out.size());
    dout[i] = 2 * d / static_cast<float>(out.size());
  }
  m.loss = loss;
  for (std::size_t l = m.w.size(); l-- > 0;) {
    STRATA_ASSIGN_OR_RETURN(Lease p, rt.param(m.w[l]));
    STRATA_ASSIGN_OR_RETURN(Lease g, rt.grad(m.w[l]));
    float* G = g.as<float>();
    STRATA_RETURN_IF_ERROR(rt.launch([&, G] {
      for (std::size_t k = 0; k < Linear::kN; ++k)
        for (std::size_t j = 0; j < Linear::kN; ++j) {
          float s = 0;
          for (std::size_t r = 0; r < Linear::kBatch; ++r)
            s += m.x[r * Linear::kN + k] * dout[r * Linear::kN + j];
          G[k * Linear::kN + j] = s;
        }
    }));
    STRATA_RETURN_IF_ERROR(rt.synchronize());
  }
  return Status::Ok();
}

TEST(Api, TrainsAcrossThreeTiers) {
  TempDir nvme;
  auto config = Config::from_json_text(fmt::format(R"({{
      "device": {{"kind": "sim", "budget": "65MiB"}},
      "budgets": {{"gpu": "1MiB", "host": "4608KiB", "nvme": "64MiB"}},
      "nvme": {{"dirs": ["{}"]}},
      "layout": {{"chunk_elems": 65536}},
      "optimizer": {{"name": "adam", "lr": 0.01}}, "threads": 2}})",
                                                   nvme.path.string()));
  ASSERT_TRUE(config.ok()) << config.status();
  auto rt = Runtime::create(*config);
  ASSERT_TRUE(rt.ok()) << rt.status();
  Runtime& r = **rt;

  Linear m;
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (std::size_t l = 0; l < Linear::kLayers; ++l) {  // every tensor before the first init
    auto id = r.register_tensor(fmt::format("w{}", l), {Linear::kN, Linear::kN});
    ASSERT_TRUE(id.ok()) << id.status();
    m.w.push_back(*id);
  }
  for (TensorId id : m.w) {
    std::vector<float> init(Linear::kN * Linear::kN);
    for (auto& v : init) v = 0.01f * n(rng);
    const Status st = r.init_tensor(id, init);
    ASSERT_TRUE(st.ok()) << st;
  }
  EXPECT_EQ(r.find_tensor("w3").value(), m.w[3]);
  EXPECT_EQ(r.find_tensor("nope").status().code(), StatusCode::kNotFound);
  m.x.resize(Linear::kBatch * Linear::kN);
  m.target.resize(m.x.size());
  for (auto& v : m.x) v = n(rng);
  for (auto& v : m.target) v = n(rng);

  std::vector<float> losses;
  for (int s = 0; s < 12; ++s) {
    Status st = forward_backward(r, m);
    ASSERT_TRUE(st.ok()) << st;
    auto stats = r.step();
    ASSERT_TRUE(stats.ok()) << stats.status();
    losses.push_back(m.loss);
  }
  EXPECT_LT(losses.back(), 0.8f * losses.front()) << "loss " << losses.front() << " -> " << losses.back();
  EXPECT_TRUE(r.flush().ok());  // the NVMe write-backs of the last step
  const Stats& t = r.stats();
  EXPECT_EQ(t.steps, 12u);
  EXPECT_GT(t.bytes_h2d, 0u);
  EXPECT_GT(t.bytes_disk_write, 0u) << "state beyond the host budget went to NVMe: " << r.describe();
  EXPECT_LE(t.gpu_high_water_bytes, 1 * kMiB);
  EXPECT_LE(t.host_high_water_bytes, 4 * kMiB);

  std::vector<float> w0(Linear::kN * Linear::kN);
  EXPECT_TRUE(r.read_tensor(m.w[0], w0).ok());
  // One argument order (issue #26): tensor, state, buffer, as the runtime and the C ABI.
  std::vector<float> w0_master(w0.size());
  ASSERT_TRUE(r.read_tensor(m.w[0], StateKind::kMaster, w0_master).ok());
  EXPECT_EQ(w0_master, w0) << "fp32 params: the master is the param";
  std::vector<float> written(w0.size(), 0.25f), back(w0.size());
  ASSERT_TRUE(r.write_tensor(m.w[1], StateKind::kMaster, written).ok());
  ASSERT_TRUE(r.read_tensor(m.w[1], StateKind::kMaster, back).ok());
  EXPECT_EQ(back, written);
  auto late = r.register_tensor("late", {4});
  EXPECT_EQ(late.status().code(), StatusCode::kFailedPrecondition);

  const fs::path trace = nvme.path / "trace.json";
  ASSERT_TRUE(r.write_chrome_trace(trace.string()).ok());
  EXPECT_GT(fs::file_size(trace), 100u);
}

TEST(Api, BadConfigFailsCreate) {
  Config c;
  c.device.kind = memory::DeviceChoice::kSim;
  c.device.budget_bytes = 64 * kMiB;
  c.runtime.budgets.gpu_bytes = 0;
  auto rt = Runtime::create(c);
  ASSERT_FALSE(rt.ok());
  EXPECT_NE(rt.status().message().find("budgets.gpu"), std::string::npos) << rt.status();
}

}  // namespace
}  // namespace strata
