#pragma once
// ErrorState: the runtime's errors between calls (under Core::mu, Note [Lock
// discipline]). Two kinds, kept apart:
// - the background error: the first failure of work no public call waits for (a
//   write-back, an optimizer run, a read the step needs). It is sticky: every
//   public call returns it until a failed step is discarded (Note [Failed steps]).
// - a failed prefetch (Note [Prefetch errors] in eviction.cpp): a read ahead of
//   use that failed with nothing changed. It is logged, counted for StepStats,
//   and returned once by the next public call; the use reads it again.

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "strata/common/status.hpp"

namespace strata::runtime {

class ErrorState {
 public:
  //! Records the first background error (and logs it); later ones are dropped.
  void fail(Status status);
  //! Adds what else the background error left undone to its message ("...; more").
  void append(std::string_view more) {
    if (!background_.ok())
      background_ = Status(background_.code(), fmt::format("{}; {}", background_.message(), more));
  }
  //! Records a failed prefetch: logged, counted, kept for the next public call.
  void prefetch_failed(Status status);
  //! What a public call returns before it does anything: the background error,
  //! else take_prefetch().
  Status take();
  //! A failed prefetch not returned yet, then forgotten (returned once); else Ok.
  Status take_prefetch() { return std::exchange(prefetch_, Status::Ok()); }
  //! The background error (Ok when none).
  const Status& background() const { return background_; }
  bool failed() const { return !background_.ok(); }
  //! A failed step was discarded (Note [Failed steps]): both errors are forgotten.
  void clear() {
    background_ = Status::Ok();
    prefetch_ = Status::Ok();
  }
  //! Failed prefetches since the last call, and the first one's message; both reset.
  struct PrefetchCount {
    std::uint64_t count = 0;
    std::string first;
  };
  PrefetchCount take_prefetch_count() {
    return {.count = std::exchange(prefetch_count_, 0), .first = std::exchange(first_prefetch_, {})};
  }

 private:
  Status background_;
  Status prefetch_;  //!< a failed prefetch no public call has returned yet
  std::uint64_t prefetch_count_ = 0;
  std::string first_prefetch_;
};

}  // namespace strata::runtime
