#pragma once
// The runtime's completion records come from strata::RecordPool (Note
// [Completion records] in strata/common/record_pool.hpp).

#include "strata/common/record_pool.hpp"

namespace strata::runtime {
using strata::RecordPool;
}  // namespace strata::runtime
