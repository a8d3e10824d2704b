#pragma once
// strata-example-lm's model: a byte-level MLP whose weights are strata tensors
// reached through leases, its math fp32 BLAS (cblas_sgemm) on the compute stream
// (Note [Example precision] and Note [Example device] in byte_lm.cpp).
// embed (256 x E) -> concat (C*E) -> `depth` ReLU layers of width H -> 256 logits,
// softmax cross-entropy on the next byte.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "strata/strata.hpp"

namespace strata::example {

// Activations and their gradients, host memory owned by the trainer.
struct Model {
  std::size_t C, E, H, D, B;
  TensorId embed;
  std::vector<TensorId> w, b;            // D hidden layers + the output layer
  std::vector<std::vector<float>> act;   // act[0] = gathered input (B x C*E), act[l+1] = layer l output
  std::vector<std::vector<float>> dact;  // gradients of act
  std::vector<int> ctx, next;            // B x C input bytes, B targets
  float loss = 0;

  std::size_t in_dim(std::size_t l) const { return l == 0 ? C * E : H; }
  std::size_t out_dim(std::size_t l) const { return l == D ? 256 : H; }
};

//! Registers the model's tensors with rt, initialises them from `seed` and sizes the activations.
Status build(Runtime& rt, Model& m, std::uint64_t seed);

//! One training step's forward and backward through leases (m.ctx and m.next set by the caller);
//! m.loss is the step's loss once the compute stream has run it.
Status train_step(Runtime& rt, Model& m);

}  // namespace strata::example
