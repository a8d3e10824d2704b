#pragma once
// FamilyRun: one family's optimizer work in the current step, as the state
// machines of Note [Family run states], each with its table of allowed moves.
// OptimizerPipeline (optimizer_pipeline.hpp) owns one per family and is the only
// writer; Runtime::check_invariants reads them.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/nvme_tier.hpp"  // NvmePiece; TensorId
#include "strata/common/assert.hpp"
#include "strata/common/status.hpp"

namespace strata::runtime {

// Note [Family run states]
// A family's progress through one step is seven small state machines, each changed
// only through FamilyRun::move_* (which checks the transition against the
// *_move_allowed table beside it):
//   phase: idle -> waiting (launched: gradients complete) -> computing (the CPU
//          kernel is queued or running) -> done; waiting -> done (a device
//          optimizer, or an error); a second completion in one step starts over.
//   grad (where its gradient is on host): none -> copying (d2h into a buffer in
//          flight) -> ready (landed in that buffer); copying -> in_chunk (it was
//          on host already: the grad chunk's own host copy, no buffer, no copy);
//          copying|ready|in_chunk -> none (given back).
//   room (which room counts the landed gradient, Note [Pipeline places]): none ->
//          staging (a grad staging buffer's) or held (a deferred update's, Note
//          [Deferred updates]: a parked run's) -> none; none exactly when grad is.
//   place (its NVMe place, Note [Pipeline places]): none -> reading -> ready;
//          none -> ready (nothing to read); ready -> reading (an NVMe-homed param
//          fetched once the gradients are in, Note [NVMe-homed params]);
//          reading -> cancelling (a read-ahead
//          given up: released when the reads end); any -> none (released, or
//          handed to the write-back).
//   param (an NVMe-homed param's read while the place is taken): none ->
//          awaits_gradients (the states are read, the param is copied from its
//          staging buffer or read once the gradients are in) -> none (fetched,
//          or the place released).
//   deferral (Note [Deferred updates]): none -> parked (launched, its update held
//          for the next forward) -> carried (its step ended: it runs in the next
//          forward with that step's hyperparameters) -> none (it ended); parked ->
//          none (it goes ahead in its own step after all).
//   outcome (what its kernel did): pending -> applied | not_applied (Inf/NaN
//          skipped it), once a record; an error or a dropped run stays pending.
// A new record (FamilyRun::reset: a new step, or a second completion) starts every
// machine at its first state; the checks of Runtime::check_invariants tie them
// together (a parked run is running and placeless, a carried one running, ...).

enum class FamilyPhase : std::uint8_t { kIdle, kWaiting, kComputing, kDone };
enum class GradStaging : std::uint8_t { kNone, kCopying, kReady, kInChunk };
enum class GradRoom : std::uint8_t { kNone, kStaging, kHeld };
enum class NvmePlace : std::uint8_t { kNone, kReading, kReady, kCancelling };
enum class ParamRead : std::uint8_t { kNone, kAwaitsGradients };
enum class Deferral : std::uint8_t { kNone, kParked, kCarried };
enum class RunOutcome : std::uint8_t { kPending, kApplied, kNotApplied };

constexpr bool phase_move_allowed(FamilyPhase from, FamilyPhase to) {
  using P = FamilyPhase;
  return (from == P::kIdle && to == P::kWaiting) || (from == P::kWaiting && to != P::kIdle) ||
         (from == P::kComputing && to == P::kDone);
}
constexpr bool grad_move_allowed(GradStaging from, GradStaging to) {
  using G = GradStaging;
  switch (from) {
    case G::kNone:
      return to == G::kCopying;
    case G::kCopying:
      return to != G::kCopying;
    case G::kReady:
    case G::kInChunk:
      return to == G::kNone;
  }
  return false;
}
constexpr bool room_move_allowed(GradRoom from, GradRoom to) {
  return (from == GradRoom::kNone) != (to == GradRoom::kNone);
}
constexpr bool place_move_allowed(NvmePlace from, NvmePlace to) {
  using N = NvmePlace;
  switch (from) {
    case N::kNone:
      return to == N::kReading || to == N::kReady;
    case N::kReading:
      return to != N::kReading;
    case N::kReady:
      return to == N::kNone || to == N::kReading;
    case N::kCancelling:
      return to == N::kNone || to == N::kCancelling;
  }
  return false;
}
constexpr bool param_move_allowed(ParamRead from, ParamRead to) {
  return from != to;
}
constexpr bool deferral_move_allowed(Deferral from, Deferral to) {
  using D = Deferral;
  return (from == D::kNone && to == D::kParked) || (from == D::kParked && to != D::kParked) ||
         (from == D::kCarried && to == D::kNone);
}
constexpr bool outcome_move_allowed(RunOutcome from, RunOutcome to) {
  return from == RunOutcome::kPending && to != RunOutcome::kPending;
}

//! A family's optimizer work in the current step (Note [Family run states]).
struct FamilyRun {
  FamilyPhase phase = FamilyPhase::kIdle;
  GradStaging grad = GradStaging::kNone;
  GradRoom room = GradRoom::kNone;
  NvmePlace place = NvmePlace::kNone;
  //! awaits_gradients: the states are read (or being read) and the NVMe-homed param
  //! is not: it is copied from its staging buffer, or read, once the gradients are
  //! in (maybe_compute).
  ParamRead param = ParamRead::kNone;
  //! Note [Deferred updates]: parked: launched this step, its update held for the
  //! next forward; its gradient lands in a deferred update's room, and it takes no
  //! NVMe place until step() ends. carried: a parked run whose step has ended: it
  //! runs during the next forward, with its step's hyperparameters
  //! (calls_[f].hypers, captured then) and carried_scale.
  Deferral deferral = Deferral::kNone;
  RunOutcome outcome = RunOutcome::kPending;
  //! The gradient on host: a grad staging buffer, or the grad chunk's own host copy (kInChunk).
  std::byte* grad_host = nullptr;
  std::vector<std::byte*> staging;  //!< per kind: NVMe states and the param being updated
  std::vector<NvmePiece> pieces;    //!< the NVMe reads of read_states (in flight while io_pending)
  //! The NVMe-homed param's staging copy read_states copies instead of reading the
  //! disk (Residency::lend_staged; one of io_pending until given back).
  const std::byte* lent_param = nullptr;
  float carried_scale = 1.0f;
  std::uint64_t launched_in = 0;  //!< OptimizerPipeline::steps_done_ when launched (its step's index - 1)
  int io_pending = 0;
  Status io_status;
  std::vector<TensorId> updated;  //!< tensors the kernel updated (committed with the param)

