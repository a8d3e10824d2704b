#pragma once
// GradientOrder: when a caller hands each gradient to the runtime so that the
// families whose gradients are incomplete at once stay within the plan (Note
// [Gradients in pieces]). It decides only; the caller keeps what is kept back
// (strata.torch: runtime/include/strata/runtime/gradient_order.hpp; strata-contract: tests/contract/).
//
// Note [Gradients in pieces]
// The plan gives host room to the gradients of at most
// Runtime::incomplete_gradients_max() families that are incomplete at once (some
// of their tensors' gradients handed over in this micro-batch, not all: Note
// [Gradient completion] in runtime/src/runtime_impl.hpp). An evicted incomplete
// gradient waits there for its family's other gradients, and nothing else can free
// that room. A caller may hand gradients in an order that leaves many families
// incomplete at once: under torch, inside one torch.autocast region around several
// steps, each weight's bf16 cast is cached from the first step, and from the second
// step on autograd runs the cached casts' nodes (the oldest) last, so every weight's
// gradient comes at the end of backward, after the norms'. Every family packing a
// norm with a linear layer is then opened by its norm's gradient and waits, all at
// once; the run stopped mid-step once they outgrew the room (#24).
// So a gradient that would open a family beyond that number is kept back by the
// caller (strata.torch keeps the torch tensor it already is: torch's memory, as
// torch alone holds every gradient) and handed with its family's last one when it
// arrives (the family then completes at once and never waits), or when a family
// completes and frees a place (the oldest kept family opens), or when backward ends
// (end_backward: every family kept is handed). Handing order within a family
// changes no value: each tensor's gradient has its own place. In the warm-up step's
// order nothing is kept unless that order itself opens more families than the room
// holds.
// A tensor that gets no gradient in a micro-batch (a branch unused on this step)
// leaves its family incomplete until step(); many such families at once outgrew the
// room in the same way (a model with a branch per block unused on odd steps, 3 GPU
// slots: OutOfBudget in the second step, #24). So end_backward also lists, for every
// family some of whose gradients came, the tensors that got none, and the caller
// declares them (Runtime::no_gradient): open families complete first (their
// optimizer runs and frees the room), then each kept family is handed and completed
// in turn, so no more families are incomplete at once than before backward ended.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata::runtime {

class GradientOrder {
 public:
  //! The family of each of the caller's tensors (by the caller's index) and whether
  //! it is trainable (a frozen one gets no gradient and does not count).
  void set_families(std::vector<std::uint32_t> family_of, const std::vector<bool>& trainable);
  bool has_families() const { return !family_of_.empty(); }
  //! A new micro-batch: nothing handed yet, kept nothing (hand or drop it first);
  //! `limit` is Runtime::incomplete_gradients_max() (the plan may have changed).
  void begin_micro_batch(std::size_t limit);
  //! Tensor `t`'s gradient (`bytes` of it) arrives: appends to *hand, in order, the
  //! tensors to hand over now (t and its family's kept ones, perhaps a kept family
  //! that may open now), or keeps t back (appends nothing for it).
  void offer(std::uint32_t t, std::uint64_t bytes, std::vector<std::uint32_t>* hand);
  //! Appends every tensor kept back, family by family (backward ended).
  void take_kept(std::vector<std::uint32_t>* hand);
  //! What to do with one tensor when backward ends: hand its kept gradient, or
  //! declare that it got none in this micro-batch (Runtime::no_gradient).
  struct Handing {
    std::uint32_t tensor = 0;
    bool gradient = true;  //!< false: no gradient (declare it)
  };
  //! Backward ended: appends, in order, what completes every family some of whose
  //! gradients came: first the tensors of open families that got none, then family
  //! by family (oldest first) each kept family's kept tensors and its tensors that
  //! got none. Afterwards no family is open and nothing is kept.
  void end_backward(std::vector<Handing>* out);
  //! Whether end_backward has anything to do (a family open or kept).
  bool pending() const { return open_ > 0 || !kept_order_.empty(); }
  //! Forgets every tensor kept back (the step is discarded).
  void drop();

  bool keeps_any() const { return !kept_order_.empty(); }
  //! Tensors kept back since set_families, and the most bytes kept at once.
  std::uint64_t kept_total() const { return kept_total_; }
  std::uint64_t kept_bytes_peak() const { return kept_bytes_peak_; }
  //! Families incomplete now (something handed, not every trainable tensor).
  std::size_t open() const { return open_; }

 private:
  void take_family(std::uint32_t family, std::vector<std::uint32_t>* hand);
  void note_handed(std::uint32_t family, std::size_t tensors);

  void append_missing(std::uint32_t family, std::vector<Handing>* out);

  std::vector<std::uint32_t> family_of_;             //!< per tensor
  std::vector<std::vector<std::uint32_t>> members_;  //!< per family: its trainable tensors
  std::vector<std::uint8_t> seen_;                   //!< per tensor: offered in this micro-batch
  std::vector<std::uint64_t> bytes_;                 //!< per tensor kept back
  std::vector<std::uint32_t> expected_;              //!< trainable tensors per family
  std::vector<std::uint32_t> handed_;                //!< per family, this micro-batch
  std::vector<std::vector<std::uint32_t>> kept_;     //!< per family
  std::vector<std::uint32_t> kept_order_;            //!< families with tensors kept back, oldest first
  std::size_t open_ = 0;
  std::size_t limit_ = 0;  //!< 0: no limit known (nothing is kept)
  std::uint64_t kept_bytes_ = 0, kept_bytes_peak_ = 0, kept_total_ = 0;
};

}  // namespace strata::runtime
