#pragma once
// FaultInjectingEngine: an IoEngine that wraps a real one (uring or posix) and,
// from a seed, injects the faults a disk and a kernel can produce.
//
// Note [Where faults are injected]
// Transfer-level faults go in through the inner engine's result filter, so the
// real engine's own code handles them: EIO (the engine turns it into an IoError
// naming file and offset), short transfers (the engine resubmits the remainder)
// and EINTR/EAGAIN (the engine retries). Completion-level faults happen in the
// wrapper: delays, and reordering of completions across requests. The seed is
// logged at creation and available from seed(); a failing test prints it. With
// real I/O on several threads the exact interleaving is not reproducible, but
// the kinds and rates of faults are.

#include <cstdint>
#include <memory>
#include <string>

#include "strata/common/status.hpp"
#include "strata/offload/io_engine.hpp"

namespace strata::offload {

//! Probabilities are per transfer attempt (transfer-level) or per request (completion-level), in [0, 1].
struct FaultOptions {
  std::uint64_t seed = 1;
  double eio_probability = 0.0;    //!< a transfer fails with EIO
  double short_probability = 0.0;  //!< a transfer moves only an aligned prefix
  double eintr_probability = 0.0;  //!< a transfer fails with EINTR or EAGAIN (retried)
  double delay_probability = 0.0;  //!< a completion is held back up to delay_us_max
  std::uint32_t delay_us_max = 2000;
  bool reorder = false;  //!< completions are delivered in a seeded random order
};

//! Counts of injected faults so far.
struct FaultStats {
  std::uint64_t eio = 0;
  std::uint64_t short_transfers = 0;
  std::uint64_t eintr = 0;
  std::uint64_t delays = 0;
  std::uint64_t reordered = 0;  //!< completions delivered before an older one
};

//! Thread-safe like any IoEngine. Callbacks run on the wrapper's delivery thread.
class FaultInjectingEngine final : public IoEngine {
 public:
  //! Builds the inner engine from `inner` (kind as usual; its result_filter
  //! must be empty: the wrapper installs its own) and starts the delivery thread.
  //! Fails as make_io_engine, or InvalidArgument for a probability outside [0, 1].
  static Result<std::unique_ptr<FaultInjectingEngine>> create(IoEngineOptions inner, FaultOptions faults);
  ~FaultInjectingEngine() override;

  std::string_view name() const override { return name_; }
  const IoEngineOptions& options() const override;
  Result<FileId> register_file(int fd, std::string_view label) override;
  Status unregister_file(FileId file) override;
  //! As IoEngine::submit; a batch larger than requests_in_flight_max is passed
  //! on in parts, and a part refused by the inner engine leaves earlier parts accepted.
  Status submit(std::span<IoRequest> batch) override;
  void shutdown(ShutdownMode mode) override;
  IoEngineStats stats() const override;

  std::uint64_t seed() const;
  FaultStats fault_stats() const;

  struct State;  //!< shared with the inner engine's filter and callbacks; defined in the .cpp

 private:
  FaultInjectingEngine() = default;
  std::shared_ptr<State> state_;
  std::unique_ptr<IoEngine> inner_;
  std::string name_;
};

}  // namespace strata::offload