  //! Back to a new step's record; the vectors keep their capacity (Note
  //! [Allocation-free hot paths] in leases.cpp).
  void reset() {
    std::vector<std::byte*> s = std::move(staging);
    std::vector<TensorId> u = std::move(updated);
    std::vector<NvmePiece> p = std::move(pieces);
    *this = FamilyRun{};
    s.clear();
    u.clear();
    p.clear();
    staging = std::move(s);
    updated = std::move(u);
    pieces = std::move(p);
  }

  //! Gradients complete, optimizer requested (this step).
  bool launched() const { return phase != FamilyPhase::kIdle; }
  //! Launched and not finished.
  bool running() const { return phase == FamilyPhase::kWaiting || phase == FamilyPhase::kComputing; }
  void move_phase(FamilyPhase to) { move<phase_move_allowed>("phase", phase, to); }
  void move_grad(GradStaging to) { move<grad_move_allowed>("grad", grad, to); }
  void move_place(NvmePlace to) { move<place_move_allowed>("place", place, to); }
  void move_room(GradRoom to) { move<room_move_allowed>("room", room, to); }
  void move_param(ParamRead to) { move<param_move_allowed>("param", param, to); }
  void move_deferral(Deferral to) { move<deferral_move_allowed>("deferral", deferral, to); }
  void move_outcome(RunOutcome to) { move<outcome_move_allowed>("outcome", outcome, to); }
  //! The gradient is on host for the kernel (in a staging buffer or the chunk's own copy).
  bool grad_landed() const { return grad == GradStaging::kReady || grad == GradStaging::kInChunk; }
  bool parked() const { return deferral == Deferral::kParked; }
  bool carried() const { return deferral == Deferral::kCarried; }

 private:
  //! The one place a machine changes: `to` is checked against its table `kAllowed`
  //! (the message names the machine).
  template <auto kAllowed, typename State>
  static void move(const char* machine, State& state, State to) {
    STRATA_CHECK_MSG(kAllowed(state, to), machine);
    state = to;
  }
};

}  // namespace strata::runtime
