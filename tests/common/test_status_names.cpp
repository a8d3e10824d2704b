// The one status-name table (issue #26): CamelCase for messages, snake_case for the
// C ABI, one row per code.
#include <gtest/gtest.h>

#include <cctype>
#include <string>

#include "strata/common/status_names.hpp"

namespace strata {
namespace {

std::string snake(std::string_view camel) {
  std::string out;
  for (char c : camel) {
    if (std::isupper(static_cast<unsigned char>(c)) != 0 && !out.empty()) out += '_';
    out += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return out;
}

TEST(StatusNames, EveryCodeHasBothNamesInOneRow) {
  int codes = 0;
  for (int i = 0;; ++i) {
    const std::optional<StatusCode> code = status_code_from_int(i);
    if (!code) break;
    ++codes;
    EXPECT_EQ(static_cast<int>(*code), i);
    const std::string_view name = status_code_name(*code);
    const std::string_view id = status_code_id(*code);
    EXPECT_EQ(id, *code == StatusCode::kOk ? "ok" : snake(name)) << name;
  }
  EXPECT_EQ(codes, static_cast<int>(StatusCode::kInternal) + 1);
  EXPECT_EQ(status_code_id(StatusCode::kOutOfBudget), "out_of_budget");
  EXPECT_EQ(status_code_name(StatusCode::kOutOfBudget), "OutOfBudget");
  EXPECT_FALSE(status_code_from_int(-1));
  EXPECT_EQ(status_code_id(static_cast<StatusCode>(200)), "unknown");
  EXPECT_EQ(status_code_name(static_cast<StatusCode>(200)), "Unknown");
}

}  // namespace
}  // namespace strata
