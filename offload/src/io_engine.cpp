#include "strata/offload/io_engine.hpp"

#include "posix_engine.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "uring_engine.hpp"

namespace strata::offload {

namespace {
constexpr std::uint32_t kQueueDepthMax = 4096;
constexpr std::uint32_t kRequestsInFlightMax = 1u << 16;
constexpr std::uint32_t kFilesMax = 1u << 15;
}  // namespace

Status validate_io_engine_options(const IoEngineOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > kQueueDepthMax) {
    return invalid_argument("io engine queue_depth={}: must be in [1, {}]", options.queue_depth,
                            kQueueDepthMax);
  }
  if (options.alignment_bytes == 0 || !is_pow2(options.alignment_bytes)) {
    return invalid_argument("io engine alignment_bytes={}: must be a power of two (4096 for O_DIRECT)",
                            options.alignment_bytes);
  }
  if (options.request_bytes == 0 || options.request_bytes % options.alignment_bytes != 0) {
    return invalid_argument("io engine request_bytes={}: must be a positive multiple of alignment_bytes={}",
                            options.request_bytes, options.alignment_bytes);
  }
  if (options.requests_in_flight_max == 0 || options.requests_in_flight_max > kRequestsInFlightMax) {
    return invalid_argument("io engine requests_in_flight_max={}: must be in [1, {}]",
                            options.requests_in_flight_max, kRequestsInFlightMax);
  }
  if (options.files_max == 0 || options.files_max > kFilesMax) {
    return invalid_argument("io engine files_max={}: must be in [1, {}]", options.files_max, kFilesMax);
  }
  for (auto region : options.fixed_buffer_regions) {
    if (region.empty()) return invalid_argument("io engine fixed_buffer_regions: an empty region was given");
  }
  return Status::Ok();
}

// Note [Engine fallback]
// kAuto tries io_uring first. io_uring_queue_init fails with ENOSYS on kernels
// without it, EPERM where a container's seccomp profile or
// kernel.io_uring_disabled forbids it, and ENOMEM when the ring cannot be
// allocated (memlock limits on older kernels). Each of those — and any other
// setup failure — falls back to the posix engine, and the log says why at warn
// level, so a slower run is never a silent one. kUring reports the failure
// instead; kPosix never touches io_uring.
Result<std::unique_ptr<IoEngine>> make_io_engine(IoEngineOptions options) {
  STRATA_RETURN_IF_ERROR(validate_io_engine_options(options));
  switch (options.kind) {
    case EngineKind::kPosix:
      STRATA_LOG_INFO("io engine: posix (selected by configuration)");
      return detail::PosixEngine::create(std::move(options));
    case EngineKind::kUring: {
      auto engine = detail::UringEngine::create(options);
      if (!engine.ok()) {
        return unavailable(
            "io engine kind=uring was requested but io_uring cannot be set up: {}; use kind=auto "
            "to fall back to the posix engine",
            engine.status().message());
      }
      return engine;
    }
    case EngineKind::kAuto: {
      auto engine = detail::UringEngine::create(options);
      if (engine.ok()) {
        STRATA_LOG_DEBUG("io engine: uring");
        return engine;
      }
      STRATA_LOG_WARN(
          "io engine: io_uring cannot be set up ({}); falling back to the posix thread-pool engine",
          engine.status().to_string());
      options.kind = EngineKind::kPosix;
      return detail::PosixEngine::create(std::move(options));
    }
  }
  STRATA_UNREACHABLE();
}

IoGroup::~IoGroup() {
  std::lock_guard lock(mutex_);
  STRATA_CHECK_MSG(pending_ == 0, "IoGroup destroyed with callbacks outstanding; call wait() first");
}

IoCallback IoGroup::add() {
  std::lock_guard lock(mutex_);
  ++pending_;
  return [this](Status status) { done(std::move(status)); };
}

void IoGroup::cancel_one() {
  std::lock_guard lock(mutex_);
  STRATA_CHECK(pending_ > 0);
  --pending_;
  if (pending_ == 0) cv_.notify_all();
}

void IoGroup::done(Status status) {
  // Notify under the lock: once wait() sees pending_ == 0 it may return and the
  // group may be destroyed, so nothing may touch `this` after the unlock.
  std::lock_guard lock(mutex_);
  STRATA_CHECK(pending_ > 0);
  if (!status.ok() && first_failure_.ok()) first_failure_ = std::move(status);
  --pending_;
  if (pending_ == 0) cv_.notify_all();
}

Status IoGroup::wait() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return pending_ == 0; });
  Status result = std::move(first_failure_);
  first_failure_ = Status::Ok();
  return result;
}

std::future<Status> submit_future(IoEngine& engine, IoRequest request) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
  request.on_done = [promise](Status status) { promise->set_value(std::move(status)); };
  Status submitted = engine.submit_one(std::move(request));
  if (!submitted.ok()) promise->set_value(std::move(submitted));
  return future;
}

Status start_and_wait(const std::function<Status(IoCallback)>& start) {
  IoGroup group;
  Status started = start(group.add());
  if (!started.ok()) {
    group.cancel_one();
    return started;
  }
  return group.wait();
}

Status submit_and_wait(IoEngine& engine, IoRequest request) {
  return start_and_wait([&](IoCallback done) {
    request.on_done = std::move(done);
    return engine.submit_one(std::move(request));
  });
}

}  // namespace strata::offload
