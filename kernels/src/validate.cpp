// Hyperparameter and span validation: every expected misuse becomes an
// InvalidArgument naming the setting or span and what to do.
#include <cmath>
#include <cstdint>
#include <limits>

#include "strata/kernels/optim.hpp"

namespace strata::kernels {

std::string_view optimizer_name(Optimizer optimizer) {
  switch (optimizer) {
    case Optimizer::kAdam:
      return "adam";
    case Optimizer::kAdamW:
      return "adamw";
    case Optimizer::kLamb:
      return "lamb";
    case Optimizer::kLars:
      return "lars";
    case Optimizer::kSgd:
      return "sgd";
    case Optimizer::kLion:
      return "lion";
    case Optimizer::kAdagrad:
      return "adagrad";
    case Optimizer::kCame:
      return "came";
  }
  return "?";
}

namespace {

Status check_range(std::string_view opt, std::string_view name, float value, float lo, float hi,
                   bool hi_open) {
  if (!std::isfinite(value)) {
    return invalid_argument("{}: hyperparameter {} = {} is not finite; set a finite value", opt, name, value);
  }
  if (value < lo || value > hi || (hi_open && value == hi)) {
    return invalid_argument("{}: hyperparameter {} = {} is outside [{}, {}{}", opt, name, value, lo, hi,
                            hi_open ? ")" : "]");
  }
  return Status::Ok();
}

bool is_adam_family(Optimizer o) {
  return o == Optimizer::kAdam || o == Optimizer::kAdamW || o == Optimizer::kLamb;
}

int states_needed(const Hyper& h) {
  switch (h.optimizer) {
    case Optimizer::kAdam:
    case Optimizer::kAdamW:
    case Optimizer::kLamb:
      return 2;
    case Optimizer::kSgd:
    case Optimizer::kLars:
      return h.momentum != 0.0f ? 1 : 0;
    case Optimizer::kLion:
    case Optimizer::kAdagrad:
      return 1;
    case Optimizer::kCame:
      return 0;  // its own tensor description
  }
  return 0;
}

bool aligned_for(const void* p, DType d) {
  return reinterpret_cast<std::uintptr_t>(p) % dtype_size(d) == 0;
}

}  // namespace

Status validate_hyper(const Hyper& h) {
  const std::string_view o = optimizer_name(h.optimizer);
  const float big = std::numeric_limits<float>::max();
  STRATA_RETURN_IF_ERROR(check_range(o, "lr", h.lr, 0.0f, big, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "weight_decay", h.weight_decay, 0.0f, big, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "beta1", h.beta1, 0.0f, 1.0f, true));
  STRATA_RETURN_IF_ERROR(check_range(o, "beta2", h.beta2, 0.0f, 1.0f, true));
  STRATA_RETURN_IF_ERROR(check_range(o, "beta3", h.beta3, 0.0f, 1.0f, true));
  STRATA_RETURN_IF_ERROR(check_range(o, "eps", h.eps, 0.0f, big, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "eps2", h.eps2, 0.0f, big, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "momentum", h.momentum, 0.0f, 1.0f, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "dampening", h.dampening, 0.0f, 1.0f, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "trust_coefficient", h.trust_coefficient, 0.0f, big, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "lr_decay", h.lr_decay, 0.0f, big, false));
  STRATA_RETURN_IF_ERROR(check_range(o, "clip_threshold", h.clip_threshold, 0.0f, big, false));
  // Zero-padded tail lanes divide by eps (Note [One rule body, many widths]); torch never uses 0 either.
  const bool divides_by_eps = is_adam_family(h.optimizer) || h.optimizer == Optimizer::kAdagrad;
  if (divides_by_eps && !(h.eps > 0.0f)) {
    return invalid_argument("{}: eps = {} must be > 0 (it guards a division); use e.g. 1e-8", o, h.eps);
  }
  if (h.optimizer == Optimizer::kSgd && h.nesterov && (h.momentum == 0.0f || h.dampening != 0.0f)) {
    return invalid_argument(
        "sgd: nesterov needs momentum > 0 and dampening = 0 (got momentum = {}, dampening = {})", h.momentum,
        h.dampening);
  }
  if (h.optimizer == Optimizer::kLars && h.lars_clip && h.lr == 0.0f) {
    return invalid_argument("lars: lars_clip divides the trust ratio by lr; lr must be > 0");
  }
  return Status::Ok();
}

Status validate_spans(const Hyper& h, std::span<const Span> spans) {
  const std::string_view o = optimizer_name(h.optimizer);
  if (h.optimizer == Optimizer::kCame) {
    return invalid_argument("came: tensors go through came_step() (factored statistics need whole tensors)");
  }
  const int needed = states_needed(h);
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const Span& s = spans[i];
    if (s.n > std::numeric_limits<std::size_t>::max() / 8) {
      return invalid_argument("{}: span {} has n = {} elements, more than any memory holds", o, i, s.n);
    }
    if (s.grad_dtype != DType::kF32 && s.grad_dtype != DType::kBF16 && s.grad_dtype != DType::kF16) {
      return invalid_argument("{}: span {} grad dtype {} is unsupported; use fp32, bf16 or fp16", o, i,
                              dtype_name(s.grad_dtype));
    }
    if ((s.param == nullptr) != (s.param_dtype == DType::kNone)) {
      return invalid_argument("{}: span {} param pointer and param_dtype ({}) disagree; set both or neither",
                              o, i, dtype_name(s.param_dtype));
    }
    if (s.state_dtype != DType::kF32 && !(s.state_dtype == DType::kBF16 && is_adam_family(h.optimizer))) {
      return invalid_argument(
          "{}: span {} state dtype {} is unsupported; states are fp32 (bf16 only for adam, adamw, lamb)", o,
          i, dtype_name(s.state_dtype));
    }
    if (s.group_phase >= kGroupElems) {
      return invalid_argument(
          "{}: span {} group_phase = {} must be below {} (its first element's chunk offset mod {})", o, i,
          s.group_phase, kGroupElems, kGroupElems);
    }
    if (s.n == 0) continue;  // nothing is touched
    if (s.master == nullptr || s.grad == nullptr) {
      return invalid_argument("{}: span {} ({} elements) lacks its {} span", o, i, s.n,
                              s.master == nullptr ? "master" : "grad");
    }
    if (static_cast<const void*>(s.param) == static_cast<const void*>(s.master)) {
      return invalid_argument("{}: span {} param aliases master; for an fp32 param leave param null", o, i);
    }
    for (int k = 0; k < needed; ++k) {
      if (s.state[static_cast<std::size_t>(k)] == nullptr) {
        return invalid_argument("{}: span {} lacks state[{}] ({} keeps {} state span(s) per element)", o, i,
                                k, o, needed);
      }
      if (!aligned_for(s.state[static_cast<std::size_t>(k)], s.state_dtype)) {
        return invalid_argument("{}: span {} state[{}] is not aligned to its element size", o, i, k);
      }
    }
    if (!aligned_for(s.master, DType::kF32) || !aligned_for(s.grad, s.grad_dtype) ||
        (s.param != nullptr && !aligned_for(s.param, s.param_dtype))) {
      return invalid_argument("{}: span {} has a pointer not aligned to its element size", o, i);
    }
  }
  return Status::Ok();
}

float clip_coefficient(double global_norm, double max_norm) {
  const double c = max_norm / (global_norm + 1e-6);
  return static_cast<float>(c < 1.0 ? c : 1.0);
}

float nvlamb_grad_scale(double global_norm, double max_norm, double loss_scale) {
  const double ratio = global_norm / max_norm;
  return static_cast<float>(1.0 / (loss_scale * (ratio > 1.0 ? ratio : 1.0)));
}

}  // namespace strata::kernels
