// Optimizer names and defaults: the one place a name is parsed (the config, the
// probe and the Python binding call parse_optimizer) and torch's defaults live.
#include "strata/kernels/optim.hpp"

namespace strata::kernels {

Result<Optimizer> parse_optimizer(std::string_view name) {
  for (Optimizer o : {Optimizer::kAdam, Optimizer::kAdamW, Optimizer::kLamb, Optimizer::kLars,
                      Optimizer::kSgd, Optimizer::kLion, Optimizer::kAdagrad, Optimizer::kCame}) {
    if (optimizer_name(o) == name) return o;
  }
  return invalid_argument("unknown optimizer \"{}\": use adamw, adam, lamb, lars, sgd, lion, adagrad or came",
                          name);
}

Hyper optimizer_defaults(Optimizer optimizer) {
  Hyper h;
  h.optimizer = optimizer;
  switch (optimizer) {
    case Optimizer::kAdamW:
      h.weight_decay = 0.01f;
      break;
    case Optimizer::kLion:
      h.lr = 1e-4f;
      h.beta2 = 0.99f;
      break;
    case Optimizer::kAdagrad:
      h.lr = 1e-2f;
      h.eps = 1e-10f;
      break;
    case Optimizer::kCame:
      h.lr = 2e-4f;
      h.eps = 1e-30f;
      break;
    default:
      break;
  }
  return h;
}

}  // namespace strata::kernels
