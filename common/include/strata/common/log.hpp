#pragma once
// One logger for all of strata (spdlog, name "strata", stderr).
//
// The level comes from STRATA_LOG_LEVEL (trace, debug, info, warn, error, off;
// default info) when the logger is first used, and can be changed with
// set_log_level(). Fallbacks (no GPU, no io_uring, no mlock, no O_DIRECT, no huge
// pages) are logged at info or warn so that a user can always see which path ran.
// Thread-safe.

#include <spdlog/spdlog.h>

#include <string_view>

namespace strata {

//! The strata logger. Created on first use; never null; thread-safe.
spdlog::logger& logger();

//! Sets the level by name; returns false (level unchanged) for an unknown name.
bool set_log_level(std::string_view level);

}  // namespace strata

#define STRATA_LOG_TRACE(...) ::strata::logger().trace(__VA_ARGS__)
#define STRATA_LOG_DEBUG(...) ::strata::logger().debug(__VA_ARGS__)
#define STRATA_LOG_INFO(...) ::strata::logger().info(__VA_ARGS__)
#define STRATA_LOG_WARN(...) ::strata::logger().warn(__VA_ARGS__)
#define STRATA_LOG_ERROR(...) ::strata::logger().error(__VA_ARGS__)
