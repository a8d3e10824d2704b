#include <gtest/gtest.h>

#include "strata/common/bytes.hpp"

namespace strata {
namespace {

TEST(Bytes, ParsesUnits) {
  EXPECT_EQ(*parse_bytes("0"), 0u);
  EXPECT_EQ(*parse_bytes("4096"), 4096u);
  EXPECT_EQ(*parse_bytes("8GiB"), 8 * kGiB);
  EXPECT_EQ(*parse_bytes("8 gib"), 8 * kGiB);
  EXPECT_EQ(*parse_bytes("512MiB"), 512 * kMiB);
  EXPECT_EQ(*parse_bytes("4K"), 4 * kKiB);
  EXPECT_EQ(*parse_bytes("1.5G"), 3 * kGiB / 2);
  EXPECT_EQ(*parse_bytes("2GB"), 2000000000u);
  EXPECT_EQ(*parse_bytes("  1 TiB "), kTiB);
  EXPECT_EQ(*parse_bytes("16B"), 16u);
}

TEST(Bytes, RejectsMalformed) {
  for (const char* bad :
       {"", "12XB", "-1GiB", "GiB", "1.2.3G", "0.5B", "99999999999999999999", "20000000TiB", "1e9", "."}) {
    Result<std::uint64_t> r = parse_bytes(bad, "host_budget");
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(r.status().message().find("host_budget"), std::string::npos) << r.status().message();
    }
  }
  EXPECT_NE(parse_bytes("12XB").status().message().find("unknown unit \"XB\""), std::string::npos);
}

TEST(Bytes, Formats) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(4096), "4.00 KiB");
  EXPECT_EQ(format_bytes(3 * kGiB / 2), "1.50 GiB");
  EXPECT_EQ(format_bytes(kTiB), "1.00 TiB");
}

TEST(Bytes, Alignment) {
  EXPECT_TRUE(is_pow2(4096));
  EXPECT_FALSE(is_pow2(0));
  EXPECT_FALSE(is_pow2(3000));
  EXPECT_EQ(align_up(1, 4096), 4096u);
  EXPECT_EQ(align_up(4096, 4096), 4096u);
  EXPECT_EQ(align_down(4097, 4096), 4096u);
  EXPECT_EQ(div_ceil(10, 3), 4u);
}

}  // namespace
}  // namespace strata
