#pragma once
// The kinds of state a chunk family holds, one chunk of each: what a lease is on
// and what a checkpoint saves. Defined in strata_plan (plan/tensor.cpp), so the
// checkpoint library names them without the runtime.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata::runtime {

//! Which chunk of a family a lease is on.
enum class StateKind : std::uint8_t { kParam, kGrad, kMaster, kState0, kState1 };
inline constexpr std::size_t kStateKindCount = 5;
//! "param", "grad", "master", "state0", "state1" (the checkpoint manifest's names).
std::string_view state_kind_name(StateKind kind);

//! The kinds the optimizer owns (they live where the family's optimizer states live).
inline bool is_optim_kind(StateKind k) {
  return k == StateKind::kMaster || k == StateKind::kState0 || k == StateKind::kState1;
}

}  // namespace strata::runtime
