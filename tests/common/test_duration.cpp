#include <gtest/gtest.h>

#include "strata/common/duration.hpp"

namespace strata {
namespace {

TEST(Duration, ParsesUnits) {
  EXPECT_DOUBLE_EQ(parse_seconds("3").value(), 3.0);
  EXPECT_DOUBLE_EQ(parse_seconds(" 3s ").value(), 3.0);
  EXPECT_DOUBLE_EQ(parse_seconds("500ms").value(), 0.5);
  EXPECT_DOUBLE_EQ(parse_seconds("250 us").value(), 250e-6);
  EXPECT_DOUBLE_EQ(parse_seconds("1.5m").value(), 90.0);
  EXPECT_DOUBLE_EQ(parse_seconds("2H").value(), 7200.0);
  EXPECT_DOUBLE_EQ(parse_seconds("0").value(), 0.0);
}

TEST(Duration, RefusesBadTextNamingTheSetting) {
  for (const char* bad :
       {"", "-1", "-1s", "abc", "1x", "1.2.3", "nan", "inf", "1e3", "25h", "s", ".", "1 s s"}) {
    auto r = parse_seconds(bad, "--nvme-seconds");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("--nvme-seconds"), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace strata
