// The nccl backend's factory on every build: with NCCL compiled in it refuses
// deterministic mode before touching CUDA (NCCL has no rank-ordered sum); in a
// build without NCCL it says so. Its collectives need GPUs (not run here).
#include <gtest/gtest.h>

#include "strata/comm/local.hpp"
#include "strata/comm/nccl.hpp"

namespace strata::comm {
namespace {

TEST(NcclComm, FactoryRefusesWhatItCannotDoWithAMessage) {
  auto group = make_local_group(1);
  ASSERT_TRUE(group.ok());
  auto c = make_nccl_communicator(*(*group)[0], nullptr, {.deterministic = true});
  ASSERT_FALSE(c.ok());
  if (nccl_compiled()) {
    EXPECT_EQ(c.status(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find("deterministic"), std::string::npos) << c.status();
  } else {
    EXPECT_EQ(c.status(), StatusCode::kUnavailable);
    EXPECT_NE(c.status().message().find("no NCCL backend"), std::string::npos) << c.status();
  }
}

}  // namespace
}  // namespace strata::comm
