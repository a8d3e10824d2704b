#pragma once
// Test helpers for tests/memory: streaming a Status into a GoogleTest message, and
// LogCapture, which collects what the strata logger prints while it is alive, so tests can
// assert that a fallback was logged. Create it before the code under test runs and read
// text() when that code no longer logs from other threads.

#include <spdlog/sinks/ostream_sink.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>

#include "strata/common/log.hpp"
#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"

namespace strata {
//! Lets tests write `EXPECT_TRUE(s.ok()) << s;`.
inline std::ostream& operator<<(std::ostream& os, const Status& status) {
  return os << status.to_string();
}
}  // namespace strata

namespace strata::testing {

//! Queues on `stream` a host function that holds the stream until `gate` opens, then runs
//! `then` (tests of event order: work queued behind it, or waiting for it, must not run first).
inline Status launch_held(memory::Device& device, const memory::Stream& stream, const std::atomic<bool>& gate,
                          std::function<void()> then) {
  return device.launch_host(stream, [&gate, then = std::move(then)] {
    while (!gate.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    then();
  });
}

class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(stream_)) {
    sink_->set_pattern("[%l] %v");
    logger().sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& sinks = logger().sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  //! Everything logged so far.
  std::string text() {
    logger().flush();
    return stream_.str();
  }
  bool contains(const std::string& needle) { return text().find(needle) != std::string::npos; }

 private:
  std::ostringstream stream_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

}  // namespace strata::testing
