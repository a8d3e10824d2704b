#pragma once
// Durations: parsing "3", "3s", "500ms", "1.5m" (the probe's time bounds).

#include <string_view>

#include "strata/common/status.hpp"

namespace strata {

//! Longest duration parse_seconds accepts: one day.
inline constexpr double kSecondsMax = 86400.0;

//! Parses a duration in seconds: a non-negative decimal number and an optional
//! unit (us, ms, s, m, h; none = seconds), spaces allowed around them. Fails
//! (InvalidArgument naming `setting` and the text, with the accepted forms) on an
//! empty or unparsable text, an unknown unit, a negative, NaN or infinite value,
//! or one above kSecondsMax. 0 is accepted: the caller says whether it means anything.
Result<double> parse_seconds(std::string_view text, std::string_view setting = "duration");

}  // namespace strata
