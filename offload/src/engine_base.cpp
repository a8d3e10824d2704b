#include "engine_base.hpp"

namespace strata::offload::detail {

EngineBase::EngineBase(IoEngineOptions options)
    : options_(std::move(options)),
      files_(options_.files_max),
      tracker_(options_.requests_in_flight_max, options_.queue_depth, options_.request_bytes) {}

Status EngineBase::submit(std::span<IoRequest> batch) {
  RequestTracker::Lock lock(mutex_);
  if (tracker_.stopping()) return failed_precondition("{} io engine is shut down; no new requests", name());
  for (const auto& request : batch) STRATA_RETURN_IF_ERROR(validate_request(request, options_, files_));
  std::vector<Completion> refused;
  for (auto& request : batch) {
    int fixed = fixed_buffer_for(request.buffer);
    if (!tracker_.admit(lock, request, fixed)) {
      // Note [Completion contract]: accepted but never started; completes here.
      refused.push_back(
          {std::move(request.on_done), cancelled("request not started: the engine was shut down")});
      continue;
    }
    start_admitted();  // before the next admit() may wait, so admitted work is moving
  }
  lock.unlock();
  run_completions(refused);
  return Status::Ok();
}

IoEngineStats EngineBase::stats() const {
  std::lock_guard lock(mutex_);
  return tracker_.stats;
}

void EngineBase::run_completions_unlocked(RequestTracker::Lock& lock, std::vector<Completion>& done) {
  if (done.empty()) return;
  std::size_t count = done.size();
  lock.unlock();
  run_completions(done);
  lock.lock();
  tracker_.callbacks_finished(count);
}

}  // namespace strata::offload::detail
