// ScratchDir: Note [Stable scratch layout].
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "strata/common/scratch_dir.hpp"

namespace strata {
namespace {

namespace fs = std::filesystem;

class ScratchDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    parent_ = fs::temp_directory_path() / ("strata-test-scratch-" + std::to_string(::getpid()));
    fs::create_directories(parent_);
  }
  void TearDown() override { fs::remove_all(parent_); }
  fs::path parent_;
};

TEST_F(ScratchDirTest, SameNameEveryRunNoPid) {
  fs::path first;
  {
    auto dir = ScratchDir::create(parent_, "strata-tool");
    ASSERT_TRUE(dir.ok()) << dir.status();
    first = dir->path();
    EXPECT_EQ(first, parent_ / "strata-tool");
    auto again = ScratchDir::create(parent_, "strata-tool");  // a second run meanwhile finds the same one
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->path(), first);
  }
  EXPECT_FALSE(fs::exists(first)) << "removed at the end when empty";
}

TEST_F(ScratchDirTest, KeptWhileSomethingIsInIt) {
  fs::path kept;
  {
    auto dir = ScratchDir::create(parent_, "strata-tool");
    ASSERT_TRUE(dir.ok()) << dir.status();
    kept = dir->path();
    std::ofstream(kept / "strata-swap-0.swp") << "another run's file";
    ScratchDir moved = std::move(dir).value();  // moving hands the removal over
    EXPECT_EQ(moved.path(), kept);
  }
  EXPECT_TRUE(fs::exists(kept / "strata-swap-0.swp"))
      << "never removed with contents: another run may use it";
}

TEST_F(ScratchDirTest, MissingParentIsAnErrorAndIsNotCreated) {
  auto dir = ScratchDir::create(parent_ / "missing", "x");
  ASSERT_FALSE(dir.ok());
  EXPECT_EQ(dir.status().code(), StatusCode::kNotFound);
  EXPECT_NE(dir.status().message().find((parent_ / "missing").string()), std::string::npos) << dir.status();
  EXPECT_FALSE(fs::exists(parent_ / "missing"));
}

TEST_F(ScratchDirTest, BorrowedIsNeverRemoved) {
  { ScratchDir dir = ScratchDir::borrow(parent_); }
  EXPECT_TRUE(fs::exists(parent_));
}

}  // namespace
}  // namespace strata
