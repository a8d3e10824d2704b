// What Runtime::create refuses, reached the way a user reaches it: a JSON config
// file read through the C ABI (strata_config_from_json_file, strata_runtime_new), and
// Config::validate(). Each case was once accepted (issue 16); the message must
// name the key.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "strata/strata.h"
#include "strata/strata.hpp"

namespace strata {
namespace {

namespace fs = std::filesystem;

class ConfigValidation : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("strata-config-validation-" + std::to_string(::getpid()));
    fs::create_directories(dir_ / "nvme");
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A small runtime on the sim device with `extra` merged in (JSON members).
  std::string config_text(const std::string& budgets, const std::string& extra) const {
    return R"({"device": {"kind": "sim", "budget": "64MiB"}, "budgets": {"gpu": "16MiB", "host": "32MiB")" +
           budgets + "}" + extra + "}";
  }

  // strata_config_from_json_file + strata_runtime_new; returns the status of the first
  // that fails (STRATA_OK when both succeed) and its message.
  strata_status create_through_c(const std::string& text, std::string* message) const {
    const fs::path file = dir_ / "strata.json";
    std::ofstream(file) << text;
    strata_config* cfg = nullptr;
    strata_status st = strata_config_from_json_file(file.c_str(), &cfg);
    if (st != STRATA_OK) {
      *message = strata_last_error();
      return st;
    }
    strata_runtime* rt = nullptr;
    st = strata_runtime_new(cfg, &rt);
    *message = st == STRATA_OK ? "" : strata_last_error();
    strata_runtime_free(rt);
    strata_config_free(cfg);
    return st;
  }

  void expect_refused(const std::string& budgets, const std::string& extra, const std::string& key) const {
    std::string message;
    const strata_status st = create_through_c(config_text(budgets, extra), &message);
    EXPECT_NE(st, STRATA_OK) << "accepted: " << budgets << extra;
    EXPECT_NE(message.find(key), std::string::npos) << "message does not name " << key << ": " << message;
  }

  std::string nvme(const std::string& dir) const { return R"(, "nvme": {"dirs": [")" + dir + R"("]})"; }

  fs::path dir_;
};

TEST_F(ConfigValidation, AcceptsAWorkingConfig) {
  std::string message;
  EXPECT_EQ(create_through_c(config_text(R"(, "nvme": "64MiB")", nvme((dir_ / "nvme").string())), &message),
            STRATA_OK)
      << message;
}

TEST_F(ConfigValidation, NvmeDirMustExistAndBeADirectory) {
  expect_refused(R"(, "nvme": "64MiB")", nvme((dir_ / "missing").string()), "nvme.dirs");
  EXPECT_FALSE(fs::exists(dir_ / "missing")) << "strata never creates a directory it was told to use";
  std::ofstream(dir_ / "file") << "x";
  expect_refused(R"(, "nvme": "64MiB")", nvme((dir_ / "file").string()), "not a directory");
  expect_refused(R"(, "nvme": "64MiB")", nvme("/proc"), "proc");
}

// budgets.nvme is a cap, not a size (#24, Note [Growing swap files]): a budget far
// above the free space is accepted; what the plan puts on NVMe is checked when the
// tier is made (strata-example-lm's example_lm_nvme_budget_above_free_space trains so).
TEST_F(ConfigValidation, NvmeBudgetIsACapAndMayExceedTheFreeSpace) {
  std::string message;
  EXPECT_EQ(create_through_c(config_text(R"(, "nvme": 18446744073709551615)", nvme((dir_ / "nvme").string())),
                             &message),
            STRATA_OK)
      << message;
}

TEST_F(ConfigValidation, ChunkElemsMustBeAlignedAndBounded) {
  expect_refused("", R"(, "layout": {"chunk_elems": 3})", "layout.chunk_elems");
  expect_refused("", R"(, "layout": {"chunk_elems": 1099511627776})", "layout.chunk_elems");
}

TEST_F(ConfigValidation, ChunkSearchRangeMustBeOrdered) {
  expect_refused("", R"(, "layout": {"chunk_elems_min": 67108864, "chunk_elems_max": 1048576})",
                 "chunk_elems_min");
  expect_refused("", R"(, "layout": {"chunk_elems_min": 0})", "chunk_elems_min");
  expect_refused("", R"(, "layout": {"chunk_elems_max": 3000000})", "chunk_elems_max");
}

TEST_F(ConfigValidation, ZeroWhereZeroMeansNothingIsAnError) {
  expect_refused("", R"(, "plan": {"grad_staging_slots": 0})", "plan.grad_staging_slots");
  expect_refused("", R"(, "plan": {"prefetch_depth_max": 0})", "plan.prefetch_depth_max");
  expect_refused("", R"(, "plan": {"nvme_families_in_flight": 0})", "plan.nvme_families_in_flight");
}

TEST_F(ConfigValidation, CombinationsTheRuntimeDoesNotSupport) {
  expect_refused("", R"(, "optimizer": {"name": "sgd"}, "precision": {"states": "bf16"})", "bf16");
  expect_refused("", R"(, "layout": {"chunk_elems": 4194304})", "3 chunk slots");
  expect_refused("", R"(, "plan": {"host_reserve": "32MiB"})", "plan.host_reserve");
  // budgets.gpu beyond the device's memory.
  std::string message;
  EXPECT_NE(
      create_through_c(
          R"({"device": {"kind": "sim", "budget": "8MiB"}, "budgets": {"gpu": "16MiB", "host": "32MiB"}})",
          &message),
      STRATA_OK);
  EXPECT_NE(message.find("device.budget"), std::string::npos) << message;
}

// 8-bit states (issue #49, Note [Q8 state chunks]): accepted for adamw and adam
// through the JSON config and the C ABI; refused, naming the pair and what to use,
// for an optimizer without an 8-bit rule, and as a compute dtype.
TEST_F(ConfigValidation, Q8StatesForAdamOnly) {
  for (const char* name : {"adamw", "adam"}) {
    std::string message;
    EXPECT_EQ(create_through_c(config_text("", fmt::format(R"(, "optimizer": {{"name": "{}"}}, )"
                                                           R"("precision": {{"states": "q8"}})",
                                                           name)),
                               &message),
              STRATA_OK)
        << name << ": " << message;
  }
  expect_refused(
      "", R"(, "optimizer": {"name": "lamb"}, "precision": {"states": "q8"})",
      "optimizer lamb has no 8-bit state rule; use precision.states (state_dtype) fp32 or bf16, or "
      "optimizer adamw or adam");
  expect_refused("", R"(, "optimizer": {"name": "sgd"}, "precision": {"states": "q8"})",
                 "optimizer sgd has no 8-bit state rule");
  expect_refused("", R"(, "precision": {"compute": "q8"})", "precision.compute");
  expect_refused("", R"(, "precision": {"states": "fp16"})", "use fp32, bf16 or q8");
  // strata_config_set, the C ABI's key setter.
  strata_config* cfg = nullptr;
  ASSERT_EQ(strata_config_new(&cfg), STRATA_OK);
  EXPECT_EQ(strata_config_set(cfg, "precision.states", "q8"), STRATA_OK) << strata_last_error();
  strata_config_free(cfg);
}

TEST_F(ConfigValidation, ValidateNeedsNoRuntime) {
  auto c = Config::from_json_text(config_text("", R"(, "layout": {"chunk_elems": 3})"));
  ASSERT_TRUE(c.ok()) << c.status();
  Status s = c->validate();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("layout.chunk_elems = 3"), std::string::npos) << s;
}

}  // namespace
}  // namespace strata
