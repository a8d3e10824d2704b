// strata::Config: set() by key, the JSON loader and its refusals by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "strata/common/bytes.hpp"
#include "strata/strata.hpp"

namespace strata {
namespace {

TEST(Config, JsonSetsEverySection) {
  auto c = Config::from_json_text(R"({
    "device": {"kind": "sim", "budget": "96MiB", "h2d_bandwidth": "12GiB", "stream_queue_depth": 64},
    "budgets": {"gpu": "64MiB", "host": 1073741824, "nvme": "8GiB"},
    "nvme": {"dirs": ["/tmp/a", "/tmp/b"], "engine": "posix"},
    "optimizer": {"weight_decay": 0.1, "name": "lamb", "lr": 3e-4, "bias_correction": false},
    "precision": {"compute": "bf16", "states": "bf16"},
    "plan": {"prefetch": false, "prefetch_depth_max": 2, "host_reserve": "16MiB"},
    "layout": {"chunk_elems": 1048576},
    "clip_max_norm": 1.0, "loss_scaling": true, "threads": 2
  })");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->device.kind, memory::DeviceChoice::kSim);
  EXPECT_EQ(c->device.budget_bytes, 96 * kMiB);
  EXPECT_EQ(c->device.h2d_bytes_per_s, 12 * kGiB);
  EXPECT_EQ(c->device.stream_queue_depth, 64u);
  EXPECT_EQ(c->runtime.budgets.gpu_bytes, 64 * kMiB);
  EXPECT_EQ(c->runtime.budgets.host_bytes, kGiB);
  EXPECT_EQ(c->runtime.budgets.nvme_bytes, 8 * kGiB);
  EXPECT_EQ(c->runtime.nvme_dirs, (std::vector<std::string>{"/tmp/a", "/tmp/b"}));
  EXPECT_EQ(c->runtime.io_engine, "posix");
  // optimizer.name is applied first, so weight_decay (sorted before it) survives.
  EXPECT_EQ(c->runtime.hyper.optimizer, kernels::Optimizer::kLamb);
  EXPECT_FLOAT_EQ(c->runtime.hyper.weight_decay, 0.1f);
  EXPECT_FLOAT_EQ(c->runtime.hyper.lr, 3e-4f);
  EXPECT_FALSE(c->runtime.hyper.bias_correction);
  EXPECT_EQ(c->runtime.compute_dtype, runtime::DType::kBF16);
  EXPECT_EQ(c->runtime.state_dtype, kernels::DType::kBF16);
  EXPECT_FALSE(c->runtime.plan.prefetch);
  EXPECT_EQ(c->runtime.plan.prefetch_depth_max, 2u);
  EXPECT_EQ(c->runtime.plan.host_reserve_bytes, 16 * kMiB);
  EXPECT_EQ(c->runtime.layout.chunk_elems, 1048576u);
  EXPECT_DOUBLE_EQ(c->runtime.clip_max_norm, 1.0);
  EXPECT_TRUE(c->runtime.loss_scaling);
  EXPECT_EQ(c->runtime.threads, 2u);
}

TEST(Config, EveryOptimizerByName) {
  for (const char* name : {"adamw", "adam", "lamb", "lars", "sgd", "lion", "adagrad", "came"}) {
    Config c;
    ASSERT_TRUE(c.set("optimizer.name", name).ok()) << name;
    EXPECT_EQ(kernels::optimizer_name(c.runtime.hyper.optimizer), name);
  }
  Config c;
  Status s = c.set("optimizer.name", "rmsprop");
  EXPECT_NE(s.message().find("rmsprop"), std::string::npos) << s;
  EXPECT_NE(s.message().find("optimizer.name"), std::string::npos) << s;  // where
  EXPECT_NE(s.message().find("adamw"), std::string::npos) << s;           // what to do
}

void expect_rejected(const char* json, const char* names) {
  auto c = Config::from_json_text(json);
  ASSERT_FALSE(c.ok()) << json;
  EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find(names), std::string::npos) << c.status().message();
}

TEST(Config, RejectsByName) {
  expect_rejected(R"({"budgets": {"gpu": "1GiB", "cpu": "1GiB"}})", "budgets.cpu");
  expect_rejected(R"({"bogus": 1})", "bogus");
  expect_rejected(R"({"optimizer": {"lr": "fast"}})", "optimizer.lr");
  expect_rejected(R"({"optimizer": {"lr": "fast"}})", "wrong type");
  expect_rejected(R"({"budgets": {"host": "-1GiB"}})", "negative");
  expect_rejected(R"({"budgets": {"host": -5}})", "budgets.host");
  expect_rejected(R"({"plan": {"prefetch": 1}})", "plan.prefetch");
  expect_rejected(R"({"nvme": {"dirs": "/tmp"}})", "nvme.dirs");
  expect_rejected(R"({"device": {"kind": "tpu"}})", "tpu");
  expect_rejected(R"({"budgets": {"gpu": "8 parsecs"}})", "budgets.gpu");
  expect_rejected(R"({"threads": 2.5})", "threads");
  expect_rejected(R"({"budgets": )", "not valid JSON");
  expect_rejected(R"([1, 2])", "object");
}

TEST(Config, FileErrorsNameThePath) {
  auto missing = Config::from_json_file("/nonexistent/strata.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/strata.json"), std::string::npos);

  const auto path = std::filesystem::temp_directory_path() / "strata-test-config.json";
  std::ofstream(path) << R"({"budgets": {"gpu": "2GiB"}, "typo_key": true})";
  auto bad = Config::from_json_file(path);
  std::filesystem::remove(path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("typo_key"), std::string::npos);
  EXPECT_NE(bad.status().message().find(path.string()), std::string::npos);
}

TEST(Config, KeysAreAllSettable) {
  const auto keys = Config::keys();
  EXPECT_GT(keys.size(), 30u);
  Config c;
  EXPECT_TRUE(c.set("budgets.gpu", "3GiB").ok());
  EXPECT_EQ(c.runtime.budgets.gpu_bytes, 3 * kGiB);
  Status s = c.set("budgets.gpx", "3GiB");
  EXPECT_NE(s.message().find("budgets.gpu"), std::string::npos) << "lists the known keys: " << s;
}

}  // namespace
}  // namespace strata
