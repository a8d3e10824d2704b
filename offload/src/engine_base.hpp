#pragma once
// EngineBase: what the uring and posix engines share — options, the lock, the
// file table, the request tracker, and submit() (validate the whole batch,
// then admit each request, blocking while full; Note [Bounded in flight]).

#include <mutex>
#include <span>
#include <vector>

#include "request_tracker.hpp"
#include "strata/offload/io_engine.hpp"

namespace strata::offload::detail {

class EngineBase : public IoEngine {
 public:
  const IoEngineOptions& options() const final { return options_; }
  Status submit(std::span<IoRequest> batch) final;
  IoEngineStats stats() const final;

 protected:
  explicit EngineBase(IoEngineOptions options);

  //! Lock held: a request was just admitted; start what can be started.
  virtual void start_admitted() = 0;
  //! Lock held: the fixed buffer index holding `buffer`, or -1.
  virtual int fixed_buffer_for(std::span<const std::byte> buffer) const = 0;
  //! Runs `done` with the lock released, then marks them finished. Lock held on entry and exit.
  void run_completions_unlocked(RequestTracker::Lock& lock, std::vector<Completion>& done);

  IoEngineOptions options_;
  mutable std::mutex mutex_;  // guards everything below (and the uring SQ)
  FileTable files_;
  RequestTracker tracker_;
  bool shut_down_ = false;
};

}  // namespace strata::offload::detail
