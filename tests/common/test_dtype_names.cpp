// The one DType and its one name table (common/dtype.hpp, Note [DType names];
// issue #26): names, sizes, every spelling parse_dtype reads, and the refusals.
#include <gtest/gtest.h>

#include "strata/common/dtype.hpp"
#include "strata/common/status.hpp"

namespace strata {
namespace {

constexpr DType kTensorDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST(DTypeNames, NamesAreTheConfigAndCheckpointSpellings) {
  EXPECT_EQ(dtype_name(DType::kF32), "fp32");
  EXPECT_EQ(dtype_name(DType::kBF16), "bf16");
  EXPECT_EQ(dtype_name(DType::kF16), "fp16");
  EXPECT_EQ(dtype_name(DType::kQ8), "q8");
  EXPECT_EQ(dtype_name(DType::kNone), "none");
  EXPECT_EQ(dtype_name(static_cast<DType>(7)), "unknown");
}

TEST(DTypeNames, SizesAreTheElementBytes) {
  static_assert(dtype_size(DType::kF32) == 4 && dtype_size(DType::kBF16) == 2 &&
                dtype_size(DType::kF16) == 2);
  static_assert(dtype_size(DType::kNone) == 0);
  static_assert(dtype_size(DType::kQ8) == 1);  // the code byte; the block scales are the chunk's
}

TEST(DTypeNames, QuantizedStatesParse) {
  auto parsed = parse_dtype("q8");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, DType::kQ8);
}

TEST(DTypeNames, EveryNameParsesBackToItsDType) {
  for (DType d : kTensorDTypes) {
    auto parsed = parse_dtype(dtype_name(d));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, d) << dtype_name(d);
  }
}

// Spellings written before the names were one table (the kernels' and comm's, in
// strata-bench optim's JSON) and torch's, which configs may use.
TEST(DTypeNames, OtherSpellingsParse) {
  const std::pair<const char*, DType> spellings[] = {
      {"f32", DType::kF32}, {"float32", DType::kF32}, {"bfloat16", DType::kBF16},
      {"f16", DType::kF16}, {"float16", DType::kF16},
  };
  for (auto [text, d] : spellings) {
    auto parsed = parse_dtype(text);
    ASSERT_TRUE(parsed.ok()) << text << ": " << parsed.status();
    EXPECT_EQ(*parsed, d) << text;
  }
}

TEST(DTypeNames, UnknownNamesAreRefusedNamingTheTextAndTheAccepted) {
  for (const char* text : {"none", "int8", "FP32", "", "fp32 ", "b16"}) {
    auto parsed = parse_dtype(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(fmt::format("dtype \"{}\" is not known", text)),
              std::string::npos)
        << parsed.status();
    EXPECT_NE(parsed.status().message().find("use fp32, bf16, fp16 (or q8 for optimizer states)"),
              std::string::npos)
        << parsed.status();
  }
}

}  // namespace
}  // namespace strata
