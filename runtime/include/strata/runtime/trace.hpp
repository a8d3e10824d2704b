#pragma once
// The Tracer's record of one step, and farthest-next-use (Belady) queries on it.
//
// Note [Cyclic access sequence]
// Training repeats the same order of chunk uses every step (forward, backward,
// optimizer), so the warm-up step's sequence, read cyclically, tells exactly when
// each family is used next. Evicting the resident family whose next use is
// farthest is then Belady's optimal policy, not a heuristic.

#include <cstdint>
#include <vector>

#include "strata/runtime/tensor.hpp"

namespace strata::runtime {

//! Phase of the step in which a use happened.
enum class Phase : std::uint8_t { kForward, kBackward };

//! One use of a family: consecutive acquisitions of the same family and phase
//! are merged into one use.
struct FamilyUse {
  FamilyId family = 0;
  Phase phase = Phase::kForward;
  bool writes_grad = false;  //!< a grad of this family was written during this use
  double compute_s = 0.0;    //!< device compute time attributed to this use
};

//! The recorded sequence of one step plus its memory peak. A plain value.
struct StepTrace {
  std::vector<FamilyUse> uses;
  std::uint64_t non_chunk_peak_bytes = 0;  //!< device bytes in use outside chunks, at peak
  double compute_total_s() const;
};

//! Per family, the index in `trace` of its last backward use (when its gradient
//! completes); -1 for a family with none. Families >= family_count are ignored.
std::vector<long> last_backward_use(const StepTrace& trace, std::size_t family_count);

//! Records uses during the warm-up step. Not thread-safe: the runtime calls it
//! under its lock.
class Tracer {
 public:
  //! Appends a use (merged with the previous one when the family and phase match).
  void record(FamilyId family, Phase phase, bool writes_grad);
  const StepTrace& trace() const { return trace_; }
  //! Hands the trace over and keeps room for as many uses, so recording the next
  //! step allocates nothing (Note [Allocation-free hot paths] in runtime/src/leases.cpp).
  StepTrace take();
  //! Takes back a trace that is no longer needed: the step after next records
  //! into its room.
  void give_back(StepTrace trace) { spare_ = std::move(trace); }

 private:
  StepTrace trace_;
  StepTrace spare_;
};

//! Next-use queries over a cyclic sequence of family ids. Immutable after build.
class NextUse {
 public:
  NextUse() = default;
  NextUse(const std::vector<FamilyUse>& uses, std::size_t family_count);

  //! Distance (in uses, >= 1) from position `pos` to the next use of `family`
  //! after it, reading the sequence cyclically; kNever when the family is unused.
  std::uint64_t distance(FamilyId family, std::size_t pos) const;

  std::size_t length() const { return length_; }
  static constexpr std::uint64_t kNever = ~std::uint64_t{0};

 private:
  std::size_t length_ = 0;
  std::vector<std::vector<std::uint32_t>> positions_;  // per family, ascending
};

}  // namespace strata::runtime
