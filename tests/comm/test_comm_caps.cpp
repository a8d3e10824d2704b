// The communicators' capabilities (issue #26): the runtime asks these, never the
// backend's name.
#include <gtest/gtest.h>

#include "strata/comm/caps.hpp"
#include "strata/comm/local.hpp"

namespace strata::comm {
namespace {

TEST(CommCaps, LocalSumsInRankOrderOnHostBuffers) {
  auto g = make_local_group(2);
  ASSERT_TRUE(g.ok()) << g.status();
  for (const auto& c : *g) {
    EXPECT_TRUE(rank_ordered_sum(*c));
    EXPECT_FALSE(c->device_buffers());
    EXPECT_FALSE(needs_cuda_memory(*c));
  }
}

}  // namespace
}  // namespace strata::comm
