#pragma once
// The one table of status-code names (issue #26): status_code_name's CamelCase
// ("OutOfBudget", in messages and logs) and the C ABI's snake_case
// ("out_of_budget", strata_status_name) are two columns of it, in status.cpp.
// (A header of its own rather than status.hpp, which every file includes.)

#include <optional>
#include <string_view>

#include "strata/common/status.hpp"

namespace strata {

//! The code's snake_case name, e.g. "out_of_budget" (the C ABI's strata_status_name).
//! Never fails.
std::string_view status_code_id(StatusCode code);
//! The code whose number is `value` (the C ABI's strata_status); nullopt past the last.
std::optional<StatusCode> status_code_from_int(int value);

}  // namespace strata
