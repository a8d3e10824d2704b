#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "strata/common/scratch_dir.hpp"

namespace strata {
namespace {

namespace fs = std::filesystem;

TEST(ScratchDir, RemovesItselfAndItsContents) {
  fs::path kept;
  {
    auto dir = ScratchDir::create(fs::temp_directory_path(), "strata-test-scratch");
    ASSERT_TRUE(dir.ok()) << dir.status();
    kept = dir->path();
    ASSERT_TRUE(fs::is_directory(kept));
    std::ofstream(kept / "file") << "data";
    fs::create_directories(kept / "sub");
    ScratchDir moved = std::move(dir).value();  // moving hands the removal over
    EXPECT_EQ(moved.path(), kept);
    EXPECT_TRUE(fs::exists(kept / "file"));
  }
  EXPECT_FALSE(fs::exists(kept));
}

TEST(ScratchDir, UncreatableParentIsAnErrorNamingThePath) {
  auto dir = ScratchDir::create("/proc/strata-no-such-parent", "x");
  ASSERT_FALSE(dir.ok());
  EXPECT_NE(dir.status().message().find("/proc/strata-no-such-parent"), std::string::npos) << dir.status();
}

}  // namespace
}  // namespace strata
