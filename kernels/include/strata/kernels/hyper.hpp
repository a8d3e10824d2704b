#pragma once
// Which optimizer and its hyperparameters: one plain struct shared by every
// implementation. Fields an optimizer does not use are ignored by it.

#include <cstdint>
#include <string_view>

namespace strata::kernels {

//! The optimizers strata fuses. States per element in Span::state (see optim.hpp):
//!   kAdam, kAdamW, kLamb: [0] exp_avg, [1] exp_avg_sq
//!   kLars, kSgd, kLion:   [0] momentum buffer (SGD with momentum == 0: none)
//!   kAdagrad:             [0] sum of squares
//!   kCame:                its own tensor description (came.hpp)
enum class Optimizer : std::uint8_t { kAdam, kAdamW, kLamb, kLars, kSgd, kLion, kAdagrad, kCame };

//! "adam", "adamw", "lamb", "lars", "sgd", "lion", "adagrad", "came".
std::string_view optimizer_name(Optimizer optimizer);

//! Hyperparameters. Defaults are torch.optim's (or the paper's where torch has none).
//! Plain value type; validated by validate_hyper() (optim.hpp), never trusted blindly.
struct Hyper {
  Optimizer optimizer = Optimizer::kAdamW;
  float lr = 1e-3f;
  float beta1 = 0.9f;                //!< Adam family, Lion (0.9), CAME
  float beta2 = 0.999f;              //!< Adam family, Lion (0.99), CAME
  float beta3 = 0.9999f;             //!< CAME confidence EMA
  float eps = 1e-8f;                 //!< Adam family, Adagrad (1e-10), LARS denominator; CAME eps1 (1e-30)
  float eps2 = 1e-16f;               //!< CAME eps2 (instability term)
  float weight_decay = 0.0f;         //!< L2 for Adam/SGD/Adagrad/LARS, decoupled for AdamW/LAMB/Lion/CAME
  float momentum = 0.0f;             //!< SGD, LARS
  float dampening = 0.0f;            //!< SGD
  bool nesterov = false;             //!< SGD
  bool bias_correction = true;       //!< LAMB (Adam/AdamW always correct, as torch)
  float trust_coefficient = 0.001f;  //!< LARS eta
  bool lars_clip = false;            //!< LARS: clamp the trust ratio to <= 1 (LARC "clip" mode)
  float lr_decay = 0.0f;             //!< Adagrad
  float clip_threshold = 1.0f;       //!< CAME d (update RMS clip)
};

//! Full-size optimizer states per element (each as large as the fp32 master:
//! the chunk runtime gives each its own chunk, the probe sizes them): the one
//! place this count lives.
//!   kAdam, kAdamW, kLamb: 2;  kLars, kLion, kAdagrad: 1;
//!   kSgd: 1 with momentum, 0 without;
//!   kCame: 2 — its exp_avg, plus factored second moments (O(rows + cols) per
//!   tensor) rounded up to one more full-size state (the chunk runtime refuses
//!   CAME; the count sizes it).
constexpr std::uint32_t optimizer_state_count(const Hyper& h) {
  switch (h.optimizer) {
    case Optimizer::kAdam:
    case Optimizer::kAdamW:
    case Optimizer::kLamb:
    case Optimizer::kCame:
      return 2;
    case Optimizer::kSgd:
      return h.momentum != 0.0f ? 1 : 0;
    case Optimizer::kLars:
    case Optimizer::kLion:
    case Optimizer::kAdagrad:
      return 1;
  }
  return 2;
}

}  // namespace strata::kernels
