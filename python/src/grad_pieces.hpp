#pragma once
// GradPieces: when strata.torch hands each gradient to the runtime, so that the
// families whose gradients are incomplete at once stay within the plan (Note
// [Gradients in pieces]). The Engine (binding.cpp) owns one and hands what it says.
//
// Note [Gradients in pieces]
// The plan gives host room to the gradients of at most
// runtime::Runtime::incomplete_gradients_max() families that are incomplete at once
// (some of their tensors' gradients handed in this micro-batch, not all: Note
// [Gradient completion] in runtime/src/runtime_impl.hpp). An evicted incomplete
// gradient waits there for its family's other gradients, and nothing else can free
// that room. torch may hand gradients in an order that leaves many families
// incomplete at once: inside one torch.autocast region around several steps, each
// weight's bf16 cast is cached from the first step, and from the second step on
// autograd runs the cached casts' nodes (the oldest) last, so every weight's
// gradient comes at the end of backward, after the norms'. Every family packing a
// norm with a linear layer is then opened by its norm's gradient and waits, all at
// once, and the run stopped mid-step once they outgrew the room (#24).
// So a gradient that would open a family beyond that number is kept back, as the
// torch tensor it already is (torch's memory: torch alone holds every gradient), and
// handed with its family's last one, when it arrives (the family then completes at
// once and never waits), or when a family completes and frees a place (the oldest
// kept family opens), or when backward ends (every family kept is handed; one whose
// other gradients never came waits for step() as before). Handing order within a
// family does not change a value: each tensor's gradient has its own place. In the
// usual order no family is kept (the warm-up step's order fits the plan by
// construction). What is kept is counted (Engine.counters(): kept_gradients,
// kept_bytes_peak) and logged once per engine.

#include <torch/extension.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace strata::torch_binding {

class GradPieces {
 public:
  struct Piece {
    std::uint32_t param = 0;  //!< the Engine's index of the parameter
    at::Tensor grad;
    bool accumulate = false;  //!< Access::kAccumulate (a later micro-batch)
  };
  using Hand = std::function<void(const Piece&)>;

  //! Whether set_families() has run (the layout is fixed).
  bool has_families() const { return !family_of_.empty(); }
  //! The family of each parameter (by the Engine's index) and whether it is
  //! trainable (frozen ones get no gradient and do not count).
  void set_families(std::vector<std::uint32_t> family_of, const std::vector<bool>& trainable);
  //! A new micro-batch: nothing handed yet; the limit is read again (the plan may have changed).
  void begin_micro_batch();
  bool needs_limit() const { return limit_ == 0; }
  void set_limit(std::size_t limit) { limit_ = limit; }

  //! A parameter's gradient arrives: hands it (with its family's kept ones) or keeps it.
  void offer(Piece piece, const Hand& hand);
  //! Hands every kept gradient, family by family (backward ended, or step() begins).
  void hand_kept(const Hand& hand);
  //! Drops every kept gradient (the step is discarded).
  void drop();

  std::uint64_t kept_total() const { return kept_total_; }
  std::uint64_t kept_bytes_peak() const { return kept_bytes_peak_; }

 private:
  void hand_family(std::uint32_t family, const Hand& hand);
  void note_handed(std::uint32_t family, std::size_t pieces);
  void open_kept(const Hand& hand);

  std::vector<std::uint32_t> family_of_;   //!< per parameter
  std::vector<std::uint32_t> expected_;    //!< trainable tensors per family
  std::vector<std::uint32_t> handed_;      //!< gradients handed per family this micro-batch
  std::vector<std::vector<Piece>> kept_;   //!< per family
  std::vector<std::uint32_t> kept_order_;  //!< families with kept gradients, oldest first
  std::size_t open_ = 0;                   //!< families incomplete with something handed
  std::size_t limit_ = 0;                  //!< 0: to be read from the runtime
  std::uint64_t kept_bytes_ = 0;
  std::uint64_t kept_bytes_peak_ = 0;
  std::uint64_t kept_total_ = 0;
  bool logged_ = false;
};

}  // namespace strata::torch_binding
