#pragma once
// The sim device the runtime tests run on.

#include <gtest/gtest.h>

#include <memory>

#include "strata/common/bytes.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::runtime::testing {

inline std::unique_ptr<memory::Device> sim_device(std::uint64_t budget = 256 * kMiB) {
  memory::DeviceOptions o;
  o.kind = memory::DeviceChoice::kSim;
  o.budget_bytes = budget;
  auto d = memory::make_device(o);
  EXPECT_TRUE(d.ok()) << d.status();
  return std::move(d).value();
}

}  // namespace strata::runtime::testing
