#include "strata/common/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <memory>
#include <string>

namespace strata {
namespace {

std::shared_ptr<spdlog::logger> make_logger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto log = std::make_shared<spdlog::logger>("strata", std::move(sink));
  log->set_pattern("[%H:%M:%S.%e] [strata] [%^%l%$] %v");
  log->set_level(spdlog::level::info);
  if (const char* env = std::getenv("STRATA_LOG_LEVEL")) {
    auto level = spdlog::level::from_str(env);
    // from_str maps unknown names to "off"; only accept a real "off".
    if (level != spdlog::level::off || std::string(env) == "off") log->set_level(level);
  }
  log->flush_on(spdlog::level::warn);
  return log;
}

}  // namespace

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = make_logger();
  return *instance;
}

bool set_log_level(std::string_view level) {
  std::string name(level);
  auto parsed = spdlog::level::from_str(name);
  if (parsed == spdlog::level::off && name != "off") return false;
  logger().set_level(parsed);
  return true;
}

}  // namespace strata
