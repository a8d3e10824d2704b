// The runtime's view of a TrainSpec; see runtime_spec.hpp.
#include "runtime_spec.hpp"

#include "strata/common/bytes.hpp"
#include "strata/kernels/optim.hpp"
#include "strata/runtime/options.hpp"

namespace strata::probe {

runtime::RuntimeOptions runtime_options(const TrainSpec& spec) {
  runtime::RuntimeOptions ro;
  ro.compute_dtype = spec.compute_dtype;
  ro.hyper.optimizer = spec.optimizer;
  if (spec.optimizer == kernels::Optimizer::kSgd) ro.hyper.momentum = 0.9f;
  ro.state_dtype = spec.state_dtype;
  ro.budgets = {.gpu_bytes = kGiB, .host_bytes = kGiB, .nvme_bytes = 0};
  return ro;
}

Status check_supported(const TrainSpec& spec) {
  Status s = runtime::validate_options(runtime_options(spec));
  if (!s.ok()) {
    return invalid_argument("--optimizer {} --precision {} --state-dtype {}: the runtime refuses it: {}",
                            kernels::optimizer_name(spec.optimizer), runtime::dtype_name(spec.compute_dtype),
                            runtime::dtype_name(spec.state_dtype), s.message());
  }
  return Status::Ok();
}

}  // namespace strata::probe
