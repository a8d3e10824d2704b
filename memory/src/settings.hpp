#pragma once
// Parsing of text settings shared by DeviceOptions, PinnedHostPoolOptions and
// DevicePoolOptions (sizes use parse_bytes from common/). Internal to memory/.

#include <cstdint>
#include <string_view>

#include "strata/common/status.hpp"

namespace strata::memory::detail {

//! A whole number ("64"); InvalidArgument naming `setting` and the value otherwise.
Result<std::uint64_t> parse_count(std::string_view setting, std::string_view text);
//! true/false, 1/0, on/off, yes/no; InvalidArgument naming `setting` otherwise.
Result<bool> parse_bool(std::string_view setting, std::string_view text);

}  // namespace strata::memory::detail
