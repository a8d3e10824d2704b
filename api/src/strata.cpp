// strata::Runtime: runtime::Runtime made from a Config, over a device it owns (memory::make_device).
#include "strata/strata.hpp"

#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"
#include "strata/runtime/options.hpp"

namespace strata {

Status Config::validate() const {
  STRATA_RETURN_IF_ERROR(device.validate());
  STRATA_RETURN_IF_ERROR(runtime::validate_options(runtime));
  if (runtime.budgets.gpu_bytes > device.budget_bytes) {
    return invalid_argument(
        "budgets.gpu = {} is larger than device.budget = {}: the chunk budget is part of "
        "the device's memory; lower budgets.gpu or raise device.budget",
        format_bytes(runtime.budgets.gpu_bytes), format_bytes(device.budget_bytes));
  }
  return Status::Ok();
}

Result<std::unique_ptr<Runtime>> Runtime::create(Config config) {
  STRATA_RETURN_IF_ERROR(config.validate());
  std::string why;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<memory::Device> device, memory::make_device(config.device, &why));
  STRATA_LOG_INFO("strata: device {} ({})", device->name(), why);
  runtime::RuntimeOptions options = config.runtime;
  std::unique_ptr<Runtime> rt(new Runtime(std::move(config), std::move(device)));
  STRATA_RETURN_IF_ERROR(rt->start(rt->device(), std::move(options)));
  return rt;
}

Runtime::Runtime(Config config, std::unique_ptr<memory::Device> device)
    : detail::OwnedDevice{std::move(device)}, config_(std::move(config)) {}

Runtime::~Runtime() = default;  // runtime::Runtime's destructor runs before OwnedDevice's

}  // namespace strata
