#include <gtest/gtest.h>

#include <cerrno>

#include "strata/common/status.hpp"

namespace strata {
namespace {

Result<int> half(int x) {
  if (x % 2 != 0) return invalid_argument("x = {} is odd; pass an even number", x);
  return x / 2;
}

Result<int> quarter(int x) {
  int h = 0;
  STRATA_ASSIGN_OR_RETURN(h, half(x));
  return half(h);
}

Status check_even(int x) {
  STRATA_RETURN_IF_ERROR(half(x).status());
  return Status::Ok();
}

TEST(Status, OkAndFailed) {
  EXPECT_TRUE(Status::Ok().ok());
  Status s = out_of_budget("gpu budget {} exceeded", 7);
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kOutOfBudget);
  EXPECT_EQ(s.to_string(), "OutOfBudget: gpu budget 7 exceeded");
  s.with_context("allocating chunk 3");
  EXPECT_EQ(s.message(), "allocating chunk 3: gpu budget 7 exceeded");
}

TEST(Status, ResultPropagates) {
  EXPECT_EQ(*quarter(8), 2);
  Result<int> r = quarter(6);  // 6/2 = 3 is odd
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("x = 3"), std::string::npos);
  EXPECT_TRUE(check_even(4).ok());
  EXPECT_FALSE(check_even(5).ok());
}

TEST(Status, ErrnoMapping) {
  EXPECT_EQ(errno_status(ENOSPC, "write").code(), StatusCode::kNoSpace);
  EXPECT_EQ(errno_status(ENOENT, "open").code(), StatusCode::kNotFound);
  EXPECT_EQ(errno_status(EPERM, "mlock").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(errno_status(EIO, "read").code(), StatusCode::kIoError);
  EXPECT_NE(errno_status(EIO, "read /x").message().find("read /x"), std::string::npos);
}

TEST(StatusDeathTest, ValueOfFailedResultAborts) {
  Result<int> r = invalid_argument("bad");
  EXPECT_DEATH((void)r.value(), "failed Result");
}

}  // namespace
}  // namespace strata
